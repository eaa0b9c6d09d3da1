"""Serving metrics, defined once for the engine's accounting and the client's stopwatch.

- TBT: gap between consecutive tokens of a request as *delivered* (after Token-Deposit); a request's
  first token has no gap. TBT attainment = share of gaps within the SLO (a gap equal to it meets it).
- TPOT: per request (last - first delivered) / (tokens - 1); attainment = share of the requests submitted that
  finished within the SLO (a one-token request meets it). A request that failed, was aborted, was rejected or never
  finished counts as a miss, whatever tokens it got in time: an overloaded server's refusals are not left out.
- TTFT = first delivered - arrival; E2E = last delivered - arrival.
- Throughput over the makespan, first arrival to last finish.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from orbitflow.runtime.deposit import SLO_TOLERANCE_S  # one tolerance for the engine and the client

PERCENTILES = (50, 95, 99)


@dataclass
class RequestRecord:
    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    generated_s: list[float]  # when the engine produced each token
    delivered_s: list[float] | None = None  # when the client got each token; None: same as generated_s
    finished_s: float | None = None  # None: did not finish (aborted, still running)
    slo_s: float | None = None  # per-request TBT SLO; None: the run's SLO
    num_pauses: int = 0
    tokens: list[int] | None = None

    def __post_init__(self) -> None:
        if self.delivered_s is None:
            self.delivered_s = list(self.generated_s)
        if len(self.delivered_s) != len(self.generated_s) and self.generated_s:
            raise ValueError(f"request {self.request_id}: {len(self.generated_s)} generated_s but "
                             f"{len(self.delivered_s)} delivered_s")
        for name in ("generated_s", "delivered_s"):
            times = getattr(self, name)
            if any(b < a for a, b in itertools.pairwise(times)):
                raise ValueError(f"request {self.request_id}: {name} must be non-decreasing")

    @property
    def delivered(self) -> list[float]:
        assert self.delivered_s is not None
        return self.delivered_s


@dataclass
class RunMetrics:
    num_requests: int
    num_finished: int
    slo_s: float | None
    tbt_attainment: float
    tbt_attainment_generated: float
    tpot_attainment: float
    tbt_violations: int
    tbt_violations_generated: int
    num_tbt_gaps: int
    tbt_mean_s: float
    p50_tbt_s: float
    p95_tbt_s: float
    p99_tbt_s: float
    tpot_mean_s: float
    p50_tpot_s: float
    p95_tpot_s: float
    p99_tpot_s: float
    ttft_mean_s: float
    p50_ttft_s: float
    p95_ttft_s: float
    p99_ttft_s: float
    e2e_mean_s: float
    p50_e2e_s: float
    p95_e2e_s: float
    p99_e2e_s: float
    makespan_s: float
    throughput_rpm: float
    tokens_per_s: float
    total_output_tokens: int
    num_pauses: int
    device_mem_util: float | None = None
    solver_calls: int | None = None
    solver_time_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


def finite_or_none(value: Any) -> Any:
    """``value`` (nested dicts, lists, tuples) with every non-finite float (a percentile of no samples, an infeasible
    plan's step) replaced by None, so that ``json.dumps(..., allow_nan=False)`` writes standard JSON (null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


# Two-sided 95% Student-t quantiles by degrees of freedom (1..30); beyond, the normal 1.96.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)

def t975(df: int) -> float:
    """The two-sided 95% Student-t quantile for ``df`` degrees of freedom (>= 1)."""
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_ci95(values: Iterable[float]) -> dict:
    """Mean and the half-width of its two-sided 95% Student-t confidence interval (0 for one value)."""
    arr = np.asarray([v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))],
                     dtype=float)
    if arr.size == 0:
        return {"mean": None, "ci95": None, "n": 0}
    if arr.size == 1:
        return {"mean": float(arr[0]), "ci95": 0.0, "n": 1}
    t = t975(arr.size - 1)
    return {"mean": float(arr.mean()), "ci95": float(t * arr.std(ddof=1) / math.sqrt(arr.size)), "n": int(arr.size)}


def _summary(name: str, values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {f"{name}_mean_s": math.nan, **{f"p{q}_{name}_s": math.nan for q in PERCENTILES}}
    out = {f"{name}_mean_s": float(arr.mean())}
    for q, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES)):
        out[f"p{q}_{name}_s"] = float(v)
    return out


def _meets(value: float, slo: float) -> bool:
    return value <= slo + SLO_TOLERANCE_S


@dataclass
class _Tally:
    """The sums a run's metrics are made of, accumulated record by record."""

    tbt: list[float] = field(default_factory=list)
    tbt_met: int = 0
    tbt_met_gen: int = 0
    gen_gaps: int = 0
    tpots: list[float] = field(default_factory=list)
    tpot_met: int = 0
    tpot_count: int = 0
    ttfts: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    total_tokens: int = 0
    pauses: int = 0
    finished: int = 0
    first_arrival: float = math.inf
    last_event: float = -math.inf

    def add(self, rec: RequestRecord, slo: float) -> None:
        self.first_arrival = min(self.first_arrival, rec.arrival_s)
        self.pauses += rec.num_pauses
        if rec.finished_s is not None:
            self.finished += 1
            self.last_event = max(self.last_event, rec.finished_s)
        times = rec.delivered
        self.total_tokens += len(times)
        self.tpot_count += 1
        if not times:
            return  # a miss: nothing delivered
        self.last_event = max(self.last_event, times[-1])
        gaps = np.diff(times)
        self.tbt.extend(gaps.tolist())
        self.tbt_met += int(np.count_nonzero(gaps <= slo + SLO_TOLERANCE_S))
        gen_diffs = np.diff(rec.generated_s)
        self.gen_gaps += len(gen_diffs)
        self.tbt_met_gen += int(np.count_nonzero(gen_diffs <= slo + SLO_TOLERANCE_S))
        self.ttfts.append(times[0] - rec.arrival_s)
        self.e2es.append(times[-1] - rec.arrival_s)
        served = rec.finished_s is not None
        if len(times) == 1:
            self.tpot_met += served
        else:
            tpot = (times[-1] - times[0]) / (len(times) - 1)
            self.tpots.append(tpot)
            self.tpot_met += served and _meets(tpot, slo)


def compute_metrics(records: Sequence[RequestRecord], slo_s: float | None = None,
                    device_mem_util: float | Sequence[float] | None = None, solver_calls: int | None = None,
                    solver_time_s: float | None = None, rejected: int | None = None, **extra: Any) -> RunMetrics:
    """Metrics of one run. ``slo_s`` is the TBT/TPOT SLO for records without their own. ``rejected``: requests
    submitted that have no record (refused before they ran): each is a TPOT miss and counts in ``num_requests``.

    ``device_mem_util`` may be per-step samples (averaged) or an already averaged value. Attainment with
    nothing to measure (TBT: no gaps; TPOT: no request submitted) is NaN, as the percentiles are, and reports show it
    as '-': a run that served nothing does not score 100%.
    """
    t = _Tally()
    for rec in records:
        slo = rec.slo_s if rec.slo_s is not None else slo_s
        if slo is None:
            raise ValueError(f"request {rec.request_id}: no slo_s on the record and none given for the run")
        t.add(rec, slo)
    tbt, tbt_met, tbt_met_gen, gen_gaps = t.tbt, t.tbt_met, t.tbt_met_gen, t.gen_gaps
    tpot_met, tpot_count, total_tokens, finished = t.tpot_met, t.tpot_count, t.total_tokens, t.finished
    first_arrival, last_event = t.first_arrival, t.last_event
    if rejected is not None:
        tpot_count += rejected
        extra = {"rejected": rejected, **extra}

    makespan = last_event - first_arrival if records and last_event > -math.inf else 0.0
    if device_mem_util is not None and not isinstance(device_mem_util, int | float):
        samples = list(device_mem_util)
        device_mem_util = float(np.mean(samples)) if samples else None

    return RunMetrics(
        num_requests=len(records) + (rejected or 0),
        num_finished=finished,
        slo_s=slo_s,
        tbt_attainment=tbt_met / len(tbt) if tbt else math.nan,
        tbt_attainment_generated=tbt_met_gen / gen_gaps if gen_gaps else math.nan,
        tpot_attainment=tpot_met / tpot_count if tpot_count else math.nan,
        tbt_violations=len(tbt) - tbt_met,
        tbt_violations_generated=gen_gaps - tbt_met_gen,
        num_tbt_gaps=len(tbt),
        **_summary("tbt", tbt),
        **_summary("tpot", t.tpots),
        **_summary("ttft", t.ttfts),
        **_summary("e2e", t.e2es),
        makespan_s=makespan,
        # a run that served none of the requests submitted to it (all refused) served at rate 0, not an unknown one
        throughput_rpm=finished / makespan * 60.0 if makespan > 0 else (0.0 if rejected else math.nan),
        tokens_per_s=total_tokens / makespan if makespan > 0 else (0.0 if rejected else math.nan),
        total_output_tokens=total_tokens,
        num_pauses=t.pauses,
        device_mem_util=None if device_mem_util is None else float(device_mem_util),
        solver_calls=solver_calls,
        solver_time_s=solver_time_s,
        extra=dict(extra),
    )


# ----------------------------------------------------------------------------- text output
@dataclass(frozen=True)
class Column:
    key: str
    header: str | None = None
    fmt: str | None = None  # format spec for numbers, e.g. ".1%" or ".3f"


def _cell(value: Any, fmt: str | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | float | np.number):
        if fmt:
            return format(value, fmt)
        return str(value) if isinstance(value, int | np.integer) else f"{value:.4g}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str | tuple[str, str] | Column],
                 title: str | None = None) -> str:
    """An aligned text table: text columns left-aligned, numbers right-aligned, missing values as '-'."""
    cols = [c if isinstance(c, Column) else Column(c) if isinstance(c, str) else Column(c[0], c[1])
            for c in columns]
    headers = [c.header or c.key for c in cols]
    cells = [[_cell(row.get(c.key), c.fmt) for c in cols] for row in rows]
    numeric = [all(isinstance(row.get(c.key), int | float | np.number) or row.get(c.key) is None
                   for row in rows) for c in cols]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    rule_width = max(sum(widths) + 2 * (len(widths) - 1), len(title or ""))
    out = []
    if title:
        out += [f" {title} ".center(rule_width, "="), ]
    else:
        out.append("=" * rule_width)
    out += [line(headers), "-" * rule_width, *(line(r) for r in cells), "=" * rule_width]
    return "\n".join(out)


SUMMARY_ROWS: tuple[tuple[str, str, str], ...] = (
    ("num_requests", "Requests", ""),
    ("num_finished", "Finished requests", ""),
    ("makespan_s", "Makespan (s)", ".2f"),
    ("throughput_rpm", "Throughput (req/min)", ".3f"),
    ("tokens_per_s", "Output tokens/s", ".2f"),
    ("slo_s", "TBT SLO (ms)", "ms"),
    ("tbt_attainment", "TBT attainment", ".1%"),
    ("tbt_attainment_generated", "TBT attainment (generated)", ".1%"),
    ("tpot_attainment", "TPOT attainment", ".1%"),
    ("tbt_violations", "TBT violations (delivered)", ""),
    ("tbt_violations_generated", "TBT violations (generated)", ""),
    ("tbt_mean_s", "Mean TBT (ms)", "ms"),
    ("p50_tbt_s", "P50 TBT (ms)", "ms"),
    ("p95_tbt_s", "P95 TBT (ms)", "ms"),
    ("p99_tbt_s", "P99 TBT (ms)", "ms"),
    ("tpot_mean_s", "Mean TPOT (ms)", "ms"),
    ("p95_tpot_s", "P95 TPOT (ms)", "ms"),
    ("p99_tpot_s", "P99 TPOT (ms)", "ms"),
    ("ttft_mean_s", "Mean TTFT (s)", ".3f"),
    ("p95_ttft_s", "P95 TTFT (s)", ".3f"),
    ("e2e_mean_s", "Mean E2E (s)", ".3f"),
    ("p95_e2e_s", "P95 E2E (s)", ".3f"),
    ("num_pauses", "Pauses", ""),
    ("device_mem_util", "Device memory utilisation", ".1%"),
    ("solver_calls", "Solver calls", ""),
    ("solver_time_s", "Solver time (s)", ".4f"),
)


def format_summary(metrics: RunMetrics | dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """A vLLM-style two-column summary block (label left, value right)."""
    data = metrics.to_dict() if isinstance(metrics, RunMetrics) else metrics
    lines = []
    for key, label, fmt in SUMMARY_ROWS:
        value = data.get(key)
        if fmt == "ms":
            text = _cell(None if value is None else value * 1000.0, ".2f")
        else:
            text = _cell(value, fmt or None)
        lines.append(f"{label + ':':<40}{text:>12}")
    width = 52
    return "\n".join([f" {title} ".center(width, "="), *lines, "=" * width])
