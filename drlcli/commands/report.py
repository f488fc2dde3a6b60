"""``drl eval --report DIR``: the evaluation as files for a spreadsheet and a person.

``per_class.csv`` (precision, recall, F1 and support of every class, then the macro and weighted
averages, as scikit-learn's ``classification_report``), ``confusion.csv`` (rows true, columns
predicted), ``confusion.png`` (the matrix, row-normalised, stage boundaries marked; the ``plot``
extra) and ``stages.csv`` (A_t and the accuracy matrix). Every cell goes through ``csvsafe.cell``:
a class name cannot be a spreadsheet formula.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from .. import storage
from ..csvsafe import csv_text
from ..errors import StorageError, UsageError
from ..metrics import HistorySummary, class_scores, confusion_matrix
from ..plots import confusion_plot, pyplot
from ..run.access import refuse_inside_run

REPORT_FILES = ("per_class.csv", "confusion.csv", "confusion.png", "stages.csv")


def check_report_dir(path: Path) -> None:
    """Fail before any work: a folder inside a run, a file in the way, or matplotlib missing."""
    refuse_inside_run(path, option="--report")
    if Path(path).exists() and not Path(path).is_dir():
        raise UsageError(f"--report {path} is a file; name a folder (it is created) for the report's files")
    pyplot(purpose="--report")


def per_class_rows(confusion: Tensor, class_names: list[str], class_stage: list[int]) -> list[list[object]]:
    """per_class.csv's rows, header first: one per class, then the macro and weighted averages."""
    scores = class_scores(confusion)
    rows: list[list[object]] = [["class", "stage", "precision", "recall", "f1", "support"]]
    for i, name in enumerate(class_names):
        rows.append([name, class_stage[i], scores.precision[i], scores.recall[i], scores.f1[i], scores.support[i]])
    total = sum(scores.support)
    rows.append(["macro avg", None, *scores.macro, total])
    rows.append(["weighted avg", None, *scores.weighted, total])
    return rows


def confusion_rows(confusion: Tensor, class_names: list[str]) -> list[list[object]]:
    """confusion.csv's rows: a header of the predicted classes, then one row per true class."""
    header: list[object] = ["true \\ predicted", *class_names]
    return [header] + [[name, *row] for name, row in zip(class_names, confusion.tolist())]


def stage_rows(history: HistorySummary) -> list[list[object]]:
    """stages.csv's rows: per stage t, A_t and the accuracy on each stage g's classes after it (%)."""
    num = len(history.matrix)
    rows: list[list[object]] = [["after_stage", "A_t", *(f"stage_{g}" for g in range(1, num + 1))]]
    for t, row in enumerate(history.matrix, 1):
        accuracy = history.accuracy[t - 1] if t <= len(history.accuracy) else None
        rows.append([t, accuracy, *row])
    return rows


def write_report(
    path: Path,
    predictions: Tensor,
    targets: Tensor,
    class_names: list[str],
    class_stage: list[int],
    history: HistorySummary,
    *,
    title: str,
) -> Path:
    """Write the report's four files into ``path`` (created), each atomically; returns ``path``."""
    path = Path(path)
    confusion = confusion_matrix(predictions, targets, len(class_names))
    tables = {
        "per_class.csv": per_class_rows(confusion, class_names, class_stage),
        "confusion.csv": confusion_rows(confusion, class_names),
        "stages.csv": stage_rows(history),
    }
    try:
        path.mkdir(parents=True, exist_ok=True)
        for name, rows in tables.items():
            storage.write_atomic(path / name, csv_text(rows).encode("utf-8"))
    except OSError as exc:
        raise StorageError(f"cannot write the report in {path}: {exc.strerror or exc}; pick another --report") from exc
    confusion_plot(confusion, class_names, class_stage, path / "confusion.png", title=title)
    return path
