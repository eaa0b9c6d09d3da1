"""Does the simulator predict the real engine? Same trace, same config, same measured profile, every policy.

1. Build the real engine on SmolLM2-135M with a small device KV budget (~0.3 of a full batch's KV) and a
   throttled host<->device link, so that offloading matters; measure its hardware profile.
2. Replay a small trace on the real engine (wall clock, requests fed at their arrival times) under each
   policy, and on the simulator (`simulate_trace`, virtual clock) with the measured profile.
3. Print both tables, the policy rankings and their agreement (Kendall tau), and how well the cost model
   predicts each real decode step: the step the simulator would charge (cost model over the measured
   profile, for the placement and batch of that step) and the controller's plan prediction.

Run: ``python benchmarks/sim_vs_engine.py [--quick]`` (prints tables only; no timed assertions).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import numpy as np  # noqa: E402

from orbitflow.bench.metrics import RequestRecord, RunMetrics, compute_metrics, format_table  # noqa: E402
from orbitflow.bench.workload import Trace, TraceRequest  # noqa: E402
from orbitflow.config import EngineConfig  # noqa: E402
from orbitflow.llm import LLM  # noqa: E402
from orbitflow.model.loader import LoadedModel, load_model  # noqa: E402
from orbitflow.plan import CostModel, Placement  # noqa: E402
from orbitflow.runtime.sampling import SamplingParams  # noqa: E402
from orbitflow.sim.profiles import HardwareProfile  # noqa: E402
from orbitflow.sim.runner import simulate_trace  # noqa: E402

MODEL = "smollm2-135m"
POLICIES = ["orbitflow", "flexgen+", "slo-aware", "dynamic", "deepspeed"]
RANK_KEYS = ("tbt_attainment", "tpot_attainment", "tokens_per_s")


@dataclass
class StepSample:
    measured_s: float
    sim_model_s: float  # what SimExecutor charges for this placement and batch
    plan_s: float | None  # the controller's prediction for the plan in force
    measured_stall_s: float = 0.0
    sim_stall_s: float = 0.0


@dataclass
class EngineRun:
    metrics: RunMetrics
    steps: list[StepSample] = field(default_factory=list)
    overhead_s: float = 0.0  # mean engine time per step outside the executor (planning, bookkeeping)


def make_trace(num: int, span_s: float, inputs: tuple[int, int], outputs: tuple[int, int], seed: int) -> Trace:
    rng = random.Random(seed)
    arrivals = sorted(rng.uniform(0, span_s) for _ in range(num - 1))
    return Trace([TraceRequest(f"r{i}", t, rng.randint(*inputs), rng.randint(*outputs))
                  for i, t in enumerate([0.0, *arrivals])])


def records_of(engine, offset: float) -> list[RequestRecord]:
    return [RequestRecord(request_id=r.request_id, arrival_s=r.arrival_s - offset, input_tokens=r.num_prompt,
                          output_tokens=len(r.output_ids), generated_s=[t - offset for t in r.generated_s],
                          delivered_s=[t - offset for t in r.delivered_s],
                          finished_s=None if r.finished_s is None else r.finished_s - offset, slo_s=r.slo_s,
                          num_pauses=r.num_pauses) for r in engine.finished]


def capture_steps(llm: LLM, cost_model: CostModel, samples: list[StepSample]) -> None:
    """Wrap the executor so that every decode step is recorded with what the cost model predicted for it."""
    engine, kv, inner = llm.engine, llm.kv, llm.executor.step

    def step(seqs):
        decode = all(s.start_pos > 0 and len(s.token_ids) == 1 for s in seqs)
        if decode:
            mask = np.array([kv.tables[s.req_id].on_device for s in seqs], dtype=bool)
            blocks = [kv.blocks_for(s.start_pos) for s in seqs]
            est = cost_model.step(Placement.from_mask(mask), blocks, total_tokens=sum(s.start_pos + 1 for s in seqs))
            plan = engine.controller.plan
        result = inner(seqs)
        if decode:
            samples.append(StepSample(result.step_s, float(est.total_s), plan.predicted_step_s if plan else None,
                                      result.stall_s, float(est.stall_s)))
        return result

    llm.executor.step = step


def run_engine(config: EngineConfig, loaded: LoadedModel, profile: HardwareProfile, trace: Trace,
               deadline_s: float) -> EngineRun:
    llm = LLM(config, profile=profile, loaded=loaded)
    engine, clock = llm.engine, llm.clock
    run = EngineRun(metrics=None)  # type: ignore[arg-type]
    capture_steps(llm, CostModel(profile.layer_compute_s, profile.link_blocks_per_s, num_layers=profile.num_layers),
                  run.steps)
    pending = list(trace)
    step_wall = 0.0
    start = clock.now()
    try:
        while pending or engine.has_work():
            now = clock.now() - start
            if now > deadline_s:
                print(f"  {config.policy}: stopped at the {deadline_s:.0f} s deadline", flush=True)
                break
            while pending and pending[0].arrival_s <= now:
                r = pending.pop(0)
                ids = [100 + (7 * j) % 900 for j in range(r.input_tokens)]
                engine.add_request(r.request_id, ids, SamplingParams(max_tokens=r.output_tokens, ignore_eos=True),
                                   arrival_s=start + r.arrival_s)
            t0 = clock.now()
            result = engine.step() if engine.has_work() else None
            step_wall += clock.now() - t0
            if result is None and pending and not engine.running:
                clock.sleep_until(start + pending[0].arrival_s)
            elif result is None and not engine.running:
                time.sleep(0.005)  # blocked on a paused request's re-admission; let time pass
    finally:
        stats, c = engine.stats, engine.controller
        run.metrics = compute_metrics(records_of(engine, start), engine.default_slo_s,
                                      device_mem_util=stats.device_mem_util, solver_calls=c.solver_calls,
                                      solver_time_s=c.solver_time_s, pauses=stats.pauses)
        run.overhead_s = (step_wall - stats.busy_s) / max(stats.steps, 1)
        llm.close()
    return run


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a over paired values (a pair tied on either side counts as neither)."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    score = sum(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]) for i, j in pairs)
    return float(score / len(pairs)) if pairs else math.nan


def ranking(rows: dict[str, dict], key: str) -> list[str]:
    return sorted(rows, key=lambda p: -rows[p][key])


def mdape(pred: list[float], meas: list[float]) -> float:
    return 100 * statistics.median(abs(p - m) / m for p, m in zip(pred, meas)) if meas else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests (~2 minutes)")
    parser.add_argument("--link-gbps", type=float, default=0.3, help="host<->device link throttle, GB/s")
    parser.add_argument("--budget", type=float, default=0.3, help="device KV budget as a fraction of a full batch's KV")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma list of policies")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.quick:
        trace = make_trace(5, 5.0, (64, 300), (12, 32), args.seed)
    else:
        trace = make_trace(8, 10.0, (64, 400), (16, 64), args.seed)
    max_num_seqs = 4

    loaded = load_model(MODEL)
    layers, block = loaded.config.num_layers, 16
    per_request = [math.ceil((r.input_tokens + r.output_tokens) / block) * layers for r in trace]
    batch_kv = statistics.mean(per_request) * max_num_seqs
    config = EngineConfig(model=MODEL, block_size=block, device_kv_blocks=max(int(args.budget * batch_kv),
                                                                                 max(per_request) // 2),
                          host_kv_blocks=sum(per_request) + 1024, link_gbps=args.link_gbps,
                          max_num_seqs=max_num_seqs, seed=args.seed)
    t0 = time.perf_counter()
    probe = LLM(config, profile="measure", loaded=loaded)
    profile = probe.profile
    probe.close()
    slo_ms = 1000 * probe.engine.default_slo_s
    print(f"{MODEL}: {len(trace)} requests over {trace.duration_s:.1f} s, inputs {min(r.input_tokens for r in trace)}-"
          f"{max(r.input_tokens for r in trace)}, outputs {min(r.output_tokens for r in trace)}-"
          f"{max(r.output_tokens for r in trace)} tokens; device budget {config.device_kv_blocks} blocks "
          f"(~{args.budget:.0%} of a batch of {max_num_seqs}), link {args.link_gbps} GB/s, SLO {slo_ms:.0f} ms "
          f"(scale {config.slo_scale}); profile: decode {1000 * profile.decode_b:.1f} ms + "
          f"{1e6 * profile.decode_a:.2f} us/token, measured in {time.perf_counter() - t0:.1f} s", flush=True)

    real: dict[str, EngineRun] = {}
    sim: dict[str, RunMetrics] = {}
    for name in policies:
        cfg = config.replace(policy=name)
        t0 = time.perf_counter()
        real[name] = run_engine(cfg, loaded, profile, trace, deadline_s=trace.duration_s + (60 if args.quick else 120))
        sim[name] = simulate_trace(profile, trace, cfg).metrics
        m = real[name].metrics
        print(f"  {name}: engine {time.perf_counter() - t0:.1f} s wall, {m.num_finished}/{m.num_requests} finished, "
              f"TBT att {m.tbt_attainment:.1%} (sim {sim[name].tbt_attainment:.1%})", flush=True)

    columns = [("policy", "Policy"), ("tbt_attainment", "TBT att"), ("tpot_attainment", "TPOT att"),
               ("p95_tbt_ms", "P95 TBT ms"), ("tokens_per_s", "tok/s"), ("throughput_rpm", "req/min"),
               ("num_pauses", "Pauses"), ("num_finished", "Done")]

    def row(name: str, m: RunMetrics) -> dict:
        return {"policy": name, **m.to_dict(), "p95_tbt_ms": 1000 * m.p95_tbt_s}

    rows = {"engine": {p: row(p, real[p].metrics) for p in policies},
            "simulator": {p: row(p, sim[p]) for p in policies}}
    for side, table in rows.items():
        print(format_table(list(table.values()), columns, title=f"{side}: {MODEL}, SLO {slo_ms:.0f} ms"))

    print("\nrankings (best first):")
    for key in RANK_KEYS:
        eng, sm = ranking(rows["engine"], key), ranking(rows["simulator"], key)
        tau = kendall_tau([rows["engine"][p][key] for p in policies], [rows["simulator"][p][key] for p in policies])
        print(f"  {key:16s} engine    {' > '.join(eng)}\n  {'':16s} simulator {' > '.join(sm)}\n"
              f"  {'':16s} same order: {eng == sm}, Kendall tau {tau:+.2f}")

    steps = [s for p in policies for s in real[p].steps]
    meas = [s.measured_s for s in steps]
    planned = [(s.plan_s, s.measured_s) for s in steps if s.plan_s]
    signed = statistics.median((s.sim_model_s - s.measured_s) / s.measured_s for s in steps) if steps else math.nan
    print(f"\ndecode steps measured: {len(steps)}; median {1000 * statistics.median(meas):.1f} ms")
    print(f"  simulator's step model vs measured: median abs error "
          f"{mdape([s.sim_model_s for s in steps], meas):.1f}% (median signed {100 * signed:+.1f}%)")
    stall_model = 1000 * statistics.median(s.sim_stall_s for s in steps)
    stall_meas = 1000 * statistics.median(s.measured_stall_s for s in steps)
    print(f"  of which stall (waiting for KV from the host): model {stall_model:.1f} ms, measured {stall_meas:.1f} ms"
          " (medians)")
    print(f"  controller plan prediction vs measured: median abs error "
          f"{mdape([p for p, _ in planned], [m for _, m in planned]):.1f}% over {len(planned)} steps")
    for p in policies:
        r = real[p]
        err = mdape([s.sim_model_s for s in r.steps], [s.measured_s for s in r.steps])
        print(f"  {p:10s} {len(r.steps):4d} steps, MdAPE {err:5.1f}%, "
              f"engine overhead outside the executor {1000 * r.overhead_s:.1f} ms/step")

if __name__ == "__main__":
    main()
