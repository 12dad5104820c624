"""``lmcache bench serve --plot``: TTFT per turn of one run or of several saved runs side by side,
as a PNG. matplotlib is an optional extra (``pip install lmcache-toolkit[plot]``), imported only here
and only when a plot is asked for."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache_cli.bench_serve_report import RunReport

MISSING = "--plot needs matplotlib, which is not installed: pip install 'lmcache-toolkit[plot]'"


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display needed); ImportError without
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft(runs: list[tuple[str, RunReport]], path: Path) -> None:
    """Grouped bars: for each turn, each run's TTFT p50, with a whisker up to its p90."""
    plt = pyplot()
    turns = sorted({g.turn for _, run in runs for g in run.turns if g.turn is not None})
    width = 0.8 / len(runs)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.2 * len(turns) * len(runs) ** 0.5), 4.0))
    for i, (name, run) in enumerate(runs):
        by_turn = {g.turn: g.ttft_s for g in run.turns}
        p50 = [1e3 * (by_turn[t].p50 or 0.0) if t in by_turn else 0.0 for t in turns]
        p90 = [1e3 * (by_turn[t].p90 or 0.0) if t in by_turn else 0.0 for t in turns]
        xs = [t + (i - (len(runs) - 1) / 2) * width for t in turns]
        axes.bar(xs, p50, width, label=name,
                 yerr=[[0.0] * len(turns), [max(0.0, hi - lo) for lo, hi in zip(p50, p90, strict=True)]],
                 capsize=3)
    axes.set_xticks(turns)
    axes.set_xlabel(runs[0][1].turn_name)
    axes.set_ylabel("TTFT ms (p50, whisker to p90)")
    axes.set_title(f"TTFT per {runs[0][1].turn_name}: {runs[0][1].workload_detail}"
                   if len(runs) == 1 else f"TTFT per {runs[0][1].turn_name}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
