"""Tensor parallelism in the engine: the engine's executor role, played by a driver over N rank processes.

The engine process (the "driver") keeps everything that decides: the scheduler, the controller and the
planner run once, there. It holds a *shadow* KV manager: the real manager's block accounting over Hkv/N heads
(one rank's shard) without storage, so the engine, the planner and /metrics see exactly the blocks and bytes of
one rank. Every call of the engine that changes the KV state (allocate, grow, apply placements, i.e. the
evictions and moves, pause, free) is recorded on the shadow as it happens.

The ranks are processes that orbitflow starts itself (``torch.multiprocessing`` spawn, no torchrun), joined in one
``torch.distributed`` group (gloo on the CPU, NCCL on CUDA) whose collectives time out after
``collective_timeout_s``. Each rank owns its model shard (`orbitflow.model.tensor_parallel`), its shard of both
KV pools and its own link (a KV manager with its own transfer engine: copy thread and throttle on the CPU,
copy stream on CUDA), under an ordinary `ModelExecutor`.

Per step the driver broadcasts to every rank: the recorded KV operations since the last step (each rank replays
them, so its block table is the shadow's), the prefetch depth and the batch (`SeqInput`s: token ids, positions,
sampling inputs; each rank derives the prefetch lists from the placement in its replayed table, exactly as the
driver's shadow would). Every rank runs the step; the forward all-reduces after attention and after the MLP.
Only rank 0 computes logits and samples: the sampled tokens (with logprobs) come back from rank 0, the other
ranks send back only their timings and counters (per-rank KV use and link bytes, for /metrics).

Faults: a rank that dies is seen at once (its process sentinel); a rank that hangs makes the others' next
collective time out, and they report it; the driver itself never waits longer than a deadline. Any of these
fails the step (its requests end with an error), stops every rank and marks the executor failed: later steps
fail at once, and /health reports it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import torch

from orbitflow.config import ConfigError, ParallelConfig
from orbitflow.kv.manager import KVManager
from orbitflow.kv.pool import Shortage
from orbitflow.model.config import ModelConfig
from orbitflow.model.errors import ModelLoadError
from orbitflow.model.tensor_parallel import check_tp_size, shard_config
from orbitflow.runtime.executor import Executor
from orbitflow.runtime.outputs import ScheduleOutput, SeqInput, StepResult

log = logging.getLogger("orbitflow.tensor_parallel")

# A message this small fits the pipe's buffer whole, so sending it cannot block on a rank that stopped reading.
_UNBLOCKED_SEND_BYTES = 32 * 1024

# Ops of the KV manager that change its state; the shadow records them, the ranks replay them in order.
_RECORDED_OPS = ("allocate", "grow", "apply_placements", "pause", "make_room", "free")


class TensorParallelFailure(RuntimeError):
    """A rank died, hung past the collective timeout, or failed a step: the group is unusable."""


class ShadowKV(KVManager):
    """One rank's KV accounting without storage, recording every state-changing call for the ranks to replay.

    A call made inside another recorded call (allocate grows the request) is not recorded twice. A call that
    ran short (allocate's None, a Shortage) is recorded too, with the mark: it may have changed some state
    before stopping (placement moves go in rounds), and a rank replaying it must end in the same state and
    run short the same way.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, materialize=False, **kwargs)
        self.ops: list[tuple[str, tuple, bool]] = []
        self._depth = 0
        self.on_close = None
        self.on_free = None  # called after a request's blocks are freed (the ranks then free theirs at once)

    def _record(self, name: str, *args):
        top = self._depth == 0
        self._depth += 1
        try:
            result = getattr(super(), name)(*args)
        finally:
            self._depth -= 1
        if top:
            self.ops.append((name, args, _ran_short(name, result)))
        return result

    def allocate(self, req_id, num_tokens, on_device):
        return self._record("allocate", req_id, num_tokens, list(on_device))

    def grow(self, req_id, num_tokens):
        return self._record("grow", req_id, num_tokens)

    def apply_placements(self, rows):
        return self._record("apply_placements", {rid: list(row) for rid, row in rows.items()})

    def pause(self, req_id):
        return self._record("pause", req_id)

    def make_room(self, blocks, exclude=None):
        return self._record("make_room", blocks, exclude)

    def free(self, req_id):
        if req_id not in self.tables and req_id not in self.paused:
            return  # it never held KV (e.g. aborted while waiting): nothing for the ranks to do, no round trip
        self._record("free", req_id)
        if self._depth == 0 and self.on_free is not None:
            self.on_free()

    def take_ops(self) -> list[tuple[str, tuple, bool]]:
        ops, self.ops = self.ops, []
        return ops

    def close(self) -> None:
        super().close()
        if self.on_close is not None:
            self.on_close()


def _ran_short(name: str, result) -> bool:
    """Whether a KV manager call ran short of blocks (its answer, not an error: see KVManager)."""
    return isinstance(result, Shortage) or (name == "allocate" and result is None)


def replay(kv: KVManager, ops: list[tuple[str, tuple, bool]]) -> None:
    """Apply the shadow's recorded ops to a rank's KV manager; a divergence (an op running short here but not
    on the shadow, or the reverse) raises."""
    for name, args, short in ops:
        if name not in _RECORDED_OPS:
            raise ValueError(f"unknown KV op {name!r}")
        if _ran_short(name, getattr(kv, name)(*args)) != short:
            side = "the driver's shadow" if short else "this rank"
            raise RuntimeError(f"KV op {name}{args!r} ran short on {side} only")


@dataclass
class RankStats:
    """What one rank reports after each step: its KV pools and link counters (cumulative)."""

    rank: int
    device_blocks_used: int
    host_blocks_used: int
    block_bytes: int  # of one block on this rank (its shard of the KV heads)
    bytes_h2d: int
    bytes_d2h: int
    step_s: float  # of its last step (0 before the first)
    stall_s: float
    link: str = "edf"  # the link order it runs (the driver's, sent with every step)
    preemptions: int = 0  # its fetches that yielded the link to an earlier layer's (cumulative)


@dataclass
class _WorkerSpec:
    model_dir: str
    size: int
    init_method: str
    backend: str
    timeout_s: float
    device_blocks: int
    host_blocks: int
    block_size: int
    dtype: torch.dtype
    link_bytes_per_s: float | None  # this rank's throttle
    threads: int | None
    cuda: bool


# ---- the rank process -----------------------------------------------------------------------------------
def _rank_stats(rank: int, kv: KVManager, result: StepResult | None = None) -> RankStats:
    device_used, host_used = kv.usage()
    return RankStats(rank, device_used, host_used, kv.device_pool.bytes_per_block, kv.transfer.bytes_h2d,
                     kv.transfer.bytes_d2h, result.step_s if result else 0.0, result.stall_s if result else 0.0,
                     kv.transfer.link, kv.transfer.preemptions)


def _measure_allreduce(hidden: int, dtype: torch.dtype, device, repeats: int = 15) -> dict[str, float]:
    """Median seconds of one all-reduce of a [tokens, hidden] activation, for a few token counts (the decode
    step of 1 and 4 requests, a prefill chunk)."""
    import torch.distributed as dist

    out = {}
    for tokens in (1, 4, 64):
        x = torch.ones(tokens, hidden, dtype=dtype, device=device)
        times = []
        for i in range(repeats + 2):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - start)
        out[f"allreduce_{tokens}_tokens_s"] = float(np.median(times))
    return out


def _start_rank(rank: int, spec: _WorkerSpec):
    """Join the process group, load this rank's shard and its KV pools; returns (executor, shard config)."""
    from datetime import timedelta

    import torch.distributed as dist

    from orbitflow.model.loader import read_model_config
    from orbitflow.model.tensor_parallel import build_shard
    from orbitflow.runtime.executor import ModelExecutor

    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    device = torch.device(f"cuda:{rank}") if spec.cuda else torch.device("cpu")
    if spec.cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(spec.backend, init_method=spec.init_method, rank=rank, world_size=spec.size,
                            timeout=timedelta(seconds=spec.timeout_s))
    config = read_model_config(Path(spec.model_dir))
    local = shard_config(config, spec.size)
    model = build_shard(spec.model_dir, rank, spec.size, dtype=spec.dtype, device=device)
    kv = KVManager(local.num_layers, local.num_kv_heads, local.head_dim, spec.device_blocks, spec.host_blocks,
                   block_size=spec.block_size, dtype=spec.dtype, device=device,
                   link_bytes_per_s=spec.link_bytes_per_s)
    return ModelExecutor(model, local, kv), local


def _serve_rank(rank: int, spec: _WorkerSpec, conn, executor, local) -> None:
    """Answer the driver's messages (replay its KV ops, then step, sync or profile) until it stops or a
    message fails (the group's state is unknown then: report and stop)."""
    kv = executor.kv
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the driver is gone
            return
        kind = message[0]
        if kind == "stop":
            return
        try:
            replay(kv, message[1])
            if kind == "step":
                _, _, (kv.transfer.prefetch_slots, kv.transfer.link, kv.transfer.chunk_s), seqs = message
                result = executor.step(seqs)
                conn.send(("ok", result, _rank_stats(rank, kv, result)))
            elif kind == "sync":
                conn.send(("ok", _rank_stats(rank, kv)))
            elif kind == "profile":
                kv.transfer.link, kv.transfer.chunk_s = message[3]
                from orbitflow.runtime.profiler import profile_executor

                profile = profile_executor(executor, name=message[2], batch=message[4])
                allreduce = _measure_allreduce(local.hidden_size, spec.dtype, executor.device)
                conn.send(("ok", profile, allreduce))
            else:
                raise ValueError(f"unknown message {kind!r}")
        except BaseException as exc:  # noqa: BLE001 - reported to the driver, which fails cleanly
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            conn.send(("error", f"rank {rank}: {detail}"))
            return


def _worker_main(rank: int, spec: _WorkerSpec, conn, progress) -> None:
    import torch.distributed as dist

    executor = None
    try:
        executor, local = _start_rank(rank, spec)
        if rank == 0:  # the ranks run the layers in step: rank 0's tell the driver's watchdog that a step advances
            executor.progress_cell = progress
        conn.send(("ok", _rank_stats(rank, executor.kv)))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which fails cleanly
        conn.send(("error", f"rank {rank} failed to start: {type(exc).__name__}: {exc}"))
        return
    try:
        _serve_rank(rank, spec, conn, executor, local)
    finally:
        executor.kv.close()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may not tear down cleanly; the process ends anyway
            pass


# ---- the driver -----------------------------------------------------------------------------------------
def lead_inputs(seqs: list[SeqInput]) -> list[SeqInput]:
    """Rank 0's batch: it samples, and it gets a request's token histories only when a penalty reads them (a step
    message once carried every request's whole prompt and output, each step, to each rank)."""
    return [s if s.sampling.reads_history else replace(s, prompt_ids=(), output_ids=()) for s in seqs]


def silent_inputs(seqs: list[SeqInput]) -> list[SeqInput]:
    """The other ranks' batch: only rank 0 samples, so no sampling inputs and no histories."""
    return [replace(s, sample=False, prompt_ids=(), output_ids=()) for s in seqs]


class TensorParallelExecutor(Executor):
    """The engine's executor over `parallel.tensor_parallel_size` rank processes (see the module docstring)."""

    def __init__(self, model_dir, model_config: ModelConfig, parallel: ParallelConfig, *, device_kv_blocks: int,
                 host_kv_blocks: int, block_size: int, link_bytes_per_s: float | None,
                 dtype: torch.dtype = torch.float32, compute_threads: int | None = None,
                 startup_timeout_s: float = 600.0, cuda: bool | None = None) -> None:
        """``cuda``: one GPU per rank (True: required), the CPU with gloo (False), or None: GPUs when there are
        enough of them."""
        size = parallel.tensor_parallel_size
        check_tp_size(model_config, size)
        self.size = size
        self.parallel = parallel
        self.config = model_config
        self.shard = shard_config(model_config, size)
        self.num_layers = model_config.num_layers
        self.block_size = block_size
        self._failure: str | None = None
        self._stopped = False
        # A rank that hangs makes its peers' collective time out; past that (and a margin for the step's own
        # compute), the driver stops waiting for the ranks at all.
        self.deadline_s = 4 * parallel.collective_timeout_s + 30.0
        rank_link = parallel.rank_link_bytes_per_s(link_bytes_per_s)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if cuda and gpus < size:
            raise ConfigError(f"--device cuda with --tensor-parallel-size {size} needs {size} GPUs; this machine has "
                             f"{gpus}")
        self.kv = ShadowKV(self.num_layers, self.shard.num_kv_heads, self.shard.head_dim, device_kv_blocks,
                           host_kv_blocks, block_size=block_size, dtype=dtype, link_bytes_per_s=rank_link)
        self.kv.on_close = self.close
        self.kv.on_free = self._sync_quietly
        cuda = gpus >= size if cuda is None else cuda
        if compute_threads is None and not cuda:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            compute_threads = max(1, cores // size)
        self._store_dir = tempfile.mkdtemp(prefix="orbitflow-tp-")
        spec = _WorkerSpec(
            model_dir=str(model_dir), size=size, init_method=f"file://{self._store_dir}/store",
            backend="nccl" if cuda else "gloo", timeout_s=parallel.collective_timeout_s,
            device_blocks=device_kv_blocks, host_blocks=host_kv_blocks, block_size=block_size, dtype=dtype,
            link_bytes_per_s=rank_link, threads=compute_threads, cuda=cuda,
        )
        self.backend = spec.backend
        ctx = mp.get_context("spawn")
        self._conns = []
        self._procs = []
        self._progress = ctx.Value("d", 0.0, lock=False)  # time.monotonic() when rank 0 last started a layer
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, spec, child, self._progress),
                               name=f"orbitflow-tp-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            replies = self._gather(startup_timeout_s)
        except TensorParallelFailure as exc:  # a usage-level error for the CLI (bad model files, no memory, ...)
            shutil.rmtree(self._store_dir, ignore_errors=True)
            KVManager.close(self.kv)  # its copy thread; not self.close (the ranks are stopped already)
            raise ModelLoadError(str(exc)) from exc
        self.rank_stats: list[RankStats] = [reply[1] for reply in replies]

    @property
    def progress_at(self) -> float:
        """``time.monotonic()`` when rank 0 last started a layer (the server's watchdog: a long step advances);
        the monotonic clock is the machine's, so the ranks' readings compare with this process's."""
        return float(self._progress.value)

    @property
    def failure(self) -> str | None:
        """Why the group cannot run steps any more (None while it can). A rank that died while the engine was
        idle counts at once, so /health reports it before the next request meets it."""
        if self._failure is None:
            dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
            if dead:
                self._failure = f"tensor-parallel rank {dead[0]} died (exit code {self._procs[dead[0]].exitcode})"
        return self._failure

    # ---- messaging ------------------------------------------------------------------------------------
    def _send(self, messages: list) -> None:
        if self.failure is not None:
            self._fail(self.failure)
        for rank, (conn, message) in enumerate(zip(self._conns, messages)):
            data = ForkingPickler.dumps(message)  # what conn.send(message) sends
            try:
                if len(data) <= _UNBLOCKED_SEND_BYTES:
                    conn.send_bytes(data)
                else:
                    self._send_large(rank, conn, data)
            except (BrokenPipeError, ConnectionError, OSError) as exc:
                self._fail(f"tensor-parallel rank {rank} is gone ({type(exc).__name__})")

    def _send_large(self, rank: int, conn, data) -> None:
        """Send a message larger than the pipe's buffer from a thread, so that a rank that stopped reading (a hang)
        fails the group at the deadline instead of blocking the engine in a write for good."""
        errors: list[BaseException] = []

        def send() -> None:
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, ConnectionError, OSError) as exc:  # the group was stopped meanwhile
                errors.append(exc)

        sender = threading.Thread(target=send, name=f"orbitflow-tp-send-{rank}", daemon=True)
        sender.start()
        sender.join(self.deadline_s)
        if sender.is_alive():
            self._fail(f"tensor-parallel rank {rank} did not read its step within {self.deadline_s:.0f} s (hung); "
                       "the group was stopped")
        if errors:
            raise errors[0]

    def _gather(self, deadline_s: float | None = None) -> list[tuple]:
        """One reply from every rank; a dead rank, an error reply or the deadline fails the group. The deadline
        (``deadline_s``: from the call, at start-up) runs from rank 0's last progress, the layer it last started: a
        long step that advances (a long prefill, a throttled link) is not hung, and a rank that hangs stops rank 0
        at its next collective."""
        limit = self.deadline_s if deadline_s is None else deadline_s
        start = time.monotonic()
        replies: dict[int, tuple] = {}
        while len(replies) < self.size:
            waiting = {self._conns[r]: r for r in range(self.size) if r not in replies}
            sentinels = {self._procs[r].sentinel: r for r in range(self.size)}
            since = start if deadline_s is not None else max(start, self.progress_at)
            left = since + limit - time.monotonic()
            if left <= 0:
                late = sorted(waiting.values())
                self._fail(f"tensor-parallel rank(s) {late} did not answer within {limit:.0f} s "
                           "(hung); the group was stopped")
            ready = wait(list(waiting) + list(sentinels), timeout=left)
            for obj in ready:
                if obj in waiting:
                    rank = waiting[obj]
                    try:
                        reply = obj.recv()
                    except (EOFError, OSError):
                        continue  # its sentinel says why
                    if reply[0] == "error":
                        self._fail(self._cause(reply[1]))
                    replies[rank] = reply
            for obj in ready:
                if obj in sentinels and not self._procs[sentinels[obj]].is_alive():
                    rank = sentinels[obj]
                    if rank in replies and len(replies) == self.size:
                        continue
                    code = self._procs[rank].exitcode
                    self._fail(f"tensor-parallel rank {rank} died (exit code {code})")
        return [replies[r] for r in range(self.size)]

    def _cause(self, error: str) -> str:
        """What to report for a rank's error: a peer that died is the cause (the error is its consequence)."""
        time.sleep(0.2)  # a dead peer's process may take a moment to be reaped
        dead = [r for r, p in enumerate(self._procs) if p.exitcode not in (None, 0)]
        if dead:
            codes = ", ".join(f"rank {r} (exit code {self._procs[r].exitcode})" for r in dead)
            return f"tensor-parallel rank {dead[0]} died: {codes}; then {error}"
        return f"tensor-parallel {error}"

    def _fail(self, message: str) -> None:
        """Record the first failure, stop every rank (once) and raise."""
        if self._failure is None:
            self._failure = message
        if not self._stopped:
            log.error("%s", self._failure)
            self._stop_ranks(graceful=False)
        raise TensorParallelFailure(self._failure)

    def _stop_ranks(self, graceful: bool) -> None:
        self._stopped = True
        for conn, proc in zip(self._conns, self._procs):
            if graceful and proc.is_alive():
                try:
                    conn.send(("stop", []))
                except (BrokenPipeError, ConnectionError, OSError):
                    pass
        for proc in self._procs:
            if graceful:
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for conn in self._conns:
            conn.close()

    # ---- the executor interface ---------------------------------------------------------------------------
    def execute(self, out: ScheduleOutput) -> StepResult:
        return self.step(out.seqs)

    def step(self, seqs: list[SeqInput]) -> StepResult:
        ops = self.kv.take_ops()
        transfer = self.kv.transfer
        schedule = transfer.prefetch_slots, transfer.link, transfer.chunk_s  # every rank runs this depth, link
        self._send([("step", ops, schedule, lead_inputs(seqs))]
                   + [("step", ops, schedule, silent_inputs(seqs))] * (self.size - 1))
        replies = self._gather()
        results: list[StepResult] = [reply[1] for reply in replies]
        self.rank_stats = [reply[2] for reply in replies]
        lead = results[0]
        slowest = max(results, key=lambda r: r.step_s)
        rates = [r.link_blocks_per_s for r in results if r.link_blocks_per_s is not None]
        return replace(
            lead,
            step_s=slowest.step_s,
            layer_compute_s=slowest.layer_compute_s,
            layer_stall_s=[max(r.layer_stall_s[i] for r in results) for i in range(self.num_layers)],
            bytes_h2d=sum(r.bytes_h2d for r in results),
            bytes_d2h=sum(r.bytes_d2h for r in results),
            link_blocks_per_s=min(rates) if rates else None,
            link_preemptions=sum(r.link_preemptions for r in results),
            overflow_blocks=max(r.overflow_blocks for r in results),
        )

    def sync(self) -> list[RankStats]:
        """Send the KV ops recorded since the last step to every rank and return their pools' state."""
        self._send([("sync", self.kv.take_ops())] * self.size)
        self.rank_stats = [reply[1] for reply in self._gather()]
        return self.rank_stats

    def _sync_quietly(self) -> None:
        """After a finish, ship the frees now (not with the next step, which may be long in coming when the
        engine goes idle), so each rank's pools, and /metrics, show the blocks back. A failure is already
        recorded and reported by the step that meets it; a request's finish must not raise."""
        if self._failure is None:
            try:
                self.sync()
            except TensorParallelFailure:
                pass

    def measure_profile(self, name: str, batch: int = 4):
        """`profile_executor` on every rank at once (they run the same steps, in lock-step through the
        all-reduces), plus an all-reduce micro-benchmark. Returns rank 0's profile, in one rank's units (its
        shard's block bytes, its own link), with every rank's figures in ``extra["tensor_parallel"]``."""
        transfer = self.kv.transfer
        self._send([("profile", self.kv.take_ops(), name, (transfer.link, transfer.chunk_s), batch)] * self.size)
        replies = self._gather()
        profile, _ = replies[0][1], replies[0][2]
        per_rank = []
        for rank, (_, p, allreduce) in enumerate(replies):
            per_rank.append({"rank": rank, "decode_a": p.decode_a, "decode_b": p.decode_b,
                             "decode_per_request_s": p.decode_per_request_s, "prefill_a": p.prefill_a,
                             "prefill_b": p.prefill_b, "prefill_c": p.prefill_c, "link_bytes_per_s": p.link_bytes_per_s,
                             "transfer_latency_s": p.transfer_latency_s, **allreduce})
        extra = dict(profile.extra)
        extra["tensor_parallel"] = {"size": self.size, "tp_link": self.parallel.tp_link, "backend": self.backend,
                                    "per_rank": per_rank}
        return replace(profile, extra=extra, notes=f"{profile.notes}; tensor parallel x{self.size} "
                                                   f"({self.parallel.tp_link} link), one rank's shard")

    def close(self) -> None:
        if not self._stopped:
            graceful = self.failure is None
            if self._failure is None:
                self._failure = "the tensor-parallel executor was closed"
            self._stop_ranks(graceful=graceful)
        shutil.rmtree(self._store_dir, ignore_errors=True)
