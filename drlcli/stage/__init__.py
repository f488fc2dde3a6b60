"""Learning one stage (``drl learn-stage``): ``learn_stage`` runs the phases in order, each in its
own module: ``prepare.py`` (records, early checks, the model, the images), ``resume.py`` with
``train.py`` and ``train_state.py`` (training, resumable by epoch), ``fit.py`` (the feature pass:
prototypes, calibration, the head's fit), ``record.py`` (evaluation, files, commit, result).
``context.py`` holds what they share; ``losses.py`` DAS (paper §III-C)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import distributed
from ..device import resolve_device
from ..evaluation import SetFeatures
from ..methods import schedule_of
from ..precision import check_precision
from ..progress import ProgressFn
from ..run.directory import RunDir
from ..run.records import set_has_trained
from ..run.track import adopt_track
from ..run.writer import RunWriter
from ..tracking import TensorBoardLog, check_tensorboard_dir
from .begin import carried_start
from .context import Evaluated, Fitted, Record, Records, Sources, StageContext, Trained
from .cost import stage_passes
from .fit import fit_features
from .prepare import already_committed, check_classes, check_data, prepare, read_records
from .record import StageResult, commit_stage, evaluate_stage, learned_result, record_stage
from .resume import train_or_resume
from .switch import (
    FrozenStage,
    answered,
    committed_frozen,
    frozen_track_of,
    learned_frozen,
    relay,
    resumed_frozen,
)


def learn_stage(
    run_dir: Path | str,
    *,
    data_dir: Path | None = None,
    eval_data_dir: Path | None = None,
    data: Any = None,
    eval_data: Any = None,
    class_names: Sequence[str] | None = None,
    eval_fraction: float | None = None,
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
    registered for later ones (``eval --all-seen``). ``eval_fraction`` (0 < F < 1, instead of
    ``eval_data``): hold out that seeded fraction of each class of the data as the stage's eval set,
    never trained on (``data/split.py``); stage.json's ``eval_data`` records it, with no path.

    Each finished epoch is checkpointed; an interrupted call resumes from its last epoch when run
    again with the same data, options and precision (``restart`` discards it instead). Running
    again after the stage committed, with the same data, changes nothing.

    ``precision``: the dtype the network's forward runs in, in training, the prototype pass and
    the evaluation (fp32, bf16, or fp16 on CUDA; ``precision.py``); stage.json records it.
    ``tensorboard_dir``: also write TensorBoard event files there (``tracking.py``, the
    ``tensorboard`` extra), never inside a run directory.

    The phases, in order: prepare (read the run and the data) -> the idempotence check -> check
    the data -> train or resume -> prototypes (and an analytic head's fit) -> evaluate -> record
    -> commit. A switched run's frozen track (``switch.py``) learns the stage the same way once the
    run's records are read, and its files are committed with the run's.
    """
    start = time.perf_counter()
    check_precision(precision, resolve_device(device))
    if tensorboard_dir is not None:
        check_tensorboard_dir(tensorboard_dir)
    main = distributed.is_main()
    options = _Options(train_overrides, device, ptm_weights, restart, precision, progress)
    with (
        contextlib.ExitStack() as locks,
        TensorBoardLog(tensorboard_dir) if main and tensorboard_dir else contextlib.nullcontext() as tracker,
    ):
        sources = Sources(data_dir, eval_data_dir, data, eval_data, class_names, eval_fraction)
        learned = _learn(RunDir(run_dir), sources, options, locks, tracker)
        if isinstance(learned, StageResult):
            return learned
        result = learned.commit(start)
        if tracker is not None:
            tracker.log_stage(result.stage, result.history)
            result = replace(result, tensorboard_dir=str(tracker.log_dir) if tracker.written else None)
    return result


@dataclass(frozen=True)
class _Options:
    train_overrides: dict[str, Any] | None
    device: str
    ptm_weights: Path | None
    restart: bool
    precision: str
    progress: ProgressFn | None
    keep_f0: bool = False  # a switched run's frozen track: its f_0 of the stage's images, for the run
    offer: bool = False  # ... and its head's solution, while the run's set has never trained (``fit_features``)


@dataclass(frozen=True)
class _Learned:
    """A stage learned and recorded, not yet committed (a switched run's frozen track's files are
    already with the run's writer, which publishes them in the same commit)."""

    stage: StageContext
    trained: Trained
    fitted: Fitted
    evaluated: Evaluated
    record: Record

    def commit(self, start: float) -> StageResult:
        commit_stage(self.stage, self.record)
        distributed.barrier()  # every rank returns only once the stage is committed
        return learned_result(self.stage, self.trained, self.fitted, self.evaluated, self.record, start=start)


@dataclass(frozen=True)
class _FrozenPass:
    """What a switched run's frozen track's pass over the stage's images gave the run (this process's
    share): f_0, the head's rows and rmd inputs, each eval set's rows and its head's solution (all of
    them an untrained set's too); ``fingerprint``: of the images."""

    f0: Any
    fingerprint: str
    rows: tuple[Any, Any]
    eval_rows: tuple[SetFeatures, ...]
    solution: Any


def _learn_frozen(
    records: Records, writer: RunWriter | None, sources: Sources, options: _Options, locks: contextlib.ExitStack
) -> tuple[FrozenStage, _FrozenPass | None]:
    """A switched run's frozen track's stage (``switch.py``), learned and handed to the run's writer,
    unless the interrupted call this one resumes kept it (``resumed_frozen``) or an earlier release's
    committed it alone: what the run's record takes of it, and its f_0 of the stage's images with
    their fingerprint, for the run's forward transfer, with its head rows and its eval sets' rows, which
    an untrained set's are too (None: not computed)."""
    track = frozen_track_of(records, writer)
    kept = None if options.restart else resumed_frozen(records, track, writer)
    if kept is not None:
        return kept, None
    frozen = _learn(track, sources, replace(options, restart=False), locks, None)
    if isinstance(frozen, StageResult):  # committed alone by an earlier release's interrupted call
        return committed_frozen(track, frozen), None
    # handed to the run's writer now (``RunWriter.defer``): published by the run's commit, and kept in
    # the run's epoch checkpoints meanwhile, for a call that resumes this one
    commit_stage(frozen.stage, frozen.record)
    fitted = frozen.fitted
    return learned_frozen(frozen.record, frozen.evaluated.report, frozen.stage.index), _FrozenPass(
        fitted.f0,
        frozen.stage.fingerprint,
        (fitted.rows, fitted.rmd_rows),
        frozen.evaluated.rows,
        fitted.fit.solution if fitted.fit is not None else None,
    )


def _learn(
    run: RunDir, sources: Sources, options: _Options, locks: contextlib.ExitStack, tracker: TensorBoardLog | None
) -> StageResult | _Learned:
    """Every phase but the commit, under the run's lock (held by ``locks`` until the caller commits):
    the committed stage's result if this data is already learned, else the stage to commit. A
    switched run's frozen track learns the stage first (``switch.py``); its files are committed with
    the run's, so that a failure anywhere leaves both tracks as they were, or both with the stage."""
    # under torchrun only rank 0 locks and writes (the run, the event files); the others read the
    # same committed state
    writer = locks.enter_context(run.writer()) if distributed.is_main() else None
    if writer is not None:
        adopt_track(run, writer)  # a run written before format 4: its frozen track into its manifest
    distributed.barrier()  # rank 0 holds the lock (or failed, which stops every rank)
    records = read_records(run, sources, options.progress)
    unchanged = already_committed(records)
    if unchanged is not None:
        return unchanged
    check_classes(records.images, records.eval_images, records.learned)
    outcome = frozen_pass = None
    if schedule_of(records.config).switches:
        overrides = options.train_overrides or {}
        records.config.with_train(**overrides)  # a bad option, before either track learns
        workers = {"num_workers": overrides["num_workers"]} if "num_workers" in overrides else None
        untrained = not set_has_trained(records.metas)  # the set may be the frozen PTM this stage
        own = replace(options, train_overrides=workers, progress=relay(options.progress), keep_f0=True, offer=untrained)
        outcome, frozen_pass = _learn_frozen(records, writer, sources, own, locks)
    stage = prepare(
        run,
        writer,
        records,
        train_overrides=options.train_overrides,
        device=options.device,
        ptm_weights=options.ptm_weights,
        precision=options.precision,
        tracker=tracker,
        progress=options.progress,
    )
    check_data(stage)
    # the frozen track's pass only of the very images the run lists, in its order (else the run passes them itself)
    same = frozen_pass is not None and frozen_pass.fingerprint == stage.fingerprint
    return _learn_run(stage, options, frozen_pass if same else None, outcome)


def _learn_run(
    stage: StageContext, options: _Options, handed: _FrozenPass | None, outcome: FrozenStage | None
) -> _Learned:
    """The run's own phases after its checks: a carried run's stage begins (its forward transfer, before
    training), trains, fits, is evaluated and recorded; ``handed``: the frozen track's pass of the same
    images, ``outcome``: that track's stage (a switched run)."""
    began = carried_start(stage, handed.f0 if handed else None, handed.rows if handed else None)
    trained = train_or_resume(stage, restart=options.restart, paused=began is not None and began.paused)
    # an untrained set is the frozen PTM: its eval rows are the frozen track's (no second pass), and its
    # head's sums are that track's, whose solution its fit takes once it has checked them
    same = handed if handed is not None and began is not None and began.untrained else None
    given = same.solution if same else None
    fitted = fit_features(stage, began, keep_f0=options.keep_f0, solutions=(options.offer, given))
    evaluated = evaluate_stage(stage, given=same.eval_rows if same else (), keep=options.keep_f0)
    if outcome is not None:  # the run answers from the track its records pick (``track.answer_after``)
        evaluated = answered(stage, fitted, evaluated, outcome)
    passes = stage_passes(stage, began, trained, fitted, frozen=outcome is not None)
    record = record_stage(stage, trained, fitted, evaluated, passes=passes)
    return _Learned(stage, trained, fitted, evaluated, record)
