"""Tensor parallelism in the engine: TP=2 over gloo (two rank processes) against one process, token for token."""

import os
import signal
import time

import pytest
from scripted_policies import OvertakingPolicy
from tiny_models import make_llm

from orbitflow.policies.base import PlanContext, default_slo_s
from orbitflow.policies.fixed import FixedPlacementPolicy
from orbitflow.runtime.clock import WallClock
from orbitflow.runtime.engine import Engine
from orbitflow.runtime.sampling import SamplingParams
from orbitflow.runtime.tp_executor import TensorParallelFailure

PROMPTS = [list(range(1, 70, 4)), [1, 7, 3, 8], [1] + list(range(90, 130))]
PLACEMENTS = ["none", "all", "distance:2", "random:3"]
SAMPLING = SamplingParams(max_tokens=12, ignore_eos=True)
TIMEOUT_S = 8.0


def _swap_engine(llm, policy) -> None:
    """A fresh engine with another placement policy over the same executor (the rank processes stay up)."""
    llm.engine.controller.close()
    ctx = PlanContext.from_profile(llm.config, llm.profile, policy)
    llm.kv.transfer.prefetch_slots = ctx.cost_model.prefetch_slots
    llm.engine = Engine(llm.config, llm.executor, policy, ctx, WallClock(), default_slo_s(llm.config, llm.profile),
                        llm.tokenizer.eos_token_ids, None)


@pytest.fixture(scope="module")
def tp2(tiny_llama):
    llm = make_llm(tiny_llama, policy=FixedPlacementPolicy("none"), max_num_seqs=3, link_gbps=0.5,
                   tensor_parallel_size=2, collective_timeout=TIMEOUT_S)
    yield llm
    llm.close()


def test_tp2_token_identical_to_tp1_under_every_placement(tiny_llama, tp2):
    started = time.monotonic()
    for placement in PLACEMENTS:
        one = make_llm(tiny_llama, policy=FixedPlacementPolicy(placement), max_num_seqs=3, compute_threads=1)
        expected = [r.output_ids for r in one.generate(PROMPTS, SAMPLING)]
        one.close()
        _swap_engine(tp2, FixedPlacementPolicy(placement))
        before = [r.bytes_h2d for r in tp2.executor.rank_stats]
        got = [r.output_ids for r in tp2.generate(PROMPTS, SAMPLING)]
        assert got == expected, placement
        assert tp2.kv.usage() == (0, 0)  # the shadow's pools: every block back
        ranks = tp2.executor.sync()
        assert [(r.device_blocks_used, r.host_blocks_used) for r in ranks] == [(0, 0), (0, 0)], placement
        moved = [r.bytes_h2d - b for r, b in zip(ranks, before)]
        if placement != "none":  # each rank moved its own shard (half the KV heads) over its own link
            assert moved[0] == moved[1] > 0, placement
        else:
            assert moved == [0, 0]
    assert started < tp2.executor.progress_at < time.monotonic()  # what /health reads: rank 0's last layer


# The overtaking test's window. A yield needs the shortest request's layer-0 slot released (at the start of layer 1's
# attention) while the longest's layer-4 fetch, which starts when that layer 0 has landed, still has a chunk to go: a
# window of (its blocks - 1) one-block chunks against layer 0's compute and layer 1's up to attention, which under TP
# wait on gloo all-reduces. Per rank a block is 2 KiB (one of the 2 KV heads): 10 ms on a 0.2 MB/s link, so a
# longest prompt of 301 tokens (19+ blocks) gives ~180 ms or more, where one layer took 3-23 ms on a loaded 2-core
# machine (0.5 MB/s and a 41-token prompt gave ~8-12 ms, and fetches did not always yield). Every decode step is a
# chance; the test needs one yield per rank.
OVERTAKING_LINK_GBPS = 0.0002
OVERTAKING_PROMPTS = PROMPTS[:2] + [[1] + [3 + (7 * i) % 250 for i in range(300)]]


def test_tp2_ranks_run_the_drivers_link_order(tiny_llama):
    """--kv-link preemptive (and its chunk) reaches every rank with each step: on a slow link in one-block chunks the
    ranks' fetches yield to earlier layers' (OvertakingPolicy), the tokens are still those of one process, and the
    driver counts every rank's yields (/metrics: orbitflow:kv_link_preemptions, and per rank tp_link_preemptions).
    What preemption does on a rank is the transfer engine's own, tested in tests/kv (test_transfer's overtaking_step,
    with the timing under the test's control)."""
    one = make_llm(tiny_llama, policy=FixedPlacementPolicy("random:3"), max_num_seqs=3, compute_threads=1)
    expected = [r.output_ids for r in one.generate(OVERTAKING_PROMPTS, SAMPLING)]
    one.close()
    tp2 = make_llm(tiny_llama, policy=OvertakingPolicy(), max_num_seqs=3, link_gbps=OVERTAKING_LINK_GBPS,
                   tensor_parallel_size=2, collective_timeout=TIMEOUT_S, kv_link="preemptive", kv_link_chunk_ms=1e-6)
    sent, send = [], tp2.executor._send  # what each rank is told to run (it unpacks depth, link and chunk together)
    tp2.executor._send = lambda messages: (sent.extend(m[2] for m in messages if m[0] == "step"), send(messages))
    try:
        got = [r.output_ids for r in tp2.generate(OVERTAKING_PROMPTS, SAMPLING)]
        assert got == expected
        driver = tp2.kv.transfer
        assert driver.chunk_s == pytest.approx(1e-9)  # one block a chunk: --kv-link-chunk-ms 1e-6
        assert len(sent) >= 2 * SAMPLING.max_tokens  # every step, to both ranks
        assert set(sent) == {(driver.prefetch_slots, "preemptive", driver.chunk_s)}
        ranks = tp2.executor.sync()
        assert [r.link for r in ranks] == ["preemptive", "preemptive"]
        assert [(r.device_blocks_used, r.host_blocks_used) for r in ranks] == [(0, 0), (0, 0)]
        assert all(r.preemptions > 0 for r in ranks), "no rank's fetch yielded: the test would prove nothing"
        assert tp2.stats().link_preemptions == sum(r.preemptions for r in ranks)
    finally:
        tp2.close()


def test_shadow_kv_replay_reaches_the_same_state():
    """The ranks' KV managers follow the driver's shadow through allocation, growth, moves, pauses, evictions
    and frees, including an op that fails part-way (placement moves go in rounds)."""
    from orbitflow.kv.manager import KVManager
    from orbitflow.runtime.tp_executor import ShadowKV, replay

    shadow = ShadowKV(4, 1, 8, 20, 40, block_size=4)
    rank = KVManager(4, 1, 8, 20, 40, block_size=4)
    shadow.allocate("a", 9, [True, True, False, False])
    shadow.allocate("b", 5, [True] * 4)
    shadow.grow("a", 13)
    shadow.apply_placements({"a": [False, True, True, False]})
    shadow.pause("b")
    shadow.allocate("c", 8, [True] * 4)  # evicts paused b's device layers to make room
    assert shadow.apply_placements({"a": [True] * 4, "c": [True] * 4}) is not None  # runs short part-way
    shadow.free("b")
    ops = shadow.take_ops()
    assert [name for name, _, _ in ops] == ["allocate", "allocate", "grow", "apply_placements", "pause",
                                            "allocate", "apply_placements", "free"]
    replay(rank, ops)
    assert rank.usage() == shadow.usage()
    for rid in ("a", "c"):
        assert rank.tables[rid].on_device == shadow.tables[rid].on_device
        assert rank.tables[rid].blocks_per_layer == shadow.tables[rid].blocks_per_layer
    assert "b" not in rank.tables and rank.paused == shadow.paused
    rank.close()
    shadow.close()


def test_shadow_kv_replays_the_room_made_for_a_prefetch_buffer():
    """The scheduler's room for a step's prefetch buffer evicts a paused request's device layers with a direct
    make_room call: the ranks replay it (unrecorded, the shadow's pools drifted from the ranks' and a later op ran
    short on one side only, which stops the group)."""
    from orbitflow.kv.manager import KVManager
    from orbitflow.runtime.tp_executor import ShadowKV, replay

    shadow = ShadowKV(2, 1, 8, 4, 8, block_size=4)
    rank = KVManager(2, 1, 8, 4, 8, block_size=4)
    shadow.allocate("a", 8, [True, True])  # the device pool full
    shadow.pause("a")
    assert shadow.make_room(4) is None  # a's layers to the host
    shadow.allocate("c", 8, [False, False])
    ops = shadow.take_ops()
    assert [name for name, _, _ in ops] == ["allocate", "pause", "make_room", "allocate"]
    replay(rank, ops)
    assert rank.usage() == shadow.usage() == (0, 8)
    assert rank.tables["a"].on_device == shadow.tables["a"].on_device == [False, False]
    rank.close()
    shadow.close()


def test_profile_measures_every_rank(tp2, tiny_llama):
    """`orbitflow profile --tensor-parallel-size 2`: rank 0's profile in one rank's units (its shard of the KV
    heads, its own link), every rank's compute, link and all-reduce figures beside it."""
    profile = tp2.executor.measure_profile("tiny@tp2", batch=3)
    assert [r for r, _ in profile.decode_batch_table] == [2, 3]  # every rank measured the engine's batch sizes
    config = tiny_llama.config
    assert profile.kv_bytes_per_token_per_layer == 2 * (config.num_kv_heads // 2) * config.head_dim * 4
    assert profile.link_bytes_per_s == pytest.approx(0.5e9)  # --link-gbps 0.5, per rank
    tp = profile.extra["tensor_parallel"]
    assert tp["size"] == 2 and [r["rank"] for r in tp["per_rank"]] == [0, 1]
    for r in tp["per_rank"]:
        assert r["decode_b"] > 0 and r["link_bytes_per_s"] > 0
        assert all(r[f"allreduce_{t}_tokens_s"] > 0 for t in (1, 4, 64))
    assert tp2.executor.sync()[1].device_blocks_used == 0  # the profiler's own pools were separate


def test_hung_rank_fails_the_step_within_the_collective_timeout(tp2):
    """Runs last on the module's executor: stop rank 1 (SIGSTOP, a hang); rank 0's all-reduce times out, the
    step's requests end with an error, every rank is stopped and the executor stays failed."""
    os.kill(tp2.executor._procs[1].pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel"):
        tp2.generate(PROMPTS[:1], SAMPLING)
    assert time.monotonic() - start < TIMEOUT_S + 15.0
    assert tp2.executor.failure is not None
    assert not any(p.is_alive() for p in tp2.executor._procs)
    with pytest.raises(TensorParallelFailure):
        tp2.executor.step([])


def test_smollm2_tp3_token_identical_to_tp1():
    """SmolLM2-135M split over 3 ranks (its 3 KV heads, one per rank), 16 greedy tokens, with offloading."""
    from orbitflow.config import EngineConfig
    from orbitflow.llm import LLM
    from orbitflow.model.loader import load_model

    prompts = ["The capital of France is", "def fibonacci(n):"]
    sampling = SamplingParams(max_tokens=16)
    outputs = {}
    loaded = load_model("smollm2-135m")
    for tp in (1, 3):
        config = EngineConfig.build(max_num_seqs=2, device_kv_blocks=4096, compute_threads=1,
                                    tensor_parallel_size=tp)
        llm = LLM(config, policy=FixedPlacementPolicy("distance:3"), profile="rough", loaded=loaded)
        try:
            outputs[tp] = [r.output_ids for r in llm.generate(prompts, sampling)]
            assert llm.kv.usage() == (0, 0)
            if tp == 3:  # a killed rank: the next step's requests fail at once (its process sentinel)
                llm.executor._procs[2].kill()
                start = time.monotonic()
                with pytest.raises(RuntimeError, match="tensor-parallel rank 2 died"):
                    llm.generate(prompts[:1], sampling)
                assert time.monotonic() - start < 10.0
                assert not any(p.is_alive() for p in llm.executor._procs)
        finally:
            llm.close()
    assert outputs[3] == outputs[1]
    assert all(len(o) == 16 for o in outputs[1])


def test_tp_size_must_divide_the_kv_heads(tiny_llama):
    from orbitflow.model.tensor_parallel import TensorParallelError, check_tp_size

    check_tp_size(tiny_llama.config, 2)
    with pytest.raises(TensorParallelError, match="--tensor-parallel-size 3 does not divide the model's KV heads"):
        make_llm(tiny_llama, tensor_parallel_size=3)


def test_a_failed_start_leaves_no_copy_thread_behind(tiny_llama, tmp_path):
    """Ranks that cannot load the model fail the start with ModelLoadError; the driver's shadow KV closes its copy
    thread too (each failed start leaked one)."""
    import shutil
    import threading

    from orbitflow.config import ParallelConfig
    from orbitflow.model.errors import ModelLoadError
    from orbitflow.model.loader import read_model_config
    from orbitflow.runtime.tp_executor import TensorParallelExecutor

    shutil.copy(tiny_llama.path / "config.json", tmp_path / "config.json")  # and no weights
    copy_threads = lambda: sum("kv-copy" in t.name for t in threading.enumerate())  # noqa: E731
    before = copy_threads()
    with pytest.raises(ModelLoadError, match="no .safetensors weights"):
        TensorParallelExecutor(tmp_path, read_model_config(tmp_path), ParallelConfig(tensor_parallel_size=2),
                               device_kv_blocks=8, host_kv_blocks=8, block_size=4, link_bytes_per_s=None, cuda=False)
    assert copy_threads() == before


@pytest.fixture(scope="module")
def slow_tp2(tiny_llama):
    """TP=2 with every layer's KV on the host behind a link that takes ~0.2 s per layer's fetch (a decode step of
    its 6 layers ~1.3 s)."""
    llm = make_llm(tiny_llama, policy=FixedPlacementPolicy("all"), max_num_seqs=1, link_gbps=2e-5,
                   tensor_parallel_size=2, collective_timeout=TIMEOUT_S)
    yield llm
    llm.close()


def test_a_long_step_that_advances_is_not_hung(slow_tp2):
    """The driver's deadline runs from rank 0's last progress (the layer it last started), not from the step's
    start: with a 0.8 s deadline, decode steps of ~1.3 s whose layers start every ~0.2 s finish (they failed the
    group)."""
    slow_tp2.executor.deadline_s = 0.8
    start = time.monotonic()
    out = slow_tp2.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].output_ids) == 3 and slow_tp2.executor.failure is None
    assert time.monotonic() - start > 2 * 0.8  # the steps did outlast the deadline


def test_a_rank_that_stops_reading_fails_a_large_send_at_the_deadline(slow_tp2):
    """Runs last on its executor: a message larger than the pipe's buffer to a stopped rank (SIGSTOP) blocked the
    driver's write for good; it is sent from a thread and fails the group at the deadline."""
    ex = slow_tp2.executor
    ex.deadline_s = 1.0
    os.kill(ex._procs[0].pid, signal.SIGSTOP)
    with pytest.raises(TensorParallelFailure, match="did not read its step"):
        ex._send([("step", b"x" * 4_000_000), ("step", b"")])
    assert not any(p.is_alive() for p in ex._procs)


def test_step_messages_carry_histories_only_where_a_penalty_reads_them():
    """Rank 0 gets a request's prompt and output only when its sampling has a penalty, the other ranks never: each
    step once sent every request's whole history to every rank."""
    from orbitflow.runtime.outputs import SeqInput
    from orbitflow.runtime.tp_executor import lead_inputs, silent_inputs

    history = (list(range(5000)), list(range(300)))
    plain = SeqInput("a", [7], 5300, True, SamplingParams(temperature=1.0, seed=3), 300, *history)
    penalised = SeqInput("b", [7], 5300, True, SamplingParams(repetition_penalty=1.3), 300, *history)
    lead = lead_inputs([plain, penalised])
    assert lead[0].prompt_ids == () and lead[0].output_ids == () and lead[0].generated == 300 and lead[0].sample
    assert (lead[1].prompt_ids, lead[1].output_ids) == history
    assert all(s.prompt_ids == () and s.output_ids == () and not s.sample for s in silent_inputs([plain, penalised]))
