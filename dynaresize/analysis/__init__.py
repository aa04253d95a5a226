"""Offline analysis of DynaResize runs: metrics, Gantt chart, Perfetto trace, run comparison.

Needs only h5py, numpy, pandas, matplotlib (Agg, headless) and PyYAML (to read the run config);
never torch or MPI. Quick use::

    from dynaresize import analysis
    tl = analysis.load_timeline("outputs/run1")          # run folder or timeline.h5
    per_iteration = analysis.iteration_metrics(tl)       # pandas DataFrame
    per_run = analysis.run_metrics(tl)                   # dict
    analysis.gantt(tl, "gantt.png")
    trace = analysis.perfetto_trace(tl)                  # Chrome trace dict (json.dump it)
    table = analysis.compare("multirun/2025-01-01/12-00-00")

The metric definitions are in the docs of `dynaresize.analysis.metrics`. Command line: dynaresize.analysis.cli.main
(``dynaresize-analyze``, or ``python -m dynaresize.analysis``).
"""
from dynaresize.timeline.schema import TimelineError

from .compare import compare, find_timelines, ratios
from .follow import follow
from .gantt import gantt
from .load import Timeline, load_timeline
from .metrics import (attempts, busy_segments, decisions, gpu_time, iteration_metrics, predictions,
                      rank_iterations, run_metrics)
from .report import summary_text, write_report
from .trace import perfetto_trace, write_trace

__all__ = [
    "Timeline", "TimelineError", "load_timeline",
    "iteration_metrics", "run_metrics", "rank_iterations", "busy_segments", "gpu_time",
    "decisions", "predictions", "attempts", "gantt", "perfetto_trace", "write_trace", "compare", "ratios",
    "find_timelines", "follow", "write_report", "summary_text",
]
