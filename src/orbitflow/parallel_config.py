"""How the engine spreads one model over several processes (tensor parallelism), and its CLI flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

TP_LINK_CHOICES = ("shared", "per-rank")


class ParallelConfigError(ValueError):
    """A parallelism setting is invalid; the message names the flag."""


@dataclass(frozen=True)
class ParallelConfig:
    # Ranks the model is split over (Megatron-style: heads and MLP units). 1: no parallelism, no extra processes.
    tensor_parallel_size: int = 1
    # How the ranks reach host memory: "per-rank" (each rank its own link at --link-gbps, e.g. one PCIe slot per
    # GPU) or "shared" (one link of --link-gbps split between the ranks, e.g. GPUs behind one PCIe switch).
    tp_link: str = "per-rank"
    # A collective that waits longer than this (a rank died or hangs) fails the step, the requests in flight and
    # /health, instead of hanging the server.
    collective_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ParallelConfigError(f"--tensor-parallel-size must be an integer >= 1, got {size!r}")
        if self.tp_link not in TP_LINK_CHOICES:
            raise ParallelConfigError(f"--tp-link must be one of {', '.join(TP_LINK_CHOICES)}, got {self.tp_link!r}")
        if not self.collective_timeout_s > 0:
            raise ParallelConfigError(f"--collective-timeout must be positive, got {self.collective_timeout_s!r}")

    def rank_link_bytes_per_s(self, link_bytes_per_s: float | None) -> float | None:
        """The throttle of one rank's link: the whole link per rank, or an equal share of one shared link."""
        if link_bytes_per_s is None or self.tp_link == "per-rank":
            return link_bytes_per_s
        return link_bytes_per_s / self.tensor_parallel_size


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    d = ParallelConfig()
    g = p.add_argument_group("tensor parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size, metavar="N",
                   help="split the model over N processes launched by orbitflow (gloo on the CPU, NCCL on CUDA); "
                        "N must divide the model's KV heads and intermediate size (with `profile`: every rank's "
                        "compute, link and all-reduce times are measured into the profile)")
    g.add_argument("--tp-link", choices=TP_LINK_CHOICES, default=d.tp_link,
                   help="per-rank: every rank has its own host link of --link-gbps; shared: the ranks share one "
                        "(each gets 1/N of it); the planner's cost model charges each rank the rate it gets")
    g.add_argument("--collective-timeout", type=float, default=d.collective_timeout_s, metavar="S",
                   help="a rank that dies or hangs for S seconds fails the requests in flight and /health")


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(tensor_parallel_size=args.tensor_parallel_size, tp_link=args.tp_link,
                          collective_timeout_s=args.collective_timeout)
