"""Figures (the optional ``plot`` extra, matplotlib): the accuracy history of a run.

``drl eval --plot FILE`` draws A_t per stage and each stage group's accuracy after every later
stage (the rows of the accuracy matrix), so forgetting shows as a falling line.
"""

from __future__ import annotations

import io
import re
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
    return _save(plt, fig, path, dpi=120, option="--plot")


def _save(plt: Any, fig: Any, path: Path, *, dpi: int, option: str) -> Path:
    """Render ``fig`` (format from the suffix) and write it to ``path`` atomically; close it either way."""
    image = io.BytesIO()
    try:
        fig.savefig(image, dpi=dpi, format=path.suffix.lower().lstrip(".") or None)
    finally:
        plt.close(fig)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        storage.write_atomic(path, image.getvalue())
    except OSError as exc:
        raise StorageError(f"cannot write plot {path}: {exc.strerror or exc}; pick another {option} path") from exc
    return path


def _line(ax: Any, xs: list[int], ys: list[float | None], **kwargs: Any) -> None:
    points = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if points:
        ax.plot(*zip(*points), marker="o", **kwargs)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# every control, bidi, separator or surrogate character of a class name: drawn as its escape
_UNDRAWABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
LABEL_CHARS = 32  # a longer class name is cut (with "…") on the picture; the CSV files hold it whole


def drawable(text: str, *, limit: int | None = None) -> str:
    """``text`` as matplotlib text that draws it literally: control characters as their escapes,
    ``$`` escaped (no mathtext); cut to ``limit`` characters (with "…") when given."""
    text = _UNDRAWABLE.sub(_escape, text)
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("$", r"\$")


def _escape(match: re.Match[str]) -> str:
    """A character as the escape the terminal output shows it as (``cli.output.printable``)."""
    code = ord(match.group())
    named = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(match.group())
    return named or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def confusion_plot(confusion: Any, class_names: list[str], class_stage: list[int], path: Path, *, title: str) -> Path:
    """The confusion matrix (rows true, columns predicted) coloured by each row's fraction, class names
    as ticks, lines between stages; sized with the class count (readable at 101 classes), 150 dpi."""
    plt = pyplot(purpose="--report")
    counts = confusion.double()
    n = len(class_names)
    fractions = (counts / counts.sum(1, keepdim=True).clamp(min=1)).numpy()
    side = min(max(6.0, 0.13 * n + 3.0), 48.0)  # inches: ~0.13 in a class, and room for the names
    font = max(2.0, min(9.0, (side - 3.0) / max(n, 1) * 72 * 0.75))
    fig, ax = plt.subplots(figsize=(side + 1.2, side))
    shown = ax.imshow(fractions, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest", aspect="equal")
    fig.colorbar(shown, ax=ax, fraction=0.04, pad=0.02, label="fraction of the true class's images")
    labels = [drawable(name, limit=LABEL_CHARS) for name in class_names]
    ax.set_xticks(range(n), labels, rotation=90, fontsize=font)
    ax.set_yticks(range(n), labels, fontsize=font)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    for i in range(1, n):
        if class_stage[i] != class_stage[i - 1]:  # a stage boundary
            ax.axhline(i - 0.5, color="tab:red", linewidth=0.8)
            ax.axvline(i - 0.5, color="tab:red", linewidth=0.8)
    if n <= 20:  # few classes: the counts themselves
        for t, p in counts.nonzero().tolist():
            colour = "white" if fractions[t, p] > 0.5 else "black"
            ax.text(p, t, str(int(counts[t, p])), ha="center", va="center", fontsize=7, color=colour)
    ax.set_title(drawable(title), fontsize=10)
    fig.tight_layout()
    return _save(plt, fig, Path(path), dpi=150, option="--report")
