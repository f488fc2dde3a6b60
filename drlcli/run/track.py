"""A switched run's two tracks (``Schedule.switches``): the carried run itself, and its frozen track,
the frozen default learning the same stages (the files of a ``drl init --recipe frozen`` run, kept
inside the run: ``trackdir.py``). After each stage the run answers from one of them: from the
carried network once the run's forward transfer (stage.json ``carry.transfer``,
``metrics.Transfer``) says adapting tells new classes apart better than the frozen PTM, and from the
frozen track until then (stage 1 has no transfer to measure).

A stage, a forget or a restore of both tracks is one commit of the run, so no fault leaves the two
apart; each stage's ``switch`` record also holds the sha256 of the track's record of the stage, and
``tied_track`` checks the track against the run's records before anything reads it. A run written
before format 4 kept the track as a run directory of its own (its own manifest, committed just
before the run's); it is read as it is, and the first command that writes to the run lists the
track's files in the run's manifest (``adopt_track``, format 4)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .. import storage
from ..config import RunConfig
from ..errors import IntegrityError, RunStateError
from ..methods import schedule_of
from ..metrics import Transfer
from ..schedule import ScheduleConfig
from .directory import RunDir
from .forgotten import ForgetState, read_log
from .layout import FROZEN_TRACK, LOCK, MANIFEST, STAGE_META, TRACK_PREFIX, stage_file
from .records import check_stage_meta, checked_metas, read_record, transfer_record, trial_record
from .trackdir import FLAT, NESTED, TrackDir, frozen_track, track_format
from .writer import RunWriter

CARRIED, FROZEN = "carried", "frozen"


def adopt_track(run: RunDir, writer: RunWriter) -> None:
    """Before a command writes to a switched run (under its lock): a track kept as a run directory of
    its own (a run written before format 4) is listed in the run's manifest, its files in place, once
    they are checked to be the run's (a stage ahead included: the next learn-stage of its data reuses
    it), in one commit; the run is then format 4 and answers as before. A track's own commands (a
    forget inside its run's) and runs of format 4 or 5 change nothing here."""
    if isinstance(run, TrackDir):
        return
    manifest = run.manifest()
    kept = track_format(run, manifest)
    if kept == FLAT:
        return
    if kept == NESTED or not switched(run, manifest):
        _drop_legacy_files(run)
        return
    metas = checked_metas(run, manifest)
    # one stage ahead: an interrupted call, whose next call (same data) reuses the stage
    track, held, _ = tied_track(run, manifest, metas, classes=False, ahead=True)
    for name in held["files"]:
        track.read_bytes(name, held)  # its checksum, before the run's manifest covers it
    writer.commit({}, manifest=manifest, adopt={TRACK_PREFIX + n: e for n, e in held["files"].items()})
    _drop_legacy_files(run)


def _drop_legacy_files(run: RunDir) -> None:
    """The manifest and lock a track kept before format 4, once the run's manifest lists the track."""
    for name in (MANIFEST, LOCK):
        path = run.path / FROZEN_TRACK / name
        if os.path.lexists(path) and not os.path.islink(path):
            storage.discard(path)


def answering(run: RunDir, metas: list[dict[str, Any]], options: ScheduleConfig) -> str:
    """The track the run answers from after its newest stage (``FROZEN`` for a run with no stage).
    Every stage's ``switch.answers`` must be what its records say (``answer_after``, ``trial_speaks``
    under the run's ``options``), and each stage's run counts its own plus the stage's before; else
    IntegrityError (a crafted stage.json)."""
    answer, total, widened = FROZEN, Transfer(0, 0, 0), False
    for meta in metas:
        stage, record = meta.get("stage"), meta.get("switch")
        transfer = transfer_record(meta)
        if transfer is not None:
            total = total + Transfer.from_dict(transfer)
            if Transfer.from_dict(transfer["run"]) != total:
                raise _crafted(run, stage, "its forward-transfer counts do not add up to the run's")
        elif stage != 1:
            raise _crafted(run, stage, "it has no forward-transfer counts")
        answer = answer_after(total, trial_speaks(options, widened, meta))
        widened = widened or widened_at(meta)  # read from the next stage on
        if not isinstance(record, dict) or record.get("answers") != answer:
            raise _crafted(run, stage, f"its switch record does not say the {answer} track answers, as its records do")
        if not isinstance(record.get("frozen_stage_sha256"), str):
            raise _crafted(run, stage, "its switch record names no frozen-track record")
    return answer


def answer_after(total: Transfer, widened: bool) -> str:
    """The track a switched run answers from after a stage: the carried network once the run's forward
    transfer ``total`` says adapting pays; with ``widened`` (an earlier stage's trial widened the margins
    of classes the set never trained on, ``widened_before``; ``schedule.trial_answers``), also while
    ``total`` does not say adapting loses (``Transfer.loses``). The counts of a few hundred images miss
    gaps of points that the trial's margins see: the trial's verdict stands until they say otherwise."""
    if total.transfers or (widened and not total.loses):
        return CARRIED
    return FROZEN


def widened_before(metas: list[dict[str, Any]]) -> bool:
    """Whether a stage of ``metas`` trained the set after its trial widened the margins (``widened_at``)."""
    return any(map(widened_at, metas))


def widened_at(meta: dict[str, Any]) -> bool:
    """Whether the stage trained the set after its trial widened the margins of the classes it did not
    train on (``stage/trial.py``: by at least the floor, more than chance). That stage itself answers by
    its counts: its own classes trained the set, which the trial's margins do not measure."""
    trial, carry = trial_record(meta), meta.get("carry")
    trained = isinstance(carry, dict) and carry.get("paused") is not True
    return trial is not None and trial["trains"] and trial["margins"]["percent"] > 0 and trained


def trial_speaks(options: ScheduleConfig, widened: bool, meta: dict[str, Any]) -> bool:
    """Whether a trial's verdict answers for the stage of ``meta`` (a checked stage.json, or the one
    being written), under ``schedule.trial_answers``: an earlier stage's trial ``widened`` the margins
    (``widened_before``), or the stage's own did and it holds at most ``trial_answers_small_stage``
    images a class on average. On a drop of few images a class the trained set was above the frozen
    head at stage 1 on most class orders; on one of many, below it (docs/performance.md)."""
    if not options.trial_answers:
        return False
    counts, most = meta.get("images_per_class") or {}, options.trial_answers_small_stage
    small = most > 0 and bool(counts) and sum(counts.values()) <= most * len(counts)
    return widened or (small and widened_at(meta))


def switched(run: RunDir, manifest: dict[str, Any]) -> bool:
    """Whether the run is a switched one (its method and config say so)."""
    config = read_record(run, manifest)[1]
    return schedule_of(config).switches


def _frozen_default(own: RunConfig, config: RunConfig) -> bool:
    """Whether ``own`` is a frozen track's config for a run of ``config``: the method ``drl`` on the
    frozen PTM (a run that never has a frozen track of its own), the run's seed and "unknown" answer
    options. The rest is ``drl init --recipe frozen``'s as its release wrote it (a later release may change
    it)."""
    return (
        own.method == "drl"
        and own.adapter.peft == "none"
        and own.train.seed == config.train.seed
        and own.to_dict()["open_set"] == config.to_dict()["open_set"]
    )


def tied_track(
    run: RunDir, manifest: dict[str, Any], metas: list[dict[str, Any]], *, classes: bool = True, ahead: bool = False
) -> tuple[RunDir, dict[str, Any], str]:
    """A switched run's frozen track, its manifest and the track the run answers from (``answering``,
    which checks the run's switch records), the frozen track checked against the run's records: the
    frozen default's config, each of the run's stages recorded there as the run's ``switch`` records
    say (sha256 of its stage.json), the same classes answered (unless not ``classes``). With ``ahead``
    (adopting a track kept before format 4, whose commit came first) it may hold one more stage. A
    track kept before format 4 one stage ahead, or answering for other classes, is what a command of
    an earlier release interrupted between its two commits left: RunStateError or IntegrityError
    naming the command that completes it; any other mismatch: IntegrityError."""
    record, config = read_record(run, manifest)
    answer = answering(run, metas, config.schedule)
    track = frozen_track(run, manifest)
    if not track.exists():
        raise IntegrityError(
            f"switched run {run.path} has lost its frozen track ({track.path}); restore the run from a backup"
        )

    def read_track(held: dict[str, Any]) -> tuple[dict[str, Any], list[int], list[str]]:
        own_record, own = read_record(track, held)
        if not _frozen_default(own, config) or own_record["ptm"]["sha256"] != record["ptm"]["sha256"]:
            raise IntegrityError(
                f"the frozen track of run {run.path} is not the run's (another config or PTM); restore the run "
                "from a backup"
            )
        indices = track.stage_indices(held)
        if len(indices) < len(metas) or indices[: len(metas)] != [meta["stage"] for meta in metas]:
            raise IntegrityError(
                f"the frozen track of run {run.path} holds {len(indices)} stages, the run {len(metas)}; restore the run from a backup"
            )
        for meta in metas:
            entry = held["files"].get(stage_file(meta["stage"], STAGE_META))
            if entry is None or entry.get("sha256") != meta["switch"]["frozen_stage_sha256"]:
                raise IntegrityError(
                    f"stage {meta['stage']} of the frozen track of run {run.path} is not the one run {run.path} "
                    "recorded; restore the run from a backup"
                )
        track_metas = [track.stage_meta(i, held) for i in indices]
        for index, meta in zip(indices, track_metas):
            check_stage_meta(track, index, meta)
        return held, indices, _active(track, held, track_metas[: len(metas)]) if classes else []

    # a forget supersedes (deletes) files a reader may be about to read: the track is read as one
    # whole generation (``RunDir.read_generation``; a TrackDir's is its run's, which then reads again)
    held, indices, theirs = track.read_generation(read_track)
    ours = _active(run, manifest, metas) if classes else []
    if len(indices) > len(metas) + (1 if ahead else 0):
        if len(indices) == len(metas) + 1:
            raise RunStateError(
                f"the frozen track of run {run.path} holds a stage {len(metas) + 1} the run has not committed (a "
                "learn-stage of an earlier drl release was interrupted between its two commits): run that "
                "learn-stage again with the same data"
            )
        raise IntegrityError(
            f"the frozen track of run {run.path} holds {len(indices)} stages, the run {len(metas)}; restore the run from a backup"
        )
    if theirs != ours:
        differ = sorted(set(ours) ^ set(theirs)) or ["their order"]
        raise IntegrityError(
            f"the frozen track of run {run.path} answers for other classes ({', '.join(differ[:5])}): a forget or "
            "restore was interrupted; run the same `drl forget` (or `drl forget --restore`) again"
        )
    return track, held, answer


def _active(run: RunDir, manifest: dict[str, Any], metas: list[dict[str, Any]]) -> list[str]:
    forgotten = read_log(run, manifest, {meta["stage"]: meta for meta in metas})
    return [name for meta in metas for name in forgotten.active(meta)]


def on_frozen_track(
    state: ForgetState, writer: RunWriter, name: str, purge: bool | None, apply: Callable[[RunDir], Any]
) -> None:
    """``drl forget`` in a switched run, once the run's own checks passed: ``apply`` (the same forget,
    ``purge`` True or False, or restore, ``purge`` None) to its frozen track, written through the
    run's ``writer`` (published by the run's commit), unless the track already has it (the class
    already out, purged, or back: a track adopted from a run written before format 4)."""
    if not state.indices or not switched(state.run, state.manifest):
        return
    metas = [state.metas[i] for i in state.indices]
    tied_track(state.run, state.manifest, metas, classes=False)
    track = frozen_track(state.run, state.manifest, writer=writer)
    held = ForgetState.read(track)
    if purge is None:
        needed = held.active_stage(name) is None
    else:
        kept = [f.kept for f in held.log.forgotten if f.name == name]
        needed = held.active_stage(name) is not None or (purge and bool(kept) and kept[-1])
    if needed:
        apply(track)


def _crafted(run: RunDir, stage: Any, why: str) -> IntegrityError:
    return IntegrityError(
        f"stage {stage} of switched run {run.path} is inconsistent ({why}); restore the run from a backup"
    )
