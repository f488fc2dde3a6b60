"""Learning one stage (``drl learn-stage``): ``learn_stage`` runs the phases in order, each in its
own module: ``prepare.py`` (records, early checks, the model, the images), ``resume.py`` with
``train.py`` and ``train_state.py`` (training, resumable by epoch), ``fit.py`` (the feature pass:
prototypes, calibration, the head's fit), ``record.py`` (evaluation, files, commit, result).
``context.py`` holds what they share; ``losses.py`` DAS (paper §III-C)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import distributed
from ..device import resolve_device
from ..methods import method_of
from ..precision import check_precision
from ..progress import ProgressFn
from ..run.directory import RunDir
from ..tracking import TensorBoardLog, check_tensorboard_dir
from .context import Sources
from .fit import fit_features
from .prepare import already_committed, check_classes, check_data, prepare, read_records
from .record import StageResult, commit_stage, evaluate_stage, learned_result, record_stage
from .resume import train_or_resume
from .switch import answered, learn_frozen_track


def learn_stage(
    run_dir: Path | str,
    *,
    data_dir: Path | None = None,
    eval_data_dir: Path | None = None,
    data: Any = None,
    eval_data: Any = None,
    class_names: Sequence[str] | None = None,
    train_overrides: dict[str, Any] | None = None,
    device: str = "auto",
    ptm_weights: Path | None = None,
    restart: bool = False,
    precision: str = "fp32",
    tensorboard_dir: Path | None = None,
    progress: ProgressFn | None = None,
) -> StageResult:
    """Learn the classes in ``data_dir`` as a new stage and commit it atomically.

    Instead of folders, ``data`` (and ``eval_data``) may be torch Datasets of (image, label) pairs:
    images as PIL images or tensors, labels as class names or ints indexing ``class_names``
    (``data.dataset_images``). Every item is read once up front, to check it and to fingerprint
    the data. A dataset's eval set counts in this stage's evaluation but, having no path, is not
    registered for later ones (``eval --all-seen``).

    Each finished epoch is checkpointed; an interrupted call resumes from its last epoch when run
    again with the same data, options and precision (``restart`` discards it instead). Running
    again after the stage committed, with the same data, changes nothing.

    ``precision``: the dtype the network's forward runs in, in training, the prototype pass and
    the evaluation (fp32, bf16, or fp16 on CUDA; ``precision.py``); stage.json records it.
    ``tensorboard_dir``: also write TensorBoard event files there (``tracking.py``, the
    ``tensorboard`` extra), never inside a run directory.

    The phases, in order: prepare (read the run and the data) -> the idempotence check -> check
    the data -> train or resume -> prototypes (and an analytic head's fit) -> evaluate -> record
    -> commit.
    """
    start = time.perf_counter()
    check_precision(precision, resolve_device(device))
    if tensorboard_dir is not None:
        check_tensorboard_dir(tensorboard_dir)
    run = RunDir(run_dir)
    # under torchrun only rank 0 locks and writes (the run, the event files); the others read the
    # same committed state
    main = distributed.is_main()
    with (
        run.writer() if main else contextlib.nullcontext() as writer,
        TensorBoardLog(tensorboard_dir) if main and tensorboard_dir else contextlib.nullcontext() as tracker,
    ):
        distributed.barrier()  # rank 0 holds the lock (or failed, which stops every rank)
        sources = Sources(data_dir, eval_data_dir, data, eval_data, class_names)
        records = read_records(run, sources, progress)
        unchanged = already_committed(records)
        if unchanged is not None:
            return unchanged
        check_classes(records.images, records.eval_images, records.learned)
        frozen = None
        if method_of(records.config).switches(records.config):  # the frozen track learns the stage first
            frozen = learn_frozen_track(
                records,
                sources,
                learn=learn_stage,
                num_workers=(train_overrides or {}).get("num_workers"),
                device=device,
                ptm_weights=ptm_weights,
                precision=precision,
                progress=progress,
            )
        stage = prepare(
            run,
            writer,
            records,
            train_overrides=train_overrides,
            device=device,
            ptm_weights=ptm_weights,
            precision=precision,
            tracker=tracker,
            progress=progress,
        )
        check_data(stage)
        trained = train_or_resume(stage, restart=restart)
        fitted = fit_features(stage)
        evaluated = evaluate_stage(stage)
        if frozen is not None:  # the run answers from the track the stage's forward transfer picks
            evaluated = answered(fitted, evaluated, frozen)
        record = record_stage(stage, trained, fitted, evaluated)
        commit_stage(stage, record)
        distributed.barrier()  # every rank returns only once the stage is committed
        result = learned_result(stage, trained, fitted, evaluated, record, start=start)
        if tracker is not None:
            tracker.log_stage(result.stage, result.history)
            result = replace(result, tensorboard_dir=str(tracker.log_dir) if tracker.written else None)
    return result
