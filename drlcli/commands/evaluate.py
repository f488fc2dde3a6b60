"""``drl eval``: top-1 and top-5 of a run on a labelled folder, a dataset or every eval set its
stages registered; the accuracy history; the most confused pairs; optionally a plot and how well
the "unknown" answer separates images of classes not learned."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from .. import distributed
from ..data import check_workers, scan_class_folders, validate_images
from ..device import resolve_device
from ..errors import DataError, RunStateError, UsageError
from ..evaluation import EvalSet, check_class_names_use, eval_set, labelled_images, predict_sets, registered_eval_sets
from ..heads.openset.report import OpenSetReport, open_set_report
from ..metrics import AccuracyReport, HistorySummary, accuracy_report, most_confused
from ..model import IncrementalModel
from ..plots import check_plot_path, history_plot
from ..precision import check_precision
from ..progress import Progress, ProgressFn
from ..run.load import LoadedRun, answering_head, load_run
from ..run.records import history_of
from .report import check_report_dir, write_report


@dataclass(frozen=True)
class EvalResult:
    report: AccuracyReport
    history: HistorySummary
    num_stages: int
    num_classes: int
    confused: list[dict[str, Any]] = field(default_factory=list)  # most frequent true → predicted
    run_dir: str | None = None
    plot: str | None = None  # the --plot file written
    open_set: OpenSetReport | None = None  # with --unknown-data
    answers: str | None = None  # a switched run: the head that answered (``run.load.answering_head``)
    report_dir: str | None = None  # the --report folder written (``report.py``)

    def to_dict(self) -> dict[str, Any]:
        return {
            "answers": self.answers,
            "open_set": self.open_set.to_dict() if self.open_set else None,
            "run_dir": self.run_dir,
            "accuracy": self.report.to_dict(),
            "history": self.history.to_dict(),
            "confused": self.confused,
            "num_stages": self.num_stages,
            "num_classes": self.num_classes,
            "plot": self.plot,
            "report": self.report_dir,
        }


def evaluate(
    run_dir: Path | str,
    *,
    data_dir: Path | None = None,
    data: Any = None,
    class_names: Sequence[str] | None = None,
    all_seen: bool = False,
    device: str = "auto",
    ptm_weights: Path | None = None,
    confusions: int = 5,
    plot_path: Path | None = None,
    report_dir: Path | None = None,
    unknown_dir: Path | None = None,
    num_workers: int = 0,
    precision: str = "fp32",
    progress: ProgressFn | None = None,
) -> EvalResult:
    """Top-1 on a labelled folder (``data_dir``), a torch Dataset of (image, label) pairs (``data``,
    int labels named by ``class_names``: ``data.dataset_images``) or every registered eval set
    (``all_seen``); the accuracy history, the ``confusions`` most frequent mistakes, optionally a
    figure of the history (``plot_path``, needs the ``plot`` extra), the report's files (``report_dir``:
    per-class precision/recall/F1, the confusion matrix as CSV and picture, the stage table) and, with ``unknown_dir`` (class
    folders of classes the run has not learned), how well the "unknown" answer separates them
    (``openset.py``). Images load in ``num_workers`` worker processes; the network runs in
    ``precision`` (fp32, bf16, or fp16 on CUDA)."""
    if (data_dir is None and data is None) == (not all_seen):
        raise UsageError("pass exactly one of --all-seen or --data DIR (Python: data_dir or data)")
    check_class_names_use(class_names, data)
    _check_options(confusions, num_workers, precision, device, plot_path, report_dir)
    if progress is not None:
        progress(Progress("load", 0, 0, "the PTM and the run's stages"))
    loaded = load_run(run_dir, device=device, ptm_weights=ptm_weights)
    if not loaded.stage_metas:
        raise UsageError(f"run {run_dir} has learned no stage yet; run `drl learn-stage` first")
    sets = _eval_sets(loaded, data_dir, data, class_names)
    model = loaded.model
    unknown = _unknown_set(unknown_dir, model)
    every = sets + ([unknown] if unknown else [])
    ranked, targets, known = predict_sets(model, every, num_workers=num_workers, precision=precision, progress=progress)
    open_set = None
    if unknown is not None:
        open_set = _open_set(model, ranked, targets, known)
        ranked, targets = ranked[targets >= 0], targets[targets >= 0]
    predictions = ranked[:, 0]
    report = accuracy_report(predictions, targets, model.class_stage, num_stages=model.num_stages, ranked=ranked)
    history = history_of(loaded.stage_metas)
    ptm = loaded.record["ptm"]["name"]
    title = f"{loaded.config.method}, {ptm}: {model.num_stages} stages, top-1 now {report.top1:.2f}%"
    plot = written = None
    if plot_path is not None and distributed.is_main():
        _say(progress, "plot", plot_path)
        plot = str(history_plot(history, plot_path, title=title))
    if report_dir is not None and distributed.is_main():
        _say(progress, "report", report_dir)
        stages = model.class_stage.tolist()
        written = str(write_report(report_dir, predictions, targets, model.class_names, stages, history, title=title))
    return EvalResult(
        report,
        history,
        model.num_stages,
        len(model.class_names),
        most_confused(predictions, targets, model.class_names, top=confusions),
        str(loaded.run.path),
        plot,
        open_set,
        answering_head(loaded),
        written,
    )


def _check_options(
    confusions: int, num_workers: int, precision: str, device: str, plot_path: Path | None, report_dir: Path | None
) -> None:
    """The options, before a minute of loading."""
    if confusions < 0:
        raise UsageError(f"--confusions must be >= 0, got {confusions}")
    check_workers(num_workers)
    check_precision(precision, resolve_device(device))
    if plot_path is not None:
        check_plot_path(plot_path)
    if report_dir is not None:
        check_report_dir(report_dir)


def _say(progress: ProgressFn | None, phase: str, path: Path) -> None:
    if progress is not None:
        progress(Progress(phase, 0, 0, str(path)))


def _eval_sets(loaded: LoadedRun, data_dir: Path | None, data: Any, class_names: Sequence[str] | None) -> list[EvalSet]:
    """``--data`` (a folder or a dataset), checked, or else every eval set the stages registered."""
    images = labelled_images(data_dir, data, class_names, what="data")
    if images is not None:
        validate_images(images)
        return [eval_set(images, loaded.model, what="--data" if data_dir is not None else "data")]
    sets = registered_eval_sets(loaded)
    if not sets:
        held = [m["stage"] for m in loaded.stage_metas if "held_out" in (m.get("eval_data") or {})]
        also = (
            f" (stage(s) {', '.join(map(str, held))} evaluated on images held out of their drop, --eval-fraction: "
            "those have no folder to evaluate again)"
            if held
            else ""
        )
        raise UsageError(f"no eval data is registered{also}; pass --eval-data to learn-stage, or use --data DIR")
    return sets


def _open_set(model: IncrementalModel, ranked: Tensor, targets: Tensor, known: Tensor | None) -> OpenSetReport:
    """How the "unknown" answer separates the known images from the unknown ones (target -1)."""
    if known is None:
        raise RunStateError(
            "--unknown-data needs a run whose every stage calibrated the unknown answer (learned with "
            "drlcli 0.2 or later); learn the stages again in a new run"
        )
    is_unknown = targets < 0
    correct = ranked[~is_unknown, 0] == targets[~is_unknown]
    probe = model.probes_read[0] if model.probes_read else None
    return open_set_report(
        known[~is_unknown], correct, known[is_unknown], rule=model.open_set_answer, probe_block=probe
    )


def _unknown_set(unknown_dir: Path | None, model: IncrementalModel) -> EvalSet | None:
    """``--unknown-data``: class folders of classes the run has not learned (label -1)."""
    if unknown_dir is None:
        return None
    images = scan_class_folders(unknown_dir, what="--unknown-data")
    validate_images(images)
    learned = [c for c in images.class_names if c in model.class_index()]
    if learned:
        raise DataError(
            f"--unknown-data {unknown_dir} has class(es) this run has learned: {learned[:5]}; "
            "pass only images of classes it has not learned"
        )
    return EvalSet(images, [-1] * len(images.class_names))
