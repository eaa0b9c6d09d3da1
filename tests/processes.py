"""Processes on this machine, read from /proc (Linux): what the tests of planner processes check."""

from __future__ import annotations

import os


def process_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of process ``pid``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
    except (FileNotFoundError, ProcessLookupError):
        return None
    return state, int(ppid)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie has exited (nobody reaped it yet, as a container's init may never)."""
    stat = process_stat(pid)
    return stat is not None and stat[0] != "Z"


def cmdline(pid: int) -> bytes:
    """The command line of ``pid`` (its arguments NUL-separated; b"" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def spawned_processes(parent_has: bytes = b"") -> dict[int, int]:
    """The live children that multiprocessing spawned (its ``spawn_main`` command line: a planner process, in
    the tests that call this) of parents whose command line holds ``parent_has``, as {pid: parent pid}."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = process_stat(int(entry))
        if stat is None or stat[0] == "Z" or b"spawn_main" not in cmdline(int(entry)):
            continue
        if parent_has in cmdline(stat[1]):
            out[int(entry)] = stat[1]
    return out
