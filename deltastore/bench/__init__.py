"""The benchmark (benchmarks/README.md): deltastore side by side with the strongest dense
safetensors load, COO and xor-dense baselines (and the old naive dense load, reported only)
on versions of a synthetic model made by real AdamW steps, with the publish, receiver, pause,
memory and XOR entropy floors measured in the same run.

``deltastore bench`` runs :func:`run_bench`; :func:`performance_doc` (``python -m
deltastore.bench.report RESULTS.json --performance-doc docs/performance.md``) writes the
performance page from a results JSON; ``benchmarks/README.md`` describes the method, every
number of :class:`BenchResult` and the performance bar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltastore._lazy import lazy_exports

if TYPE_CHECKING:
    from deltastore.bench.report import (
        PlotUnavailable,
        check_plot,
        markdown,
        performance_doc,
        plot,
    )
    from deltastore.bench.runner import BenchOptions, StoreUnavailable, run_bench
    from deltastore.bench.schema import SCHEMA_VERSION, SYSTEMS, BenchResult, load_result
    from deltastore.bench.worker import WorkerError
    from deltastore.bench.workload import SIZES, Workload, WorkloadSpec, default_workdir

_EXPORTS = {
    "PlotUnavailable": "deltastore.bench.report",
    "check_plot": "deltastore.bench.report",
    "load_result": "deltastore.bench.schema",
    "markdown": "deltastore.bench.report",
    "performance_doc": "deltastore.bench.report",
    "plot": "deltastore.bench.report",
    "BenchOptions": "deltastore.bench.runner",
    "StoreUnavailable": "deltastore.bench.runner",
    "run_bench": "deltastore.bench.runner",
    "SCHEMA_VERSION": "deltastore.bench.schema",
    "SYSTEMS": "deltastore.bench.schema",
    "BenchResult": "deltastore.bench.schema",
    "WorkerError": "deltastore.bench.worker",
    "SIZES": "deltastore.bench.workload",
    "Workload": "deltastore.bench.workload",
    "WorkloadSpec": "deltastore.bench.workload",
    "default_workdir": "deltastore.bench.workload",
}
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
    "load_result",
    "markdown",
    "performance_doc",
    "plot",
    "run_bench",
]

if not TYPE_CHECKING:  # type checkers see the imports above
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
