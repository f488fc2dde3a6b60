"""learn-stage's first phases: the run's records and the data's listings (seconds: refuse a learned
class, answer a drop already learned, before any model is built or image decoded), then the
run's model loaded, then every image decoded once."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from ..data import LabelledImages, refuse_near_duplicates, validate_images
from ..data.split import check_fraction, split_held_out
from ..errors import DataError, UsageError
from ..evaluation import check_class_names_use, labelled_images
from ..methods import method_of
from ..metrics import AccuracyReport
from ..progress import Progress, ProgressFn
from ..run import load as run_load
from ..run.directory import RunDir
from ..run.forgotten import read_log
from ..run.records import (
    checked_metas,
    first_session_record,
    history_of,
    read_record,
    switch_record,
    train_metrics,
)
from ..run.writer import RunWriter
from ..tracking import TensorBoardLog
from .context import Records, Sources, StageContext
from .record import StageResult

log = logging.getLogger(__name__)


def read_records(run: RunDir, data: Sources, progress: ProgressFn | None) -> Records:
    """The run's records and the data's listings (under the run's lock): seconds, not minutes."""
    check_eval_fraction(data)
    if progress is not None:
        progress(Progress("read", 0, 0, "the run's records and the data folders"))
    manifest = run.manifest()
    _, config = read_record(run, manifest)
    metas = checked_metas(run, manifest)
    forgotten = read_log(run, manifest, {meta["stage"]: meta for meta in metas})
    check_class_names_use(data.class_names, data.data, data.eval_data)
    images = labelled_images(data.data_dir, data.data, data.class_names, what="data")
    if images is None:
        raise UsageError("pass the new classes' images: data_dir (a folder) or data (a Dataset)")
    eval_images = labelled_images(data.eval_data_dir, data.eval_data, data.class_names, what="eval_data")
    held_out = None
    if data.eval_fraction is not None:
        images, eval_images = split_held_out(images, data.eval_fraction, seed=config.train.seed)
        held_out = {"held_out": data.eval_fraction, "seed": config.train.seed}
    return Records(
        manifest=manifest,
        config=config,
        metas=metas,
        learned={name: meta["stage"] for meta in metas for name in forgotten.active(meta)},
        images=images,
        eval_images=eval_images,
        eval_data_dir=data.eval_data_dir,
        fingerprint=images.fingerprint(),  # stats every file: once
        run=run,
        held_out=held_out,
    )


def check_eval_fraction(data: Sources) -> None:
    """--eval-fraction is in (0, 1) and stands instead of --eval-data (UsageError otherwise)."""
    if data.eval_fraction is None:
        return
    check_fraction(data.eval_fraction)
    if data.eval_data_dir is not None or data.eval_data is not None:
        raise UsageError(
            "--eval-fraction holds out part of --data as the stage's evaluation set; pass it or --eval-data, not both"
        )


def prepare(
    run: RunDir,
    writer: RunWriter | None,
    records: Records,
    *,
    train_overrides: dict[str, Any] | None,
    device: str,
    ptm_weights: Path | None,
    precision: str,
    tracker: TensorBoardLog | None,
    progress: ProgressFn | None,
) -> StageContext:
    """Load the run's model (the PTM, every stage) and set up the call: its config with the overrides."""
    if progress is not None:
        progress(Progress("load", 0, 0, "the PTM and the run's stages"))
    # the head as learn-stage reads it: the stage fits a new one (with every class's covariances) from the tensors
    loaded = run_load.load_run(run, device=device, ptm_weights=ptm_weights, scoring=False)
    stage = StageContext(
        run=run,
        writer=writer,
        manifest=records.manifest,
        config=records.config.with_train(**(train_overrides or {})),
        method=method_of(records.config),
        loaded=loaded,
        learned=records.learned,
        images=records.images,
        eval_images=records.eval_images,
        eval_data_dir=records.eval_data_dir,
        fingerprint=records.fingerprint,
        index=max(run.stage_indices(records.manifest), default=0) + 1,
        device=device,
        precision=precision,
        tracker=tracker,
        progress=progress,
        held_out=records.held_out,
        train_given=frozenset(key for key, value in (train_overrides or {}).items() if value is not None),
    )
    if stage.schedule.carries and loaded.stage_metas:
        stage.earlier_transfer()  # a crafted record stops the call before any training
    return stage


def check_data(stage: StageContext) -> None:
    """Every image of --data and --eval-data decodes (DataError otherwise)."""
    for item in (stage.images, stage.eval_images):
        if item is not None:
            stage.say("validate", 0, len(item), item.origin)
            tick = time.perf_counter()
            validate_images(
                item, progress=lambda step, total, item=item: stage.say("validate", step, total, item.origin)
            )
            log.debug("validated %d images of %s in %.1fs", len(item), item.origin, time.perf_counter() - tick)


def check_classes(images: LabelledImages, eval_images: LabelledImages | None, learned: dict[str, int]) -> None:
    """A stage brings new classes only, none a near-duplicate name of a learned one; --eval-data
    holds learned classes or this stage's."""
    for name in images.class_names:
        if name in learned:
            raise DataError(
                f"class {name!r} in --data was already learned in stage {learned[name]}; "
                "new stages bring new classes only: rename or remove that folder"
            )
    refuse_near_duplicates(images.class_names, learned)
    if eval_images is not None:
        unknown = [c for c in eval_images.class_names if c not in learned and c not in images.class_names]
        if unknown:
            raise DataError(
                f"--eval-data {eval_images.origin} has class(es) neither learned nor in --data: "
                f"{unknown[:5]}; remove them or add them to --data"
            )


def already_committed(records: Records) -> StageResult | None:
    """The committed stage that learned exactly these images, as a no-op result (or None). Its
    classes as learned: a class forgotten since (drl forget) does not make the same drop new again."""
    classes = list(records.images.class_names)
    meta = next(
        (m for m in records.metas if m["classes"] == classes and m["data_fingerprint"] == records.fingerprint), None
    )
    if meta is None:
        return None
    index = meta["stage"]
    train = train_metrics(meta)
    evaluation = meta["metrics"].get("eval")
    return StageResult(
        status="unchanged",
        resumed_from_epoch=None,
        stage=index,
        classes=list(meta["classes"]),
        num_images=len(records.images),
        train_seconds=0.0,
        total_seconds=0.0,
        epoch_losses=[],
        scale=train.get("scale"),
        num_params=meta["num_params"],
        stage_bytes=records.run.stage_bytes(index, records.manifest),
        eval=AccuracyReport(**evaluation) if evaluation else None,
        history=history_of(records.metas[: records.metas.index(meta) + 1]),
        run_dir=str(records.run.path),
        precision=meta.get("precision", "fp32"),  # absent: committed before drl recorded it, in fp32
        training_skipped=train.get("skipped") is True,
        first_session=first_session_record(meta),
        switch=switch_record(meta),
    )
