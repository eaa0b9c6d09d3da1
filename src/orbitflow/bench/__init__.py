"""Benchmarking: traces, metrics and plots (plots live in ``orbitflow.bench.plots``, imported on demand)."""

from orbitflow.bench.metrics import (
    Column,
    RequestRecord,
    RunMetrics,
    compute_metrics,
    format_summary,
    format_table,
)
from orbitflow.bench.workload import (
    LengthBins,
    Trace,
    TraceError,
    TraceRequest,
    generate_trace,
    paper_default_rate_per_s,
    scale_arrivals,
    scale_trace,
)

__all__ = [
    "Column",
    "LengthBins",
    "RequestRecord",
    "RunMetrics",
    "Trace",
    "TraceError",
    "TraceRequest",
    "compute_metrics",
    "format_summary",
    "format_table",
    "generate_trace",
    "paper_default_rate_per_s",
    "scale_arrivals",
    "scale_trace",
]
