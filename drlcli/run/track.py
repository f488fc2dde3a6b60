"""A switched run's two tracks (``Method.switches``; issue 32): the carried run itself, and
its frozen track, the frozen default's own run directory (``frozen/``, a ``drl`` run learning the
same stages). After each stage the run answers from one of them: from the carried network once
the run's forward transfer (stage.json ``carry.transfer``, ``metrics.Transfer``) says adapting tells
new classes apart better than the frozen PTM, and from the frozen track until then (stage 1 has no
transfer to measure). Both tracks learn every stage; the frozen one commits first, so that it holds
the parent's stages or, after an interrupted learn-stage, one more."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import IntegrityError
from ..methods import method_of
from ..metrics import Transfer
from .access import real_dir
from .directory import RunDir
from .forgotten import ForgetState
from .layout import FROZEN_TRACK
from .records import read_record, transfer_record

CARRIED, FROZEN = "carried", "frozen"
TRACKS = (CARRIED, FROZEN)


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
        elif stage != 1 and isinstance(meta.get("carry"), dict):
            raise _crafted(run, stage, "it has no forward-transfer counts")
        answer = CARRIED if transfer is not None and transfer["transfers"] else FROZEN
        if not isinstance(record, dict) or record.get("answers") != answer:
            raise _crafted(run, stage, f"its switch record does not say the {answer} track answers, as its counts do")
    return answer


def check_tracks(run: RunDir, classes: list[str], frozen_classes: list[str], ptm: str, frozen_ptm: str) -> None:
    """The frozen track answers for the same classes, in the same order, on the same PTM; else
    IntegrityError (an interrupted forget, or a crafted track)."""
    if frozen_ptm != ptm:
        raise IntegrityError(
            f"{run.path / FROZEN_TRACK} was made for other PTM weights than run {run.path}; restore the run "
            "from a backup"
        )
    if frozen_classes != classes:
        differ = sorted(set(classes) ^ set(frozen_classes)) or ["their order"]
        raise IntegrityError(
            f"the frozen track of run {run.path} answers for other classes ({', '.join(differ[:5])}): a forget "
            "or restore was interrupted; run the same `drl forget` again, or restore the run from a backup"
        )


def on_frozen_track(state: ForgetState, name: str, purge: bool | None, apply: Callable[[Path], Any]) -> None:
    """``drl forget`` in a switched run, once the run's own checks passed: ``apply`` (the same forget,
    ``purge`` True or False, or restore, ``purge`` None) to its frozen track first, unless an
    interrupted call already did it there (the class is already out, purged, or back)."""
    config = read_record(state.run, state.manifest)[1]
    if not method_of(config).switches(config) or not state.indices:
        return
    track = frozen_track(state.run)
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
