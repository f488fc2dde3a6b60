"""A switched run's two tracks (``Method.switches``; issue 32): the carried run itself, and its
frozen track, the frozen default's own run directory (``frozen/``, a ``drl`` run learning the same
stages). After each stage the run answers from one of them: from the carried network once the
run's forward transfer (stage.json ``carry.transfer``, ``metrics.Transfer``) says adapting tells
new classes apart better than the frozen PTM, and from the frozen track until then (stage 1 has no
transfer to measure). Both tracks learn every stage; the frozen one commits its stage just before
the run commits its own, so it holds the run's stages or, for the moment between the two commits
(or after a crash in it), one more. Each stage's ``switch`` record holds the sha256 of the frozen
track's record of the stage, so that no other run's stage records stand in for the track's."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import IntegrityError, RunStateError
from ..methods import method_of
from ..metrics import Transfer
from .access import real_dir
from .directory import ListedFileGone, RunDir
from .forgotten import ForgetState, read_log
from .layout import FROZEN_TRACK, STAGE_META, stage_file
from .lock import writer_active
from .records import check_stage_meta, read_record, transfer_record

CARRIED, FROZEN = "carried", "frozen"


def frozen_track(run: RunDir, *, create: bool = False) -> RunDir:
    """The run's frozen track (made as an empty folder when ``create``); a link or file in its place
    is refused (IntegrityError), so that no command follows a crafted run outside its folder."""
    path = run.path / FROZEN_TRACK
    real_dir(path, create=create)
    return RunDir(path)


def answering(run: RunDir, metas: list[dict[str, Any]]) -> str:
    """The track the run answers from after its newest stage (``FROZEN`` for a run with no stage).
    Every stage's ``switch.answers`` must be what its forward-transfer counts say, and each stage's
    run counts its own plus the stage's before; else IntegrityError (a crafted stage.json)."""
    answer, total = FROZEN, Transfer(0, 0, 0)
    for meta in metas:
        stage, record = meta.get("stage"), meta.get("switch")
        transfer = transfer_record(meta)
        if transfer is not None:
            total = total + Transfer.from_dict(transfer)
            if Transfer.from_dict(transfer["run"]) != total:
                raise _crafted(run, stage, "its forward-transfer counts do not add up to the run's")
        elif stage != 1:
            raise _crafted(run, stage, "it has no forward-transfer counts")
        answer = CARRIED if transfer is not None and transfer["transfers"] else FROZEN
        if not isinstance(record, dict) or record.get("answers") != answer:
            raise _crafted(run, stage, f"its switch record does not say the {answer} track answers, as its counts do")
        if not isinstance(record.get("frozen_stage_sha256"), str):
            raise _crafted(run, stage, "its switch record names no frozen-track record")
    return answer


def frozen_config(config: RunConfig) -> RunConfig:
    """The frozen track's config: ``drl --preset frozen`` with the run's seed, workers and "unknown" answer."""
    train = {"seed": config.train.seed, "num_workers": config.train.num_workers}
    return RunConfig.for_method("drl", {"train": train, "open_set": config.to_dict()["open_set"]}, preset="frozen")


def switched(run: RunDir, manifest: dict[str, Any]) -> bool:
    """Whether the run is a switched one (its method and config say so)."""
    config = read_record(run, manifest)[1]
    return method_of(config).switches(config)


def _frozen_default(own: RunConfig, config: RunConfig) -> bool:
    """Whether ``own`` is a frozen track's config for a run of ``config``: the method ``drl`` on the
    frozen PTM (a run that never has a frozen track of its own), the run's seed and "unknown" answer
    options. The rest is ``drl --preset frozen``'s as its release wrote it (a later release may change
    it)."""
    return (
        own.method == "drl"
        and own.first_session.peft == "none"
        and own.train.seed == config.train.seed
        and own.to_dict()["open_set"] == config.to_dict()["open_set"]
    )


def tied_track(
    run: RunDir,
    manifest: dict[str, Any],
    metas: list[dict[str, Any]],
    *,
    classes: bool = True,
    ahead: bool = False,
    wait: bool = True,
) -> tuple[RunDir, dict[str, Any], str]:
    """A switched run's frozen track, its manifest and the track the run answers from (``answering``,
    which checks the run's switch records), the frozen track checked against the run's records: the frozen
    default's config, each of the run's stages recorded there as the run's ``switch`` records say
    (sha256 of its stage.json), the same classes answered (unless not ``classes``). With ``ahead``
    (learn-stage, under the run's lock) it may hold one more stage. Else the track one stage ahead,
    or answering for other classes, is what another process between its two commits leaves for a
    moment: with ``wait`` (a reader, not holding the run's lock) this waits while a writer holds the
    lock (at most a minute) and raises ``ListedFileGone`` once the run has moved on
    (``RunDir.read_generation`` then reads the newer generation); else (a crash between the two
    commits) RunStateError or IntegrityError naming the command that completes it; any other
    mismatch: IntegrityError."""
    answer = answering(run, metas)
    track = frozen_track(run)
    if not track.exists():
        raise IntegrityError(
            f"switched run {run.path} has lost its frozen track ({track.path}); restore the run from a backup"
        )
    record, config = read_record(run, manifest)

    def read_track(held: dict[str, Any]) -> tuple[dict[str, Any], list[int], list[str]]:
        own_record, own = read_record(track, held)
        if not _frozen_default(own, config) or own_record["ptm"]["sha256"] != record["ptm"]["sha256"]:
            raise IntegrityError(
                f"{track.path} is not the frozen track of run {run.path} (another config or PTM); restore the run "
                "from a backup"
            )
        indices = track.stage_indices(held)
        if len(indices) < len(metas):
            raise IntegrityError(
                f"the frozen track of run {run.path} holds {len(indices)} stages, the run {len(metas)}; restore the run from a backup"
            )
        for meta in metas:
            entry = held["files"].get(stage_file(meta["stage"], STAGE_META))
            if entry is None or entry.get("sha256") != meta["switch"]["frozen_stage_sha256"]:
                raise IntegrityError(
                    f"stage {meta['stage']} of {track.path} is not the one run {run.path} recorded; restore the run from a backup"
                )
        track_metas = [track.stage_meta(i, held) for i in indices]
        for index, meta in zip(indices, track_metas):
            check_stage_meta(track, index, meta)
        return held, indices, _active(track, held, track_metas[: len(metas)]) if classes else []

    # the track commits first: a forget there supersedes (deletes) files a reader may be about to
    # read, so the track is read as one whole generation of its own (``RunDir.read_generation``)
    held, indices, theirs = track.read_generation(read_track)
    ours = _active(run, manifest, metas) if classes else []
    if len(indices) > len(metas) + 1:
        raise IntegrityError(
            f"the frozen track of run {run.path} holds {len(indices)} stages, the run {len(metas)}; restore the run from a backup"
        )
    if (len(indices) > len(metas) and not ahead) or theirs != ours:
        if wait:
            settled(run, manifest)
        if len(indices) > len(metas):
            raise RunStateError(
                f"the frozen track of run {run.path} holds a stage {len(metas) + 1} the run has not committed (a "
                "learn-stage was interrupted between its two commits): run that learn-stage again with the same data"
            )
        differ = sorted(set(ours) ^ set(theirs)) or ["their order"]
        raise IntegrityError(
            f"the frozen track of run {run.path} answers for other classes ({', '.join(differ[:5])}): a forget or "
            "restore was interrupted; run the same `drl forget` (or `drl forget --restore`) again"
        )
    return track, held, answer


def settled(run: RunDir, manifest: dict[str, Any], *, limit: float = 60.0) -> None:
    """For a reader that found the tracks apart: wait while another process holds the run's writer
    lock (it may be between its two commits), then ``ListedFileGone`` if the run's generation moved
    past ``manifest`` (``RunDir.read_generation`` reads again), else return."""
    deadline = time.monotonic() + limit
    while True:
        if run.manifest()["generation"] != manifest["generation"]:
            raise ListedFileGone(f"run {run.path} changed while it was read; run the command again")
        if not writer_active(run.path) or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _active(run: RunDir, manifest: dict[str, Any], metas: list[dict[str, Any]]) -> list[str]:
    forgotten = read_log(run, manifest, {meta["stage"]: meta for meta in metas})
    return [name for meta in metas for name in forgotten.active(meta)]


def on_frozen_track(state: ForgetState, name: str, purge: bool | None, apply: Callable[[Path], Any]) -> None:
    """``drl forget`` in a switched run, once the run's own checks passed: ``apply`` (the same forget,
    ``purge`` True or False, or restore, ``purge`` None) to its frozen track first, unless an
    interrupted call already did it there (the class is already out, purged, or back)."""
    if not state.indices or not switched(state.run, state.manifest):
        return
    metas = [state.metas[i] for i in state.indices]
    track, _, _ = tied_track(state.run, state.manifest, metas, classes=False, wait=False)
    held = ForgetState.read(track)
    if purge is None:
        needed = held.active_stage(name) is None
    else:
        kept = [f.kept for f in held.log.forgotten if f.name == name]
        needed = held.active_stage(name) is not None or (purge and bool(kept) and kept[-1])
    if needed:
        apply(track.path)


def _crafted(run: RunDir, stage: Any, why: str) -> IntegrityError:
    return IntegrityError(
        f"stage {stage} of switched run {run.path} is inconsistent ({why}); restore the run from a backup"
    )
