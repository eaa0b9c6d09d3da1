"""Engine loop on a tiny model: Pause-Resume, Token-Deposit, chunked prefill, SRTF, the controller."""

import pytest
import torch
from tiny_models import hf_greedy, make_llm

from orbitflow.plan.hardware import HardwareProfile
from orbitflow.runtime.sampling import SamplingParams


def prompts(n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[int(x) for x in torch.randint(3, 250, (length + 7 * i,), generator=g)] for i in range(n)]


def tiny_profile(layers=6, link_bytes_per_s=1e9, device_kv_blocks=64):
    return HardwareProfile(name="tiny", num_layers=layers, kv_bytes_per_token_per_layer=2 * 2 * 16 * 4,
                           decode_a=1e-6, decode_b=6e-3, link_bytes_per_s=link_bytes_per_s,
                           device_kv_blocks=device_kv_blocks, host_kv_blocks=4096, block_size=16)


def test_pause_and_resume_under_a_budget_that_cannot_hold_the_batch(tiny_llama):
    ps = prompts(4, 40)
    ps[0] = ps[0] + ps[1][:24]  # the most KV: it is the victim (of equals the newest would wait its turn instead)
    reference = [hf_greedy(tiny_llama.hf, p, 48) for p in ps]
    # The planner believes in a slow link (2 MB/s): offloading everything would miss a 30 ms SLO, so the
    # batch cannot all run within 24 device blocks and someone must be paused.
    llm = make_llm(tiny_llama, profile=tiny_profile(device_kv_blocks=24, link_bytes_per_s=2e6),
                   device_kv_blocks=24, max_num_seqs=4, slo_ms=30, window_min=1, window_max=8)
    try:
        reqs = llm.generate(ps, SamplingParams(max_tokens=48, ignore_eos=False))
        stats = llm.engine.stats
        assert stats.pauses >= 1 and stats.resumes >= 1
        assert any(r.num_pauses > 0 for r in reqs)
        assert [r.output_ids for r in reqs] == reference
        assert llm.kv.usage() == (0, 0)
        assert all(rec.solve_s >= 0 for rec in llm.engine.controller.records)
        assert any(not rec.feasible for rec in llm.engine.controller.records)
    finally:
        llm.close()


def test_a_planner_budget_of_one_node_still_serves_correctly(tiny_llama):
    ps = prompts(4, 40, seed=1)
    reference = [hf_greedy(tiny_llama.hf, p, 32) for p in ps]
    llm = make_llm(tiny_llama, profile=tiny_profile(device_kv_blocks=40, link_bytes_per_s=2e7),
                   device_kv_blocks=40, max_num_seqs=4, slo_ms=60, window_min=1, window_max=8,
                   plan_node_limit=1)
    try:
        reqs = llm.generate(ps, SamplingParams(max_tokens=32, ignore_eos=False))
        assert [r.output_ids for r in reqs] == reference
        assert llm.kv.usage() == (0, 0)
        records = llm.engine.controller.records
        assert llm.engine.controller.solver_budget_hits == sum(not rec.proven for rec in records) >= 1
        # the certified gap the record carries: none for a proven plan, some where the budget cut a search
        assert all(rec.gap == 0 for rec in records if rec.proven)
        assert all(0 <= rec.gap < 1 for rec in records) and any(rec.gap > 0 for rec in records if not rec.proven)
    finally:
        llm.close()


def _gaps(times):
    return [b - a for a, b in zip(times, times[1:])]


def test_without_deposit_delivered_gaps_equal_generated_gaps(tiny_llama):
    llm = make_llm(tiny_llama, profile=tiny_profile(), token_deposit=False, slo_ms=1.0, max_num_seqs=2)
    try:
        reqs = llm.generate(prompts(2, 20), SamplingParams(max_tokens=20, ignore_eos=True))
        for r in reqs:
            assert r.delivered_s == r.generated_s
    finally:
        llm.close()


def test_deposit_hides_violations_when_early_steps_are_fast(tiny_llama):
    """A request decodes alone (fast steps bank a deposit), then a long prompt's prefill stalls it:
    the generated gap violates the SLO, the delivered stream does not."""
    from orbitflow.runtime.deposit import SLO_TOLERANCE_S, TokenDeposit

    d = TokenDeposit(slo_s=0.010)
    gen = [0.000, 0.002, 0.004, 0.006, 0.008, 0.010, 0.040, 0.042]  # a 30 ms hiccup after fast steps
    due = [d.push(i, t) for i, t in enumerate(gen)]
    generated_violations = sum(g > 0.010 + 1e-12 for g in _gaps(gen))
    delivered_violations = sum(g > 0.010 + 1e-12 for g in _gaps(due))
    assert generated_violations == 1 and delivered_violations == 0
    assert d.balance(0.011) == pytest.approx(5.9)  # tokens 2.. are held at t = 11 ms; the last is due at 70 ms
    held = TokenDeposit(slo_s=0.050)
    held.push(0, 0.0)
    held.push(1, 0.001)  # due at 50 ms
    assert held.balance(0.049) == pytest.approx(0.02)  # one token held, but due in 1 ms: a 50th of a pace, not 1
    assert held.balance(0.050) == 0.0 and TokenDeposit(0.05).balance(1.0) == 0.0
    burst = d.flush(0.045)
    assert [t for _, t in burst][-1] <= 0.045

    # The same effect inside the engine, with a real workload and clock.
    llm = make_llm(tiny_llama, profile=tiny_profile(), slo_ms=20.0, max_num_seqs=2)
    try:
        first = llm.engine.add_request("short", prompts(1, 8)[0], SamplingParams(max_tokens=40, ignore_eos=True))
        for _ in range(25):
            llm.engine.step()
        llm.engine.add_request("long", prompts(1, 600, seed=3)[0], SamplingParams(max_tokens=4, ignore_eos=True))
        llm.engine.run_until_done()
        slo = first.slo_s + SLO_TOLERANCE_S  # paced gaps are exactly the SLO, up to float rounding
        gen_viol = sum(g > slo for g in _gaps(first.generated_s))
        del_viol = sum(g > slo for g in _gaps(first.delivered_s))
        assert del_viol <= gen_viol
        assert llm.engine.stats.delivered_violations <= llm.engine.stats.generated_violations
    finally:
        llm.close()


def test_deposit_guard_paces_under_the_slo_and_the_planner_plans_for_that_pace(tiny_llama):
    """A stream paced exactly one SLO apart misses the SLO at the client whenever a token leaves later than the one
    before; --deposit-guard-ms paces under it, and the planner plans for the pace, not the looser SLO."""
    from orbitflow.config import ConfigError
    from orbitflow.runtime.engine import RequestRejected

    llm = make_llm(tiny_llama, profile=tiny_profile(), slo_ms=20.0, deposit_guard_ms=3.0, max_num_seqs=2)
    try:
        req = llm.engine.add_request("a", prompts(1, 8)[0], SamplingParams(max_tokens=30, ignore_eos=True))
        assert req.slo_s == pytest.approx(0.020) and req.pace_s == pytest.approx(0.017)
        assert req.plan_request(llm.engine.block_size).slo_s == pytest.approx(0.017)
        deposit = llm.engine.new_deposit(0.020)  # fast steps (1 ms apart): each token is held one pace after the last
        assert [deposit.push(t, t / 1000) for t in range(4)] == pytest.approx([0.0, 0.017, 0.034, 0.051])
        llm.engine.run_until_done()
        assert req.output_ids and llm.engine.kv.usage() == (0, 0)
        with pytest.raises(RequestRejected, match="--deposit-guard-ms"):  # a per-request SLO under the guard
            llm.engine.add_request("b", prompts(1, 8)[0], SamplingParams(max_tokens=3), slo_s=0.002)
    finally:
        llm.close()
    with pytest.raises(ConfigError, match="--deposit-guard-ms"):
        make_llm(tiny_llama, profile=tiny_profile(), slo_ms=20.0, deposit_guard_ms=20.0)
    auto = make_llm(tiny_llama, profile=tiny_profile(), slo_ms=20.0, deposit_guard_ms=None)  # serve's 'auto'
    try:
        short = auto.engine.add_request("a", prompts(1, 8)[0], SamplingParams(max_tokens=3), slo_s=0.020)
        long = auto.engine.add_request("b", prompts(1, 8)[0], SamplingParams(max_tokens=3), slo_s=0.200)
        assert short.pace_s == pytest.approx(0.018) and long.pace_s == pytest.approx(0.195)  # a tenth, at most 5 ms
    finally:
        auto.close()


def test_chunked_prefill_gives_the_same_tokens(tiny_llama):
    ps = prompts(3, 45, seed=5)
    reference = [hf_greedy(tiny_llama.hf, p, 16) for p in ps]
    llm = make_llm(tiny_llama, profile=tiny_profile(), chunked_prefill=16, max_num_seqs=3)
    try:
        reqs = llm.generate(ps, SamplingParams(max_tokens=16))
        assert [r.output_ids for r in reqs] == reference
        assert llm.engine.stats.prefill_steps >= 3  # 45+ tokens in chunks of 16
    finally:
        llm.close()


def test_srtf_admits_shortest_remaining_first(tiny_llama):
    llm = make_llm(tiny_llama, profile=tiny_profile(), scheduling="srtf", max_num_seqs=1)
    try:
        e = llm.engine
        long = e.add_request("long", prompts(1, 8)[0], SamplingParams(max_tokens=12, ignore_eos=True))
        short = e.add_request("short", prompts(1, 8)[0], SamplingParams(max_tokens=3, ignore_eos=True))
        e.run_until_done()
        assert short.finished_s < long.finished_s
    finally:
        llm.close()


def test_abort_frees_blocks_on_both_tiers(tiny_llama):
    llm = make_llm(tiny_llama, profile=tiny_profile(device_kv_blocks=30), device_kv_blocks=30, max_num_seqs=3)
    try:
        e = llm.engine
        for i, p in enumerate(prompts(3, 40)):
            e.add_request(f"r{i}", p, SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(5):
            e.step()
        assert llm.kv.usage() != (0, 0)
        for i in range(3):
            e.abort(f"r{i}")
        e.step()
        assert llm.kv.usage() == (0, 0)
        assert sorted((r.request_id, r.finish_reason) for r in e.finished) == [(f"r{i}", "abort") for i in range(3)]
    finally:
        llm.close()


def test_rejects_what_can_never_fit(tiny_llama):
    from orbitflow.runtime.engine import RequestRejected

    llm = make_llm(tiny_llama, profile=tiny_profile(), max_model_len=128)
    try:
        with pytest.raises(RequestRejected, match="exceeds the 128 tokens a request may hold here"):
            llm.engine.add_request("x", list(range(3, 100)), SamplingParams(max_tokens=64))
        with pytest.raises(RequestRejected, match="at least one token"):
            llm.engine.add_request("y", [], SamplingParams(max_tokens=4))
        # through the Python API, 0 generated a token and -59 shrank the KV admission reserves (a review's fuzzer)
        for bad in (0, -59, 2.5, True):
            with pytest.raises(RequestRejected, match=f"max_tokens must be an integer >= 1, got {bad!r}"):
                llm.engine.add_request("z", [5, 6, 7], SamplingParams(max_tokens=bad))
    finally:
        llm.close()


def test_a_token_id_outside_the_vocabulary_is_refused_and_fails_nobody_else(tiny_llama):
    """A prompt id past the vocabulary used to reach the embedding lookup, whose failure ended every request of the
    step; add_request now refuses it (the HTTP API checked, the Python API did not)."""
    from orbitflow.runtime.engine import RequestRejected

    vocab = tiny_llama.config.vocab_size
    llm = make_llm(tiny_llama, profile=tiny_profile())
    e = llm.engine
    try:
        good = e.add_request("good", [5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))
        for bad in (vocab, -1):
            with pytest.raises(RequestRejected, match=f"token id {bad} is not in the vocabulary \\(size {vocab}\\)"):
                e.add_request("bad", [5, bad], SamplingParams(max_tokens=4))
        e.add_request("edge", [0, vocab - 1], SamplingParams(max_tokens=2, ignore_eos=True))
        e.run_until_done()
        assert good.finish_reason == "length" and len(good.output_ids) == 4
        assert sorted(r.request_id for r in e.finished) == ["edge", "good"]
        assert llm.kv.usage() == (0, 0)
    finally:
        llm.close()


def test_keep_finished_keeps_the_newest_and_a_server_keeps_few(tiny_llama):
    """engine.finished held up to 100,000 requests with their ids and timestamps, read by nobody in a server."""
    from orbitflow.serve.async_engine import SERVED_FINISHED_KEPT, AsyncEngine

    llm = make_llm(tiny_llama, profile=tiny_profile())
    e = llm.engine
    try:
        for i in range(3):
            e.add_request(f"a{i}", [5, 6], SamplingParams(max_tokens=1, ignore_eos=True))
        e.run_until_done()
        e.keep_finished(2)
        assert [r.request_id for r in e.finished] == ["a1", "a2"]
        for i in range(3):
            e.add_request(f"b{i}", [5, 6], SamplingParams(max_tokens=1, ignore_eos=True))
        e.run_until_done()
        assert [r.request_id for r in e.finished] == ["b1", "b2"]
        with pytest.raises(ValueError, match="count must be >= 0"):
            e.keep_finished(-1)
        AsyncEngine(e, llm.tokenizer)
        assert e.finished.maxlen == SERVED_FINISHED_KEPT < 1000
    finally:
        llm.close()


def test_queue_limit_counts_requests_that_wait_not_aborts_or_free_places(tiny_llama):
    """--max-queue-len counts the requests that wait beyond the batch's free places, those still in the inbox
    included: a burst the batch can take at once is not turned away, and the inbox's abort messages (clients that
    hung up) are not requests."""
    import pickle

    from orbitflow.runtime.engine import QueueFull

    llm = make_llm(tiny_llama, profile=tiny_profile(), max_queue_len=2, max_num_seqs=2)
    try:
        e = llm.engine
        params = SamplingParams(max_tokens=4)
        for rid in "abcd":  # two places in the batch, two more may wait
            e.add_request(rid, [5, 6, 7], params)
            for i in range(5):  # disconnects pile up before the engine loop runs
                e.abort(f"gone-{rid}-{i}")
        assert e.num_queued() == 4 and e.free_seats() == 2
        with pytest.raises(QueueFull, match="--max-queue-len") as refused:
            e.add_request("e", [5, 6, 7], params)
        again = pickle.loads(pickle.dumps(refused.value))  # a cluster replica's refusal crosses processes whole
        assert isinstance(again, QueueFull) and again.retry_after_s == refused.value.retry_after_s >= 1
        e.step()  # takes the inbox: two run, two wait
        assert len(e.running) == 2 and e.num_queued() == 2 and e.free_seats() == 0
        with pytest.raises(QueueFull):
            e.add_request("e", [5, 6, 7], params)
        while e.has_work():
            e.step()
        e.add_request("e", [5, 6, 7], params)
        while e.has_work():
            e.step()
        assert sorted(r.request_id for r in e.finished) == list("abcde")
        assert llm.kv.usage() == (0, 0)
    finally:
        llm.close()


def test_a_request_id_in_use_is_refused_and_free_again_once_it_finished(tiny_llama):
    """A second live request with the same id would take the first's place in the scheduler and its KV table (a
    KeyError in a later step, which fails every request in flight): it is refused at once, the first is untouched, and
    the id may be used again once that request ended."""
    llm = make_llm(tiny_llama, profile=tiny_profile())
    try:
        e = llm.engine
        first = e.add_request("x", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        with pytest.raises(ValueError, match="'x' is already in use"):
            e.add_request("x", [8, 9], SamplingParams(max_tokens=3))
        e.run_until_done()
        assert first.finish_reason == "length" and len(first.output_ids) == 3
        again = e.add_request("x", [8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
        e.run_until_done()
        assert again.finish_reason == "length" and llm.kv.usage() == (0, 0)
    finally:
        llm.close()


def test_new_request_waits_while_both_pools_are_full_and_runs_when_one_finishes(tiny_llama):
    # 6 layers; each request needs ceil((40 + 60) / 16) = 7 blocks per layer = 42 blocks to finish, plus up
    # to 7 blocks of prefetch buffer: one fits in 30 + 60 blocks (49), a second does not, so it waits (it
    # used to end with "KV memory exhausted", a 500 to the client: issue 13's D3) until the first finishes.
    llm = make_llm(tiny_llama, profile=tiny_profile(), device_kv_blocks=30, host_kv_blocks=60, max_num_seqs=4)
    try:
        e = llm.engine
        ps = prompts(3, 40)
        reqs = [e.add_request(f"r{i}", p, SamplingParams(max_tokens=60, ignore_eos=True)) for i, p in enumerate(ps)]
        e.step()
        assert [r.request_id for r in e.running] == ["r0"] and [r.request_id for r in e.waiting] == ["r1", "r2"]
        e.run_until_done()
        assert [r.finish_reason for r in reqs] == ["length"] * 3
        assert all(len(r.output_ids) == 60 for r in reqs)
        assert reqs[1].generated_s[0] >= reqs[0].finished_s and reqs[2].generated_s[0] >= reqs[1].finished_s
        assert llm.kv.usage() == (0, 0)
    finally:
        llm.close()


def test_a_request_whose_sampling_fails_ends_alone(tiny_llama):
    # Issue 13's D1: one request's sampling failure used to fail the whole step, so every request in it ended
    # with an error. Now it ends alone, and the others produce exactly what they produce without it.
    ps = prompts(3, 12)
    good = SamplingParams(max_tokens=12, ignore_eos=True)
    bad = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, logit_bias=((10**6, 1.0),))
    llm = make_llm(tiny_llama, profile=tiny_profile(), max_num_seqs=4)
    try:
        solo = [r.output_ids for r in llm.generate([ps[0], ps[2]], good)]
        e = llm.engine
        reqs = [e.add_request("a", ps[0], good), e.add_request("bad", ps[1], bad), e.add_request("c", ps[2], good)]
        e.run_until_done()
        assert reqs[1].finish_reason == "error" and "sampling failed" in reqs[1].error
        assert [reqs[0].output_ids, reqs[2].output_ids] == solo
        assert [reqs[0].finish_reason, reqs[2].finish_reason] == ["length", "length"]
        assert llm.kv.usage() == (0, 0)
    finally:
        llm.close()


def test_admission_limit_charges_the_policys_prefetch_depth(tiny_llama):
    """DeepSpeed prefetches two layers per request: a request that fits the pools with one layer of buffer but
    not with two must be refused at once (it used to be accepted and then wait forever at the head of the
    queue, holding up everyone behind it)."""
    from orbitflow.policies import DeepSpeedPolicy
    from orbitflow.runtime.engine import RequestRejected

    # 6 layers; 40 + 24 tokens = 4 blocks per layer: 4 * (6 + 1) = 28 blocks fit in 29, 4 * (6 + 2) = 32 do not
    llm = make_llm(tiny_llama, policy=DeepSpeedPolicy(), profile=tiny_profile(device_kv_blocks=9),
                   device_kv_blocks=9, host_kv_blocks=20)
    try:
        assert llm.engine.prefetch_slots == 2
        with pytest.raises(RequestRejected, match="32 KV blocks"):
            llm.engine.add_request("x", list(range(3, 43)), SamplingParams(max_tokens=24))
        ok = llm.engine.add_request("y", list(range(3, 43)), SamplingParams(max_tokens=8))  # 3 * 8 = 24 blocks
        while llm.engine.has_work():
            llm.engine.step()
        assert ok.finish_reason == "length" and llm.kv.usage() == (0, 0)
    finally:
        llm.close()


def test_a_request_no_split_of_its_layers_fits_is_refused_at_once(tiny_llama):
    """Both pools together hold 4 blocks x (6 layers + 1 of prefetch) = 28 blocks = 13 + 15, but a layer's blocks
    live in one pool: the 15-block host holds 3 layers, the 13-block device 2 beside the buffer, and 3 + 2 < 6. The
    engine refuses it when it arrives (the server's 400 naming max_tokens), not after it ran out of room."""
    from orbitflow.runtime.engine import RequestRejected

    llm = make_llm(tiny_llama, profile=tiny_profile(device_kv_blocks=13), device_kv_blocks=13, host_kv_blocks=15)
    try:
        with pytest.raises(RequestRejected, match="no split of its 6 layers"):
            llm.engine.add_request("x", list(range(3, 43)), SamplingParams(max_tokens=24))
        ok = llm.engine.add_request("y", list(range(3, 43)), SamplingParams(max_tokens=8))  # 3 blocks a layer fit
        while llm.engine.has_work():
            llm.engine.step()
        assert ok.finish_reason == "length" and llm.kv.usage() == (0, 0)
    finally:
        llm.close()


@pytest.mark.parametrize("device, host, max_len, policy", [
    (13, 15, None, None),  # no split of the layers fits before the pools' sum is reached
    (20, 400, None, None),  # the device budget alone binds (the buffer needs a device layer's worth)
    (60, 12, 100, None),  # the context length binds
    (40, 200, None, "fixed:none"),  # the policy's fixed placement binds (every layer on the device)
])
def test_longest_servable_is_the_longest_request_add_request_accepts(tiny_llama, device, host, max_len, policy):
    """What a server advertises as its context (and gives a request without max_tokens): every length up to it is
    accepted, one token more is refused."""
    from orbitflow.policies import make_policy
    from orbitflow.runtime.engine import RequestRejected

    llm = make_llm(tiny_llama, policy=make_policy(policy) if policy else None,
                   profile=tiny_profile(device_kv_blocks=device), device_kv_blocks=device, host_kv_blocks=host,
                   max_model_len=max_len)
    try:
        longest = llm.engine.longest_servable()
        assert longest >= 2
        for total in (2, longest // 2, longest - 1, longest):
            llm.engine.add_request(f"ok{total}", [3] * (total // 2), SamplingParams(max_tokens=total - total // 2))
        with pytest.raises(RequestRejected):
            llm.engine.add_request("over", [3] * (longest // 2), SamplingParams(max_tokens=longest + 1 - longest // 2))
    finally:
        llm.close()


def test_a_request_whose_kv_is_dropped_while_paused_computes_it_again_and_gives_the_same_tokens(tiny_llama,
                                                                                              monkeypatch):
    """Recompute preemption on the real model: b steps aside for a (no plan holds it beside a's KV), then neither can
    run beside the other's KV, so b gives up its KV; once a ends, b prefills its prompt and outputs again and decodes
    on. Both are token-identical to transformers, and nothing leaks."""
    from scripted_policies import CrowdedPolicy

    ps = prompts(2, 40, seed=9)
    reference = [hf_greedy(tiny_llama.hf, p, 24) for p in ps]
    policy = CrowdedPolicy(cap=1, victim="a", layers=6)
    llm = make_llm(tiny_llama, policy=policy, profile=tiny_profile(), max_num_seqs=2)
    engine = llm.engine
    policy.scheduler = engine.scheduler
    monkeypatch.setattr(engine.controller, "_settle", lambda requests: policy.plan(requests, engine.controller.ctx))
    try:
        sampling = SamplingParams(max_tokens=24, ignore_eos=False)  # as transformers' generate stops
        a = engine.add_request("a", ps[0], sampling)
        engine.step()
        b = engine.add_request("b", ps[1], sampling)
        for _ in range(6):  # a is paused for b, which prefills and decodes 5 tokens
            engine.step()
        assert a.num_pauses == 1 and len(a.output_ids) == 1 and len(b.output_ids) == 6
        policy.crowded, policy.victim = {"a", "b"}, None
        engine.controller.forget()
        engine.run_until_done()
        assert engine.stats.recomputes == 1 and b.num_recomputes == 1 and b.num_pauses == 1
        assert [a.output_ids, b.output_ids] == reference and a.finished_s < b.finished_s
        assert llm.kv.usage() == (0, 0)
    finally:
        llm.close()
