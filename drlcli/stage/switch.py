"""learn-stage in a switched run (``Method.switches``, ``run/track.py``): the stage is
learned first by the run's frozen track (the frozen default's own run, made at stage 1), then by
the carried network; the stage's forward transfer picks the track the run answers from, and
stage.json's ``switch`` says which, with both tracks' top-1 on the stage's evaluation."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import distributed
from ..commands.init import run_record
from ..config import RunConfig
from ..errors import IntegrityError, RunStateError
from ..progress import Progress, ProgressFn
from ..run.files import init_files
from ..run.records import read_record
from ..run.track import CARRIED, FROZEN, frozen_track
from .context import Evaluated, Fitted, Records, Sources
from .record import StageResult


def frozen_config(config: RunConfig) -> RunConfig:
    """The frozen track's config: the default ``drl`` with the run's seed, workers and "unknown" answer."""
    own = config.to_dict()
    train = {"seed": config.train.seed, "num_workers": config.train.num_workers}
    return RunConfig.for_method("drl", {"train": train, "open_set": own["open_set"]})


def learn_frozen_track(
    records: Records,
    sources: Sources,
    *,
    learn: Any,
    num_workers: int | None,
    device: str,
    ptm_weights: Path | None,
    precision: str,
    progress: ProgressFn | None,
) -> StageResult:
    """The frozen track learns the stage (``learn``: ``learn_stage``), made first at the run's stage 1.
    It holds the run's stages, or one more that an interrupted call committed: with the same data
    that stage is reused, with other data refused (RunStateError) before anything is written."""
    if distributed.is_main():  # the other ranks read what rank 0, holding the run's lock, checked or made
        _check_track(records)
    distributed.barrier()

    def relay(event: Progress) -> None:
        if progress is not None:
            progress(replace(event, detail=f"frozen track: {event.detail}".strip()))

    return learn(
        frozen_track(records.run).path,
        data_dir=sources.data_dir,
        eval_data_dir=sources.eval_data_dir,
        data=sources.data,
        eval_data=sources.eval_data,
        class_names=sources.class_names,
        train_overrides=None if num_workers is None else {"num_workers": num_workers},
        device=device,
        ptm_weights=ptm_weights,
        precision=precision,
        progress=relay if progress is not None else None,
    )


def _check_track(records: Records) -> None:
    """The frozen track as this stage needs it: made at the run's stage 1, else holding the run's
    stages or one more of this data (an interrupted call's), which its learn-stage then reuses."""
    run, stages = records.run, len(records.metas)
    track = frozen_track(run, create=not stages)
    if not track.exists():
        if stages:
            raise IntegrityError(
                f"switched run {run.path} has lost its frozen track ({track.path}); restore the run from a backup"
            )
        _init_track(records, track)
    manifest = track.manifest()
    held = [track.stage_meta(i, manifest) for i in track.stage_indices(manifest)]
    if len(held) == stages + 1:
        last = held[-1]
        if (last.get("classes"), last.get("data_fingerprint")) != (
            list(records.images.class_names),
            records.fingerprint,
        ):
            raise RunStateError(
                f"the frozen track of run {run.path} holds a stage {stages + 1} of other data ({_names(last)}), from "
                "an interrupted learn-stage: learn that data again first"
            )
    elif len(held) != stages:
        raise IntegrityError(
            f"the frozen track of run {run.path} holds {len(held)} stages, the run {stages}; restore the run from a backup"
        )


def answered(fitted: Fitted, evaluated: Evaluated, frozen: StageResult) -> Evaluated:
    """The stage's evaluation as the run answers: the carried network's once the run's forward
    transfer says adapting pays (stage.json ``carry.transfer``), else the frozen track's; with
    stage.json's ``switch``, which says which and both tracks' top-1."""
    transfer = (fitted.carry or {}).get("transfer")
    answer = CARRIED if transfer is not None and transfer["transfers"] else FROZEN
    switch = {
        "answers": answer,
        "top1": {
            CARRIED: evaluated.report.top1 if evaluated.report else None,
            FROZEN: frozen.eval.top1 if frozen.eval else None,
        },
        "frozen_seconds": round(frozen.train_seconds, 3),  # the frozen track's feature pass and fit
    }
    report = evaluated.report if answer == CARRIED else frozen.eval
    return replace(evaluated, report=report, switch=switch)


def _init_track(records: Records, track: Any) -> None:
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
