"""Re-price the decode steps a `gpu_smoke.py --json` run recorded, under variants of the cost model.

Each recorded step carries what its prediction priced (the placement, blocks, tokens and the controller's refreshed
compute scale and link rate) and the run keeps its hardware profile, so the prediction can be rebuilt exactly (checked)
and priced again with one term changed. Per run it prints the medians over the steps of:

- stall: (measured stall + predicted compute) against the predicted step, as priced and with the profile's per-transfer
  latency set to 0 (is the latency charged as link time what makes the stall too long?);
- compute: measured against predicted compute, as priced (the profile's ``host_layer_compute_s`` once per layer some
  request reads from the host) and charged once per request's host layer instead.

Errors are (measured - predicted) / predicted. Needs no GPU.

Run: ``python benchmarks/gpu_reprice.py docs/results/gpu_runs/3a.json.gz docs/results/gpu_runs/3s.json.gz``
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from orbitflow.plan.hardware import HardwareProfile
from orbitflow.plan.placement import Placement


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def estimate(profile: HardwareProfile, link: str, priced: dict):
    """The cost model's estimate of a recorded step, as the controller priced it."""
    cm = profile.cost_model(transfer=link).with_updates(
        layer_compute_scale=np.asarray(priced["layer_compute_scale"]), link_blocks_per_s=priced["link_blocks_per_s"])
    mask = np.asarray(priced["on_device"], dtype=bool)
    return cm.step(Placement.from_mask(mask), priced["blocks"], total_tokens=priced["total_tokens"])


def reprice(run: dict) -> dict:
    """The medians of one overlap run (see the module docstring)."""
    profile = HardwareProfile.from_json(json.dumps(run["profile"]))
    no_latency = dataclasses.replace(profile, transfer_latency_s=0.0)
    per_layer = profile.host_layer_s(1)  # the depth the runs planned with (cost_model() below: one slot)
    rows = []
    for s in run["per_step"]:
        priced = s["priced"]
        est = estimate(profile, run["link"], priced)
        if abs(est.total_s - s["predicted_s"]) > 1e-9 * max(1.0, s["predicted_s"]):
            raise ValueError(f"step priced {s['predicted_s']} but rebuilt as {est.total_s}: not the recorded model")
        host = ~np.asarray(priced["on_device"], dtype=bool)
        extra = (int(host.sum()) - int(host.any(axis=0).sum())) * per_layer  # per request's host layer, not per layer
        stall_basis = s["stall_s"] + est.compute_s  # the measured stall on the predicted compute
        rows.append(((stall_basis - est.total_s) / est.total_s,
                     (stall_basis - (nl := estimate(no_latency, run["link"], priced).total_s)) / nl,
                     (s["compute_s"] - est.compute_s) / est.compute_s,
                     (s["compute_s"] - est.compute_s - extra) / (est.compute_s + extra)))
    med = [statistics.median(col) for col in zip(*rows)]
    return {"link": run["link"], "steps": len(rows), "stall_as_priced": med[0], "stall_no_latency": med[1],
            "compute_per_layer": med[2], "compute_per_request": med[3]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="gpu_smoke.py --json files (.json or .json.gz)")
    args = ap.parse_args(argv)
    print("| run | link | steps | stall, as priced | stall, no per-transfer latency | compute, per host layer "
          "(as priced) | compute, per request's host layer |")
    print("|---|---|---|---|---|---|---|")
    for path in args.runs:
        try:
            results = load(path)["results"]
        except (OSError, ValueError, KeyError) as exc:
            ap.error(f"{path}: not a gpu_smoke.py --json file ({exc})")
        for result in results:
            for run in result["overlap"]:
                if not run.get("steps"):
                    continue
                r = reprice(run)
                print(f"| {Path(path).name} | {r['link']} | {r['steps']} | {r['stall_as_priced']:+.1%} | "
                      f"{r['stall_no_latency']:+.1%} | {r['compute_per_layer']:+.1%} | "
                      f"{r['compute_per_request']:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
