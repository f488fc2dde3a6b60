"""Figures (the optional ``plot`` extra, matplotlib): the accuracy history of a run.

``drl eval --plot FILE`` draws A_t per stage and each stage group's accuracy after every later
stage (the rows of the accuracy matrix), so forgetting shows as a falling line.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from . import storage
from .errors import StorageError, UsageError, require
from .metrics import HistorySummary
from .run.access import refuse_inside_run

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def pyplot(*, purpose: str) -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or a ``DependencyError`` naming the extra."""
    matplotlib = require("matplotlib", extra="plot", purpose=purpose)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_plot_path(path: Path) -> None:
    """Fail before any work: an unknown image format, or matplotlib missing."""
    if Path(path).suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {path}: name a {', '.join(PLOT_SUFFIXES)} file (e.g. accuracy.png)")
    refuse_inside_run(path, option="--plot")
    pyplot(purpose="--plot")


def history_plot(history: HistorySummary, path: Path, *, title: str) -> Path:
    """Write the figure to ``path`` (format from its suffix: png, svg, pdf), atomically."""
    plt = pyplot(purpose="--plot")
    path = Path(path)
    stages = list(range(1, len(history.accuracy) + 1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    _line(left, stages, history.accuracy, label=f"A_t (Ā {_fmt(history.average)})", color="black")
    left.set_title("A_t: all classes seen after stage t")
    colours = plt.get_cmap("tab10" if len(stages) <= 10 else "tab20")
    for g in stages:
        column = [row[g - 1] if g - 1 < len(row) else None for row in history.matrix]
        _line(right, stages, column, label=f"stage {g} classes", color=colours((g - 1) % colours.N))
    mean = history.mean_forgetting
    right.set_title("accuracy per stage group" + (f" (mean forgetting {mean:.2f})" if mean is not None else ""))
    for ax in (left, right):
        ax.set_xlabel("after stage")
        ax.set_xticks(stages)
        ax.grid(alpha=0.3)
    left.set_ylabel("top-1 (%)")
    bottom = left.get_ylim()[0]
    left.set_ylim(min(bottom, 95.0), 101.0)  # room above 100 for the markers; shared with the right
    if len(stages) <= 12:
        right.legend(fontsize=7, ncol=2)
    left.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    image = io.BytesIO()
    try:
        fig.savefig(image, dpi=120, format=path.suffix.lower().lstrip(".") or None)
    finally:
        plt.close(fig)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        storage.write_atomic(path, image.getvalue())
    except OSError as exc:
        raise StorageError(f"cannot write plot {path}: {exc.strerror or exc}; pick another --plot path") from exc
    return path


def _line(ax: Any, xs: list[int], ys: list[float | None], **kwargs: Any) -> None:
    points = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if points:
        ax.plot(*zip(*points), marker="o", **kwargs)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
