"""The benchmark (issue 6): deltastore side by side with dense safetensors, COO and
xor-dense baselines on versions of a synthetic model made by real AdamW steps.

``deltastore bench`` runs :func:`run_bench`; ``benchmarks/README.md`` describes the method,
every number of :class:`BenchResult` and the performance bar.
"""

from deltastore.bench.report import PlotUnavailable, check_plot, markdown, plot
from deltastore.bench.runner import BenchOptions, StoreUnavailable, run_bench
from deltastore.bench.schema import SCHEMA_VERSION, SYSTEMS, BenchResult
from deltastore.bench.worker import WorkerError
from deltastore.bench.workload import SIZES, Workload, WorkloadSpec, default_workdir

__all__ = [
    "SCHEMA_VERSION",
    "SIZES",
    "SYSTEMS",
    "BenchOptions",
    "BenchResult",
    "PlotUnavailable",
    "StoreUnavailable",
    "WorkerError",
    "Workload",
    "WorkloadSpec",
    "check_plot",
    "default_workdir",
    "markdown",
    "plot",
    "run_bench",
]
