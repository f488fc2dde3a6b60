"""Evaluation shared by ``drl eval``, ``learn-stage`` and ``benchmark``: labelled image sets mapped
onto a model's classes, one feature pass over them (gathered from every rank), the top-k answers
and the "unknown" margin, and the eval sets a run's stages registered."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import distributed
from .data import LabelledImages, dataset_images, scan_class_folders
from .errors import DataError, UsageError
from .metrics import AccuracyReport, accuracy_report
from .model import IncrementalModel, embed_images
from .progress import Progress, ProgressFn
from .run.forgotten import without_forgotten
from .run.load import LoadedRun

EVAL_BATCH_SIZE = 64


TOP_K = 5  # eval reports top-1 and top-5


@dataclass(frozen=True)
class EvalSet:
    """Labelled images (a folder or a dataset) mapped onto the run's global class indices."""

    images: LabelledImages
    label_map: list[int]


def eval_set(images: LabelledImages, model: IncrementalModel, *, what: str) -> EvalSet:
    index = model.class_index()
    unknown = [c for c in images.class_names if c not in index]
    if unknown:
        raise DataError(
            f"{what} {images.origin} has class(es) this run has not learned: {unknown[:5]}; "
            "evaluate only learned classes (see `drl info`)"
        )
    return EvalSet(images, [index[c] for c in images.class_names])


def labelled_images(
    folder: Path | None, dataset: Any, class_names: Sequence[str] | None, *, what: str
) -> LabelledImages | None:
    """A folder's listing or a dataset's items (read and checked), or None when neither is given."""
    if folder is not None and dataset is not None:
        raise UsageError(f"pass {what} as a folder ({what}_dir) or as a dataset ({what}), not both")
    if dataset is not None:
        return dataset_images(dataset, class_names=class_names, what=what)
    if folder is not None:
        return scan_class_folders(folder, what=f"--{what.replace('_', '-')}")
    return None


def check_class_names_use(class_names: Sequence[str] | None, *datasets: Any) -> None:
    if class_names is not None and all(d is None for d in datasets):
        raise UsageError(
            "class_names names the int labels of a dataset (data=...); a folder's classes are its sub-folders"
        )


@dataclass(frozen=True)
class SetFeatures:
    """One eval set's rows as a model's pass gave them (this process's share), keyed by the set (its
    folder and fingerprint, or a dataset's content digest), the rows the model read and the precision.
    A model whose network computes the very same rows (a switched run's untrained adapter set: the
    frozen PTM, as its frozen track's) reads them instead of passing the images again (``predict_sets``);
    the caller vouches for that."""

    key: tuple[Any, ...]
    feats: torch.Tensor
    labels: torch.Tensor


def _set_key(model: IncrementalModel, item: EvalSet, precision: str) -> tuple[Any, ...]:
    images = item.images
    root = getattr(images, "root", None)
    where = str(Path(root).resolve()) if root is not None else None
    reads = (model.stages_scored, model.layout_scored, model.probes_read)
    return (type(images).__name__, where, images.fingerprint(), len(images), reads, precision)


def evaluate_sets(
    model: IncrementalModel,
    sets: list[EvalSet],
    *,
    num_workers: int = 0,
    precision: str = "fp32",
    progress: ProgressFn | None = None,
    given: Sequence[SetFeatures] = (),
    kept: list[SetFeatures] | None = None,
) -> AccuracyReport:
    ranked, targets, _ = predict_sets(
        model, sets, num_workers=num_workers, precision=precision, progress=progress, given=given, kept=kept
    )
    return accuracy_report(ranked[:, 0], targets, model.class_stage, num_stages=model.num_stages, ranked=ranked)


def predict_sets(
    model: IncrementalModel,
    sets: list[EvalSet],
    *,
    num_workers: int = 0,
    precision: str = "fp32",
    progress: ProgressFn | None = None,
    given: Sequence[SetFeatures] = (),
    kept: list[SetFeatures] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each image's TOP_K best-scored classes (N, k), best first, its target (global class
    indices; -1 for an image of a class not learned) and known(x) (N,) (``openset.py``; None when
    the model is not calibrated), over every set, gathered from all ranks. The network runs in
    ``precision``, the scoring in fp32. ``given``: sets' rows a pass of a model whose network
    computes the same rows already gave (``SetFeatures``), used instead of a pass; ``kept``: each
    set's rows are appended to it."""
    predictions, targets, known = [], [], []
    reuse = {g.key: g for g in given}
    for k, item in enumerate(sets, 1):
        report_step = (
            (lambda step, total, k=k: progress(Progress("evaluate", step, total, eval_set=k, num_eval_sets=len(sets))))
            if progress
            else None
        )
        feats, labels = _set_rows(model, item, reuse, kept, num_workers, precision, report_step)
        scoring, inputs = model.split(feats)
        scores = model.scores(scoring)
        predictions.append(scores.topk(min(TOP_K, scores.shape[1]), dim=1).indices.cpu())
        targets.append(torch.tensor(item.label_map, dtype=torch.long)[labels])
        margin = model.known(inputs)
        known.append(margin.cpu() if margin is not None else torch.zeros(0))
    calibrated = model.open_set_answer is not None
    parts = distributed.all_gather_objects((torch.cat(predictions), torch.cat(targets), torch.cat(known)))
    ranked, target = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return ranked, target, torch.cat([p[2] for p in parts]) if calibrated else None


def _set_rows(
    model: IncrementalModel,
    item: EvalSet,
    reuse: dict[tuple[Any, ...], SetFeatures],
    kept: list[SetFeatures] | None,
    num_workers: int,
    precision: str,
    progress: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's rows of the set and their labels: as given (``reuse``), else from a pass."""
    key = _set_key(model, item, precision) if reuse or kept is not None else ()
    hit = reuse.get(key)
    if hit is not None:
        feats, labels = hit.feats, hit.labels
    else:
        feats, labels = embed_images(
            model.network,
            item.images,
            model.data_config,
            batch_size=EVAL_BATCH_SIZE,
            num_workers=num_workers,
            precision=precision,
            indices=distributed.shard(len(item.images)),
            progress=progress,
            stages=model.stages_scored,
            layout=model.layout_scored,
            probes=model.probes_read,
        )
    if kept is not None:
        kept.append(SetFeatures(key, feats, labels))
    return feats, labels


def registered_eval_sets(loaded: LoadedRun, *, missing: list[str] | None = None) -> list[EvalSet]:
    """The eval sets earlier stages registered. A missing folder is an error, or, when a
    ``missing`` list is given, appended to it as a warning and skipped."""
    sets = []
    for meta in loaded.stage_metas:
        entry = meta.get("eval_data")
        if not entry or "path" not in entry:  # none, or held out of its drop (--eval-fraction): no folder
            continue
        path = loaded.run.path / entry["path"]
        if not path.is_dir():
            what = f"eval data registered by stage {meta['stage']} is not at {path}"
            if missing is None:
                raise DataError(f"{what}; restore it or evaluate with --data DIR")
            missing.append(f"{what}: left out of this evaluation")
            continue
        images = scan_class_folders(path, what="registered eval data")
        images = without_forgotten(images, loaded.forgotten, loaded.model.class_names)
        if images is not None:  # None: every class of it is forgotten
            sets.append(eval_set(images, loaded.model, what="registered eval data"))
    return sets
