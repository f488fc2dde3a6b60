"""learn-stage in a switched run (``Method.switches``, ``run/track.py``): the run's frozen track (the
frozen default's own run, made at stage 1) learns the stage too, and commits it just before the
run's own commit; the stage's forward transfer picks the track the run answers from, and
stage.json's ``switch`` says which, with both tracks' top-1 on the stage's evaluation and the
sha256 of the frozen track's stage record, which ties that track to the run."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from .. import distributed
from ..commands.init import run_record
from ..errors import RunStateError
from ..metrics import AccuracyReport
from ..progress import ProgressFn
from ..run.directory import RunDir
from ..run.files import init_files
from ..run.layout import STAGE_META, sha256_bytes, stage_file
from ..run.records import read_record
from ..run.track import CARRIED, FROZEN, frozen_config, frozen_track, tied_track
from .context import Evaluated, Fitted, Record, Records
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


def committed_frozen(result: StageResult) -> FrozenStage:
    """The frozen track's stage an interrupted call committed (its next call reuses it)."""
    track = RunDir(result.run_dir or "")
    manifest = track.manifest()
    seconds = track.stage_meta(result.stage, manifest)["metrics"].get("learn_seconds") or 0.0
    return FrozenStage(result.eval, float(seconds), manifest["files"][stage_file(result.stage, STAGE_META)]["sha256"])


def frozen_track_of(records: Records) -> RunDir:
    """The run's frozen track, as this stage needs it (checked or made by rank 0, under the run's lock)."""
    if distributed.is_main():
        _check_track(records)
    distributed.barrier()
    return frozen_track(records.run)


def relay(progress: ProgressFn | None) -> ProgressFn | None:
    """``progress``, each event marked as the frozen track's."""
    if progress is None:
        return None
    return lambda event: progress(replace(event, detail=f"frozen track: {event.detail}".strip()))


def answered(fitted: Fitted, evaluated: Evaluated, frozen: FrozenStage) -> Evaluated:
    """The stage's evaluation as the run answers: the carried network's once the run's forward
    transfer says adapting pays (stage.json ``carry.transfer``), else the frozen track's; with
    stage.json's ``switch``: which, both tracks' top-1, the frozen track's seconds and record sha256."""
    transfer = (fitted.carry or {}).get("transfer")
    answer = CARRIED if transfer is not None and transfer["transfers"] else FROZEN
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


def _check_track(records: Records) -> None:
    """The frozen track as this stage needs it: made at the run's stage 1, else holding the run's
    stages (its records tied to the run's) or one more of this data, committed by a call interrupted
    between the two commits, which its learn-stage then reuses."""
    run, stages = records.run, len(records.metas)
    track = frozen_track(run, create=not stages)
    if not stages and not track.exists():
        _init_track(records, track)
    _, manifest, _ = tied_track(run, records.manifest, records.metas, classes=False, ahead=True, wait=False)
    held = [track.stage_meta(i, manifest) for i in track.stage_indices(manifest)]
    if len(held) == stages + 1:
        last = held[-1]
        same = (last.get("classes"), last.get("data_fingerprint")) == (
            list(records.images.class_names),
            records.fingerprint,
        )
        registered = (
            (last.get("eval_data") or {}).get("fingerprint") if isinstance(last.get("eval_data"), dict) else None
        )
        given = records.eval_images.fingerprint() if records.eval_images is not None and records.eval_data_dir else None
        if not same or registered != given:
            raise RunStateError(
                f"the frozen track of run {run.path} holds a stage {stages + 1} of other data ({_names(last)}), "
                "committed by an interrupted learn-stage: learn that data again first, with the same --eval-data"
            )


def _init_track(records: Records, track: RunDir) -> None:
    """The frozen track's run directory: the run's PTM (its recorded place, seen from ``frozen/``, or
    its stored random weights) under the frozen default's config."""
    run = records.run
    record, config = read_record(run, records.manifest)
    ptm = dict(record["ptm"])
    if isinstance(ptm.get("weights_hint"), str):
        ptm["weights_hint"] = os.path.join(os.pardir, ptm["weights_hint"])
    state = run.ptm_weights(records.manifest) if run.has_ptm_weights(records.manifest) else None
    with track.writer(create=True) as writer:
        writer.commit(init_files(run_record(ptm, frozen_config(config)), state), manifest=None)


def _names(meta: dict[str, Any]) -> str:
    classes = meta.get("classes") if isinstance(meta.get("classes"), list) else []
    return ", ".join(map(str, classes[:3])) + (", ..." if len(classes) > 3 else "")
