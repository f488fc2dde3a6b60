"""learn-stage in a switched run (``Schedule.switches``, ``run/track.py``): the run's frozen track (the
frozen default's files inside the run) learns the stage too, and its files are committed with the
run's, in one commit; the stage's forward transfer picks the track the run answers from, and
stage.json's ``switch`` says which, with both tracks' top-1 on the stage's evaluation and the
sha256 of the frozen track's stage record."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .. import distributed, jsonio
from ..errors import IntegrityError, RunStateError
from ..metrics import AccuracyReport, Transfer
from ..progress import ProgressFn
from ..run.directory import RunDir
from ..run.layout import FROZEN_TRACK, STAGE_META, sha256_bytes, stage_file
from ..run.records import check_stage_meta
from ..run.track import CARRIED, FROZEN, answer_after, frozen_track, tied_track, trial_speaks, widened_before
from ..run.trackdir import TrackDir
from ..run.writer import RunWriter, deferred_files
from .context import Evaluated, Fitted, Record, Records, StageContext
from .record import StageResult


@dataclass(frozen=True)
class FrozenStage:
    """What the run's record takes of the frozen track's stage."""

    report: AccuracyReport | None  # its evaluation
    seconds: float  # its feature pass and fit
    meta_sha256: str  # of its stage.json


def learned_frozen(record: Record, report: AccuracyReport | None, index: int) -> FrozenStage:
    """The frozen track's stage as it is about to commit."""
    meta = record.files[stage_file(index, STAGE_META)]
    return FrozenStage(report, float(record.meta["metrics"]["learn_seconds"]), sha256_bytes(meta))


def committed_frozen(track: RunDir, result: StageResult) -> FrozenStage:
    """The frozen track's stage a call of an earlier release, interrupted between its two commits,
    committed alone (adopted into the run's manifest with it, ``track.adopt_track``): reused."""
    manifest = track.manifest()
    seconds = track.stage_meta(result.stage, manifest)["metrics"].get("learn_seconds")
    seconds = seconds if isinstance(seconds, (int, float)) else 0.0
    return FrozenStage(result.eval, float(seconds), manifest["files"][stage_file(result.stage, STAGE_META)]["sha256"])


def resumed_frozen(records: Records, track: RunDir, writer: RunWriter | None) -> FrozenStage | None:
    """The frozen track's stage an interrupted call of this stage learned and kept in its epoch
    checkpoint (``RunWriter.save_checkpoint``, under the run's names of ``track``'s files): handed
    to ``writer`` again, so that the resumed call does not repeat the track's pass; None (every rank
    agrees) when there is none for this data."""
    found = records.run.checkpoint() if writer is not None else None
    kept = None
    if found is not None and found[0].get("generation") == records.manifest["generation"]:
        kept = deferred_files(*found)
    outcome = None
    name = track.run_name(stage_file(len(records.metas) + 1, STAGE_META)) if isinstance(track, TrackDir) else None
    if kept is not None and name in kept[0]:
        meta = _track_meta(kept[0][name])
        if meta is not None and _same(records, meta):
            writer.defer(kept[0], tuple(kept[1]))
            seconds = meta["metrics"].get("learn_seconds")
            report = AccuracyReport(**meta["metrics"]["eval"]) if meta["metrics"].get("eval") else None
            outcome = FrozenStage(report, float(seconds or 0.0), sha256_bytes(kept[0][name]))
    return distributed.broadcast_object(outcome)


def _track_meta(data: bytes) -> dict[str, Any] | None:
    """A kept stage.json of the track, checked like every stage record (None: not one)."""
    try:
        meta = jsonio.loads(data)
        check_stage_meta(RunDir(FROZEN_TRACK), int(meta["stage"]), meta)
    except (ValueError, KeyError, TypeError, IntegrityError):
        return None
    return meta


def _same(records: Records, meta: dict[str, Any]) -> bool:
    try:
        _same_data(records, meta)
    except RunStateError:
        return False
    return True


def frozen_track_of(records: Records, writer: RunWriter | None) -> RunDir:
    """The run's frozen track, checked by rank 0 to be the run's (under the run's lock), written
    through the run's ``writer``. It may hold one more stage (left by a call of an earlier release
    interrupted between its two commits), of this very data: learn-stage then reuses it."""
    if distributed.is_main():
        track, held, _ = tied_track(records.run, records.manifest, records.metas, classes=False, ahead=True)
        if len(held["stages"]) > len(records.metas):
            _same_data(records, track.stage_meta(held["stages"][-1], held))
    distributed.barrier()
    return frozen_track(records.run, records.manifest, writer=writer)


def _same_data(records: Records, last: dict[str, Any]) -> None:
    """The track's extra stage is of the data (and the registered eval data) this call learns."""
    same = (last.get("classes"), last.get("data_fingerprint")) == (
        list(records.images.class_names),
        records.fingerprint,
    )
    registered = (last.get("eval_data") or {}).get("fingerprint") if isinstance(last.get("eval_data"), dict) else None
    given = records.eval_images.fingerprint() if records.eval_images is not None and records.eval_data_dir else None
    if not same or registered != given:
        classes = last.get("classes") if isinstance(last.get("classes"), list) else []
        names = ", ".join(map(str, classes[:3])) + (", ..." if len(classes) > 3 else "")
        raise RunStateError(
            f"the frozen track of run {records.run.path} holds a stage {len(records.metas) + 1} of other data "
            f"({names}), committed by an interrupted learn-stage of an earlier release: learn that data again "
            "first, with the same --eval-data"
        )


def relay(progress: ProgressFn | None) -> ProgressFn | None:
    """``progress``, each event marked as the frozen track's."""
    if progress is None:
        return None
    return lambda event: progress(
        replace(event, detail=f"frozen track: {event.detail}" if event.detail else "frozen track")
    )


def answered(stage: StageContext, fitted: Fitted, evaluated: Evaluated, frozen: FrozenStage) -> Evaluated:
    """The stage's evaluation as the run answers (``track.answer_after``): the carried network's once
    the run's forward transfer (stage.json ``carry.transfer``) says adapting pays, or, after a stage
    whose trial widened the margins (``schedule.trial_answers``; a small drop's by its own trial,
    ``trial_answers_small_stage``), while it does not say adapting loses; else the frozen track's. With
    stage.json's ``switch``: which, both tracks' top-1, the frozen track's seconds and record sha256."""
    transfer = (fitted.carry or {}).get("transfer")
    total = Transfer.from_dict(transfer["run"]) if transfer is not None else Transfer(0, 0, 0)
    own = {"carry": fitted.carry, "images_per_class": stage.images.counts()}  # as stage.json will hold them
    speaks = trial_speaks(stage.config.schedule, widened_before(stage.loaded.stage_metas), own)
    answer = answer_after(total, speaks)
    switch = {
        "answers": answer,
        "top1": {
            CARRIED: evaluated.report.top1 if evaluated.report else None,
            FROZEN: frozen.report.top1 if frozen.report else None,
        },
        "frozen_seconds": round(frozen.seconds, 3),
        "frozen_stage_sha256": frozen.meta_sha256,
    }
    report = evaluated.report if answer == CARRIED else frozen.report
    return replace(evaluated, report=report, switch=switch)
