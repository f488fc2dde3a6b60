"""learn-stage's last phases: the stage evaluated on every registered eval set and its own, its
files (tensors checked finite, stage.json), the atomic commit, and what the call reports."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import distributed, heads
from ..errors import DivergedError
from ..evaluation import SetFeatures, eval_set, evaluate_sets, registered_eval_sets
from ..heads import PROTOTYPES, TOTALS_MARK, openset
from ..heads.openset import BIAS, RMD_BIAS
from ..metrics import AccuracyReport, HistorySummary
from ..run.files import stage_files
from ..run.records import history_of, non_finite
from ..version import __version__
from .context import Evaluated, Fitted, Record, StageContext, Trained

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageResult:
    status: str  # "learned" | "unchanged" (the same data was already committed as this stage)
    resumed_from_epoch: int | None  # epochs reused from an interrupted run's checkpoint
    stage: int
    classes: list[str]
    num_images: int
    train_seconds: float
    total_seconds: float
    epoch_losses: list[float]
    scale: float | None
    num_params: int
    stage_bytes: int
    eval: AccuracyReport | None
    history: HistorySummary
    warnings: list[str] = field(default_factory=list)
    run_dir: str | None = None
    precision: str = "fp32"  # the network forward's (for "unchanged": the committed stage's)
    tensorboard_dir: str | None = None  # where this call wrote TensorBoard event files, if it did
    training_skipped: bool = False  # no stage network was made (``StageContext.untrained``)
    skipped_because: str = ""  # why, for people (``StageContext.skip_reason``)
    first_session: dict[str, Any] | None = None  # stage 1's decision (``decide.Decision.to_dict``)
    carry: dict[str, Any] | None = None  # a carried run's stage > 1: stage.json's ``carry``
    switch: dict[str, Any] | None = None  # a switched run: stage.json's ``switch`` (the track that answers)
    passes: dict[str, Any] | None = None  # stage.json's ``metrics.passes``: the stage's cost (``cost.py``)
    train_precision: str | None = None  # the training steps' dtype, where the stage trained

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["eval"] = self.eval.to_dict() if self.eval else None
        out["history"] = self.history.to_dict()
        return out


def evaluate_stage(stage: StageContext, *, given: tuple[SetFeatures, ...] = (), keep: bool = False) -> Evaluated:
    """Top-1 on every eval set earlier stages registered (a missing one is a warning) and on --eval-data.
    ``given``: sets' rows a network that computes the same rows gave (``evaluation.SetFeatures``);
    ``keep``: the result keeps each set's rows (``Evaluated.rows``)."""
    warnings: list[str] = []
    sets = registered_eval_sets(stage.loaded, missing=warnings)
    for message in warnings:
        stage.say("warning", 0, 0, message)
    if stage.eval_images is not None:
        sets.append(eval_set(stage.eval_images, stage.model, what="--eval-data"))
    tick = time.perf_counter()
    report, kept = None, [] if keep else None
    if sets:
        report = evaluate_sets(
            stage.model,
            sets,
            num_workers=stage.config.train.num_workers,
            precision=stage.precision,
            progress=stage.progress,
            given=given,
            kept=kept,
        )
    if report is not None:
        log.debug("evaluated %d images in %.1fs", report.num_images, time.perf_counter() - tick)
    return Evaluated(report, warnings, rows=tuple(kept or ()))


def record_stage(
    stage: StageContext, trained: Trained, fitted: Fitted, evaluated: Evaluated, *, passes: dict[str, Any] | None = None
) -> Record:
    """The stage's files: its tensors (refused if any is NaN or infinite) and its metadata; the run's
    totals through this stage go to its totals file (``heads.running``), out of its other files."""
    tensors = _stage_tensors(stage, trained, fitted)
    bad = non_finite(tensors)
    if bad is not None:
        stage.discard_checkpoint()
        raise DivergedError(
            f"training diverged: {bad} of stage {stage.index} holds NaN or infinite values; nothing was "
            f"committed: lower --lr (now {stage.config.train.lr:g})"
        )
    meta = _stage_meta(stage, trained, fitted, evaluated)
    if passes is not None:  # what learning it cost, in forward passes per image (``cost.py``)
        meta["metrics"]["passes"] = passes
    carried = stage.method.tensor_prefix if stage.schedule.carries else None
    weights, statistics, totals = _split_totals(
        stage.index, tensors, fitted.fit.statistics if fitted.fit else {}, network=carried
    )
    files = stage_files(stage.index, meta, weights, statistics or None, totals or None)
    return Record(meta, files, carries_totals=bool(totals))


def _split_totals(
    index: int, tensors: dict[str, torch.Tensor], statistics: dict[str, torch.Tensor], network: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights, statistics, totals): the run's totals (``heads.running``; a carried run's stage network
    too, its tensors under the ``network`` prefix) apart, marked with the stage."""
    running = heads.running()

    def total(name: str) -> bool:
        return name in running or (network is not None and name.startswith(network))

    totals = {k: v for part in (tensors, statistics) for k, v in part.items() if total(k)}
    if totals:
        totals[TOTALS_MARK] = torch.tensor([index])
    own = [{k: v for k, v in part.items() if not total(k)} for part in (tensors, statistics)]
    return own[0], own[1], totals


def _stage_tensors(stage: StageContext, trained: Trained, fitted: Fitted) -> dict[str, torch.Tensor]:
    """Everything the stage stores beside its statistics: its prototypes, open-set rows, network, head."""
    tensors = {
        PROTOTYPES: stage.model.real_prototypes[-len(stage.images.class_names) :],
        BIAS: fitted.bias,
    }
    if fitted.rmd is not None:
        tensors.update(fitted.rmd[0].tensors())
        tensors[RMD_BIAS] = fitted.rmd[1]
        joined = stage.model.unknown_rmd  # the earlier classes' moments joined with the stage's: the totals
        if joined is not None and len(joined[0].counts) == len(stage.model.class_names):
            tensors.update({name: joined[0].tensors()[name] for name in openset.RUNNING})
            if stage.schedule.carries:  # every class's mean as this stage moved it
                tensors[openset.RMD_MEAN_CARRIED] = joined[0].means.float()
    if _stores_network(stage, trained, fitted):
        new = stage.model.network.stages[-1].state_dict()
        tensors.update({f"{stage.method.tensor_prefix}{k}": v for k, v in new.items()})
    if fitted.fit is not None:
        tensors.update(fitted.fit.tensors)
    return tensors


def _stores_network(stage: StageContext, trained: Trained, fitted: Fitted) -> bool:
    """The stage keeps a network of its own: trained, and not dropped by the first-session decision."""
    dropped = fitted.decision is not None and not fitted.decision.keeps_adapters
    return stage.method.trains and not trained.skipped and not dropped


def _stage_meta(stage: StageContext, trained: Trained, fitted: Fitted, evaluated: Evaluated) -> dict[str, Any]:
    """stage.json: what the stage learned from, on what, and how well."""
    images, fit, report = stage.images, fitted.fit, evaluated.report
    train_metrics = _train_metrics(trained, fitted)
    if _stores_network(stage, trained, fitted):
        num_params = stage.model.network.stages[-1].num_params()
    else:
        num_params = fit.num_params if fit is not None else 0
    meta = {
        "stage": stage.index,
        "drl_version": __version__,
        "classes": list(images.class_names),
        "images_per_class": images.counts(),
        "data_fingerprint": stage.fingerprint,
        "train": asdict(stage.train) if stage.method.trains and not trained.skipped else None,
        "device": str(stage.model.device),
        "precision": stage.precision,  # the forward's in training, prototypes and evaluation
        "world_size": distributed.world_size(),
        "eval_data": _eval_data_entry(stage),
        "num_params": num_params,
        "eval_missing": evaluated.warnings,
        "metrics": {
            "eval": report.to_dict() if report else None,
            "train": train_metrics,
            # learning without evaluation, for every method alike: SGD (if any), feature pass, fit
            "learn_seconds": round((trained.result.seconds if trained.result else 0.0) + fitted.seconds, 3),
        },
    }
    if trained.result is not None:  # the training steps' dtype (``train.precision``)
        meta["metrics"]["train"]["precision"] = stage.train_precision
    if evaluated.switch is not None:  # a switched run: its eval is the answering track's; both tracks learn
        meta["switch"] = evaluated.switch
        meta["metrics"]["learn_seconds"] = round(
            meta["metrics"]["learn_seconds"] + evaluated.switch["frozen_seconds"], 3
        )
    meta["open_set"] = fitted.calibration.to_dict()
    if fit is not None:
        meta["ridge"] = fit.meta  # the ridge head's λ, validation errors and counts (every method scored by it)
    if fitted.decision is not None:  # stage 1's adapted against frozen features, on its held-out images
        meta["first_session"] = fitted.decision.to_dict()
    if fitted.carry is not None:  # a carried run: how far the stage moved the earlier classes
        meta["carry"] = fitted.carry
    return meta


def _train_metrics(trained: Trained, fitted: Fitted) -> dict[str, Any] | None:
    """stage.json's metrics.train: the SGD's, else the feature pass and solve's seconds; None for neither."""
    if trained.result is not None:
        metrics = asdict(trained.result)
    else:
        metrics = {"seconds": fitted.seconds} if fitted.fit is not None else None
    if trained.skipped:
        metrics = {**(metrics or {}), "skipped": True}
    if trained.paused:  # a switched run's carried network, kept as it stood (``Began.paused``)
        metrics = {**(metrics or {}), "paused": True}
    return metrics


def _eval_data_entry(stage: StageContext) -> dict[str, Any] | None:
    """--eval-data as registered for later evaluations: relative to the run, with its classes and
    fingerprint (a folder only: a dataset has no path to find it again). A set held out of the drop
    (--eval-fraction) has no path: its fraction, seed, classes, fingerprint and size, for people
    (``eval --all-seen`` does not evaluate it again)."""
    if stage.eval_images is not None and stage.held_out is not None:
        return {
            **stage.held_out,
            "classes": list(stage.eval_images.class_names),
            "fingerprint": stage.eval_images.fingerprint(),
            "num_images": len(stage.eval_images),
        }
    if stage.eval_images is None or stage.eval_data_dir is None:
        return None
    return {
        "path": os.path.relpath(Path(stage.eval_data_dir).resolve(), stage.run.path.resolve()),
        "classes": list(stage.eval_images.class_names),
        "fingerprint": stage.eval_images.fingerprint(),
    }


def commit_stage(stage: StageContext, record: Record) -> None:
    """Rank 0 commits the stage atomically, then drops the epoch checkpoint it no longer needs."""
    if stage.writer is None:
        return
    stage.say("commit", 0, 0, f"stage {stage.index}")
    tick = time.perf_counter()
    # the earlier totals are in this stage's: the stage before it keeps none (its totals file goes)
    supersede = stage.run.totals_files(stage.manifest) if record.carries_totals and stage.manifest else ()
    stage.writer.commit(record.files, manifest=stage.manifest, new_stage=stage.index, supersede=supersede)
    stage.writer.discard_checkpoint()
    log.debug(
        "committed stage %d (%d bytes) in %.2fs",
        stage.index,
        sum(map(len, record.files.values())),
        time.perf_counter() - tick,
    )


def learned_result(
    stage: StageContext, trained: Trained, fitted: Fitted, evaluated: Evaluated, record: Record, *, start: float
) -> StageResult:
    """What learn-stage reports for a stage it learned and committed."""
    train = trained.result
    return StageResult(
        status="learned",
        resumed_from_epoch=trained.resumed_from,
        stage=stage.index,
        classes=list(stage.images.class_names),
        num_images=len(stage.images),
        train_seconds=train.seconds if train else fitted.seconds if fitted.fit else 0.0,
        total_seconds=time.perf_counter() - start,
        epoch_losses=train.epoch_losses if train else [],
        scale=train.scale if train else None,
        num_params=record.meta["num_params"],
        training_skipped=trained.skipped,
        skipped_because=stage.skip_reason if trained.skipped else "",
        first_session=record.meta.get("first_session"),
        carry=record.meta.get("carry"),
        switch=record.meta.get("switch"),
        passes=record.meta["metrics"].get("passes"),
        stage_bytes=sum(len(b) for b in record.files.values()),
        eval=evaluated.report,
        history=history_of([*stage.loaded.stage_metas, record.meta]),
        warnings=evaluated.warnings,
        run_dir=str(stage.run.path),
        precision=stage.precision,
        train_precision=stage.train_precision if train else None,
    )
