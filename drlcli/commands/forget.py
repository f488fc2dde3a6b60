"""Forgetting a class (``drl forget``): a learned class taken out of the run's answers, as a new
generation of the run committed like a stage, and put back by ``drl forget --restore``.

What a class holds in a run, and what forgetting takes out (``PER_CLASS``):

- its prototype row: ``prototypes`` (n, S, d) in its stage's weights file, and the row of every
  other tensor of that file with one row per class of the stage (``CLASS_ROWS``: its open-set
  thresholds, its mean and image count for the rmd rule, and with class covariances its mean and
  covariance);
- with the ridge head (``drl`` with ``score.head: ridge``, and its own method): its column of W (M, C) in
  the weights file of its stage and of every later stage. W = (G + λI)⁻¹ Q is column-wise
  independent, so W without column c is exactly the head fitted without c's targets (at the λ the
  stage chose). Also its
  columns of Q (``q_fit``, ``q_val``, (M, n)) in its stage's statistics file, so that a later
  learn-stage does not fit it again.

What stays, because it cannot be taken apart: the statistics' Gram matrices G (and image counts)
sum the second moments of the class's images with all other images of its stage, and so do the
pooled within-class covariance of the class-covariance head (its stage's ``cov_scatter`` and every
later stage's ``cov_shared``) and the rmd rule's within-class scatter (its stage's
``unknown_scatter``, with its images in ``unknown_scatter_counts``); a trained stage
network (drl's adapters, ease's) was trained on its images; stage.json keeps the stage's historical
class list, image counts and metrics. The forget log says which classes are out.

A rewritten stage file gets a new name (``stage_file(..., generation=)``) and the commit
supersedes the old one (deleted after the commit point). The slices taken out are kept in
``forgotten/rows-g<generation>.safetensors`` (listed, checksummed), unless ``purge``: then nothing
of them is kept, and the class cannot be restored.

The forget log (``forgotten/log-g<generation>.json``, rewritten by each forget and restore) is the
state, untrusted like every run file (checked against the stages on every read)::

    {"kind": "drl-forget-log",
     "forgotten": [{"class", "stage", "at", "reason", "generation", "last_stage", "kept"}],
     "events":    [{"action": "forget" | "purge" | "restore", "class", "stage", "at", "reason",
                    "generation", "kept"}]}

(``purge``: the kept slices of a class forgotten before were deleted; an event's ``kept``: whether
it left the class's slices in ``forgotten/`` for a restore.)

A class is active unless (its stage, its name) is in ``forgotten``. ``api.load_run`` builds the
model from active classes only, so eval, predict and every export made afterwards never output a
forgotten class. A later stage may learn a forgotten name again (new images).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import heads
from ..data import class_key, refuse_near_duplicates
from ..errors import DataError, RunStateError, UsageError
from ..progress import Progress
from ..run.directory import RunDir
from ..run.files import encode_json, encode_tensors
from ..run.forgotten import (
    TENSOR_FILES,
    ForgetLog,
    ForgetState,
    Forgotten,
    PerClass,
    kept_rows,
    rows_error,
    slice_key,
    solved_slice,
    specs_of,
    widened,
)
from ..run.layout import TOTALS, forget_log_file, forgotten_rows_file, stage_file
from ..run.track import adopt_track, on_frozen_track
from ..run.writer import RunWriter

MAX_REASON = 1000  # characters


# ------------------------------------------------------------------------- the stage files


def _slice(tensor: Tensor, axis: int, index: int) -> tuple[Tensor, Tensor, Tensor]:
    """(before, the slice at ``index`` kept as a size-1 axis, after) along ``axis``."""
    size = tensor.shape[axis]
    return (
        tensor.narrow(axis, 0, index),
        tensor.narrow(axis, index, 1),
        tensor.narrow(axis, index + 1, size - index - 1),
    )


@dataclass
class _Change:
    """The files one commit writes and supersedes."""

    files: dict[str, bytes] = field(default_factory=dict)
    supersede: list[str] = field(default_factory=list)
    totals: dict[str, Tensor] | None = None  # the newest stage's totals as rewritten

    def rewrite(self, state: ForgetState, index: int, file: str, tensors: dict[str, Tensor]) -> None:
        name = stage_file(index, file, generation=state.generation)
        self.files[name] = encode_tensors(tensors)
        self.supersede.append(state.file_name(index, file))
        if file == TOTALS and index == state.indices[-1]:
            self.totals = tensors


Edit = Callable[[int, PerClass, Tensor, int], Tensor]  # (stage, spec, tensor, slice index) -> new tensor


def _edit_stage_files(state: ForgetState, stage: int, row: int, column: int, edit: Edit, change: _Change) -> None:
    """Apply ``edit`` to the class's slice of every per-class tensor: its row in stage ``stage``'s
    files, its column of W in that stage's and every later one's."""
    for index in [k for k in state.indices if k >= stage]:
        for file in TENSOR_FILES:
            specs = specs_of(file, index, stage)
            tensors = state.tensors(index, file) if specs else {}  # a later stage's statistics: not read
            edited = {
                spec.name: edit(index, spec, tensors[spec.name], column if spec.seen else row)
                for spec in specs
                if spec.name in tensors
            }
            if edited:
                change.rewrite(state, index, file, {**tensors, **edited})


# ---------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ForgetResult:
    action: str  # "forget" | "purge" (kept slices of a forgotten class deleted) | "restore"
    class_name: str
    stage: int  # the stage that learned it
    at: str  # UTC
    reason: str | None
    kept: bool  # its slices are kept in forgotten/ for a restore (forget without --purge)
    generation: int  # the run's generation after the commit
    num_classes: int  # classes the run answers with now
    forgotten: list[str]  # every class out of the answers now
    files: list[str]  # run-relative files the commit wrote
    run_dir: str

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["class"] = out.pop("class_name")
        return out


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _check_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    if not reason.strip() or len(reason) > MAX_REASON or not reason.isprintable():
        raise UsageError(f"--reason must be one line of printable text, 1 to {MAX_REASON} characters")
    return reason


def _unknown(state: ForgetState, name: str) -> DataError:
    names = [n for k in state.indices for n in state.classes[k]]
    near = [n for n in names if class_key(n) == class_key(name)]
    hint = f"; did you mean {near[0]!r}?" if near else f"; its classes are listed by `drl info --run {state.run.path}`"
    return DataError(f"class {name!r} is not a class of run {state.run.path}{hint}")


def _say(progress: Callable[[Any], None] | None, phase: str, detail: str) -> None:
    if progress is not None:
        progress(Progress(phase, 0, 0, detail))


def _commit(writer: RunWriter, state: ForgetState, change: _Change, log: ForgetLog) -> None:
    old_log = state.run.forget_log_name(state.manifest)
    change.files[forget_log_file(state.generation)] = encode_json(log.to_json())
    supersede = [*change.supersede, *([old_log] if old_log else [])]
    writer.commit(change.files, manifest=state.manifest, supersede=tuple(supersede))


def _result(
    state: ForgetState, action: str, entry: Forgotten, log: ForgetLog, change: _Change, *, kept: bool
) -> ForgetResult:
    active = {k: log.active(state.metas[k]) for k in state.indices}
    return ForgetResult(
        action=action,
        class_name=entry.name,
        stage=entry.stage,
        at=entry.at,
        reason=entry.reason,
        kept=kept,
        generation=state.generation,
        num_classes=sum(map(len, active.values())),
        forgotten=sorted(log.names() - {n for names in active.values() for n in names}),
        files=sorted(change.files),
        run_dir=str(state.run.path),
    )


def _event(action: str, entry: Forgotten, at: str, reason: str | None, generation: int) -> dict[str, Any]:
    return {
        "action": action,
        "class": entry.name,
        "stage": entry.stage,
        "at": at,
        "reason": reason,
        "generation": generation,
        "kept": entry.kept and action == "forget",
    }


# ----------------------------------------------------------------------------- forget


def forget_class(
    run_dir: Path | str | RunDir,
    name: str,
    *,
    reason: str | None = None,
    purge: bool = False,
    progress: Callable[[Any], None] | None = None,
) -> ForgetResult:
    """Take class ``name`` out of the run's answers: a new generation without its prototype rows, its
    ridge-head columns and its columns of the ridge statistics (see the module docstring). Its slices
    are kept for ``restore_class`` unless ``purge``. A class already forgotten with its slices kept
    is purged by ``purge``."""
    reason = _check_reason(reason)
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    with run.writer() as writer:
        adopt_track(run, writer)  # a run written before format 4: its frozen track into its manifest
        _say(progress, "read", "the run's stage files")
        state = ForgetState.read(run)
        stage = state.active_stage(name)
        if stage is None:
            return _purge_kept(writer, state, name, reason) if purge else _refuse_forget(state, name)
        if sum(map(len, state.classes.values())) == 1:
            raise RunStateError(
                f"class {name!r} is the only class run {run.path} still answers with; a run keeps at least one: "
                "learn another stage first (or delete the run)"
            )
        at = _now()
        entry = Forgotten(name, stage, at, reason, state.generation, state.indices[-1], not purge)
        removed: dict[str, Tensor] = {}

        def take_out(index: int, spec: PerClass, tensor: Tensor, position: int) -> Tensor:
            before, piece, after = _slice(tensor, spec.axis, position)
            removed[slice_key(index, spec)] = piece.clone()
            return torch.cat([before, after], dim=spec.axis)

        change = _Change()
        row, column = state.where(stage, name, state.classes[stage])
        _edit_stage_files(state, stage, row, column, take_out, change)
        if not purge:
            change.files[forgotten_rows_file(state.generation)] = encode_tensors(removed)
        log = ForgetLog(
            (*state.log.forgotten, entry),
            (*state.log.events, _event("forget", entry, at, reason, state.generation)),
        )
        on_frozen_track(state, writer, name, purge, lambda track: forget_class(track, name, reason=reason, purge=purge))
        _commit(writer, state, change, log)
    return _result(state, "forget", entry, log, change, kept=not purge)


def _latest(state: ForgetState, name: str) -> Forgotten | None:
    entries = [f for f in state.log.forgotten if f.name == name]
    return max(entries, key=lambda f: f.generation) if entries else None


def _refuse_forget(state: ForgetState, name: str) -> ForgetResult:
    entry = _latest(state, name)
    if entry is None:
        raise _unknown(state, name)
    how = "with its slices kept" if entry.kept else "and purged"
    raise RunStateError(
        f"class {name!r} was already forgotten {how} (stage {entry.stage}, {entry.at}); nothing to do"
        + (f": bring it back with `drl forget --restore {name}`" if entry.kept else "")
    )


def _purge_kept(writer: RunWriter, state: ForgetState, name: str, reason: str | None) -> ForgetResult:
    """Delete the kept slices of a class forgotten without ``--purge``."""
    entry = _latest(state, name)
    if entry is None or not entry.kept:
        return _refuse_forget(state, name)
    at = _now()
    purged = replace(entry, kept=False)
    log = ForgetLog(
        tuple(purged if f == entry else f for f in state.log.forgotten),
        (*state.log.events, _event("purge", entry, at, reason, state.generation)),
    )
    change = _Change(supersede=[forgotten_rows_file(entry.generation)])
    on_frozen_track(state, writer, name, True, lambda track: forget_class(track, name, reason=reason, purge=True))
    _commit(writer, state, change, log)
    return replace(_result(state, "purge", purged, log, change, kept=False), at=at, reason=reason)


# ---------------------------------------------------------------------------- restore


def restore_class(
    run_dir: Path | str | RunDir, name: str, *, reason: str | None = None, progress: Callable[[Any], None] | None = None
) -> ForgetResult:
    """Put a forgotten class back from its kept slices: the run answers as if it had never been
    forgotten. Columns of W for stages learned after the forget are solved again from the stored
    statistics at each stage's λ. A purged class cannot be restored (learn it again instead)."""
    reason = _check_reason(reason)
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    with run.writer() as writer:
        adopt_track(run, writer)  # a run written before format 4: its frozen track into its manifest
        _say(progress, "read", "the run's stage files")
        state = ForgetState.read(run)
        entry = _restorable(state, name)
        rows = kept_rows(state, entry)
        classes = [n for n in state.metas[entry.stage]["classes"] if n in state.classes[entry.stage] or n == name]
        row, column = state.where(entry.stage, name, classes)

        def put_back(index: int, spec: PerClass, tensor: Tensor, position: int) -> Tensor:
            piece = rows.get(slice_key(index, spec))
            if piece is None and spec.carried and index > entry.last_stage:  # no stage since moved it (_restorable)
                piece = rows.get(key := slice_key(entry.last_stage, spec))
                if piece is None:
                    raise rows_error(state, entry, f"{key} is missing")
                piece = widened(piece, tensor, spec.axis)
            if piece is None:
                piece = solved_slice(state, index, entry, rows, spec)
            return torch.cat(
                [
                    tensor.narrow(spec.axis, 0, position),
                    piece.to(tensor.dtype),
                    tensor.narrow(spec.axis, position, tensor.shape[spec.axis] - position),
                ],
                dim=spec.axis,
            )

        change = _Change(supersede=[forgotten_rows_file(entry.generation)])
        _edit_stage_files(state, entry.stage, row, column, put_back, change)
        for head in heads.HEADS.values():  # the carried classes as the next learn-stage will read them
            try:
                head.load().check_carried(change.totals or {})
            except ValueError as exc:
                raise rows_error(state, entry, f"the classes it gives back do not fit: {exc}") from exc
        at = _now()
        log = ForgetLog(
            tuple(f for f in state.log.forgotten if f != entry),
            (*state.log.events, _event("restore", entry, at, reason, state.generation)),
        )
        on_frozen_track(state, writer, name, None, lambda track: restore_class(track, name, reason=reason))
        _commit(writer, state, change, log)
    return replace(_result(state, "restore", entry, log, change, kept=False), at=at, reason=reason)


def _restorable(state: ForgetState, name: str) -> Forgotten:
    """The entry ``restore`` brings back: the latest forget of ``name`` whose slices were kept."""
    entries = _forgets_of(state, name)
    kept = [f for f in entries if f.kept]
    if not kept:
        raise RunStateError(
            f"class {name!r} was forgotten with --purge ({entries[-1].at}): nothing of it was kept, so it cannot be "
            "restored; learn it again from new images with `drl learn-stage`"
        )
    entry = max(kept, key=lambda f: f.generation)
    moved = [k for k in state.indices if k > entry.last_stage and _moved(state.metas[k])]
    if moved:  # a carried run (schedule.stages all): its kept Gaussian was not moved with the others
        raise RunStateError(
            f"class {name!r} was forgotten before stage {moved[0]}, which trained this run's carried network and "
            "moved its classes while the kept rows stayed as they were; learn it again with `drl learn-stage`"
        )
    learned = {n: k for k in state.indices for n in state.classes[k]}
    refuse_near_duplicates([name], learned, what=f"forgotten class {name!r}")
    return entry


def _forgets_of(state: ForgetState, name: str) -> list[Forgotten]:
    """Every forget of ``name`` in the log; an error when it has none or the run learned it again."""
    entries = [f for f in state.log.forgotten if f.name == name]
    active = state.active_stage(name)
    if not entries:
        if active is not None:
            raise RunStateError(f"class {name!r} is not forgotten (stage {active} learned it); nothing to restore")
        raise _unknown(state, name)
    if active is not None:
        raise RunStateError(
            f"class {name!r} was learned again in stage {active}; a run holds one class per name: forget that "
            f"one first (`drl forget --class {name}`), then restore"
        )
    return entries


def _moved(meta: dict[str, Any]) -> bool:
    """Whether a stage moved a carried run's classes: it trained the network (a paused stage of a
    switched run did not: its record says so, with no move and no draws)."""
    carry = meta.get("carry")
    if not isinstance(carry, dict):
        return False
    return not (carry.get("paused") is True and carry.get("move") == 0 and carry.get("draws") == 0)
