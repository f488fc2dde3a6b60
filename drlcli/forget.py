"""Forgetting a class (``drl forget``): a learned class taken out of the run's answers, as a new
generation of the run committed like a stage, and put back by ``drl forget --restore``.

What a class holds in a run, and what forgetting takes out (``PER_CLASS``):

- its prototype row: ``prototypes`` (n, S, d) in its stage's weights file, and the row of every
  other tensor of that file with one row per class of the stage (``CLASS_ROWS``: its open-set
  thresholds, its mean and image count for the rmd rule, and with class covariances its mean and
  covariance);
- with the ridge head (``ranpac``; ``drl`` with ``score.head: ridge``): its column of W (M, C) in
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

A rewritten stage file gets a new name (``rundir.stage_file(..., generation=)``) and the commit
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

from . import rundir
from .data import ImageSet, class_key
from .errors import DataError, IntegrityError, RunStateError, UsageError
from .methods.ranpac import TENSOR_PREFIX as RIDGE_PREFIX
from .openset import BIAS, RMD_ROWS
from .rundir import STAGE_WEIGHTS, STATISTICS, RunDir, StageRecord

LOG_KIND = "drl-forget-log"
MAX_REASON = 1000  # characters
# tensors of a stage's weights file with one row per class of the stage (first dim: its class count)
CLASS_ROWS = ("prototypes", BIAS, *RMD_ROWS, f"{RIDGE_PREFIX}cov_mean", f"{RIDGE_PREFIX}cov_covariance")


@dataclass(frozen=True)
class PerClass:
    """A tensor holding one slice per class along ``axis``: per class of its stage, or (``seen``)
    per class seen up to its stage, in class order."""

    file: str  # rundir.STAGE_WEIGHTS or rundir.STATISTICS
    name: str
    axis: int
    seen: bool = False


RIDGE_WEIGHT = f"{RIDGE_PREFIX}weight"
PER_CLASS = (
    *(PerClass(STAGE_WEIGHTS, name, 0) for name in CLASS_ROWS),
    PerClass(STAGE_WEIGHTS, RIDGE_WEIGHT, 1, seen=True),  # W (M, C), solved again by each stage
    PerClass(STATISTICS, "q_fit", 1),  # Q (M, n) of the stage's own classes (ranpac.Statistics)
    PerClass(STATISTICS, "q_val", 1),
)


# ----------------------------------------------------------------------------- the log


@dataclass(frozen=True)
class Forgotten:
    """A class out of the answers: (stage, name) and how it went."""

    name: str
    stage: int
    at: str  # UTC, ISO 8601
    reason: str | None
    generation: int  # the commit that forgot it: its kept slices are rundir.forgotten_rows_file(generation)
    last_stage: int  # the newest stage then: W of later stages lacks the class's column from the start
    kept: bool  # False: purged, nothing kept

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["class"] = out.pop("name")
        return out


_ENTRY_TYPES = {"class": str, "stage": int, "at": str, "generation": int, "last_stage": int, "kept": bool}
_EVENT_TYPES = {"action": str, "class": str, "stage": int, "at": str, "generation": int, "kept": bool}
ACTIONS = ("forget", "purge", "restore")


@dataclass(frozen=True)
class ForgetLog:
    """The run's forgotten classes and the history of every forget, purge and restore."""

    forgotten: tuple[Forgotten, ...] = ()
    events: tuple[dict[str, Any], ...] = ()

    def names(self) -> set[str]:
        return {f.name for f in self.forgotten}

    def active(self, meta: dict[str, Any]) -> list[str]:
        """Stage ``meta``'s classes that are not forgotten, in the stage's order."""
        out = {(f.stage, f.name) for f in self.forgotten}
        return [name for name in meta["classes"] if (meta["stage"], name) not in out]

    def of_stage(self, index: int) -> list[str]:
        return [f.name for f in self.forgotten if f.stage == index]

    def to_json(self) -> dict[str, Any]:
        return {"kind": LOG_KIND, "forgotten": [f.to_dict() for f in self.forgotten], "events": list(self.events)}


def _typed(value: Any, types: dict[str, type]) -> str | None:
    """What is wrong with one log entry (None: nothing); bools are not ints, reason is text or null."""
    if not isinstance(value, dict):
        return f"an entry is a {type(value).__name__}"
    for key, kind in types.items():
        item = value.get(key)
        if not isinstance(item, kind) or (kind is int and isinstance(item, bool)):
            return f"{key} is not a {kind.__name__}"
    reason = value.get("reason")
    if reason is not None and not isinstance(reason, str):
        return "reason is not text"
    return None


def _parse(data: dict[str, Any]) -> ForgetLog:
    if data.get("kind") != LOG_KIND:
        raise ValueError(f"kind is not {LOG_KIND!r}")
    entries, events = data.get("forgotten"), data.get("events")
    if not isinstance(entries, list) or not isinstance(events, list):
        raise ValueError("forgotten or events is not a list")
    for item, types in [*((e, _ENTRY_TYPES) for e in entries), *((e, _EVENT_TYPES) for e in events)]:
        problem = _typed(item, types)
        if problem:
            raise ValueError(problem)
    if any(e["action"] not in ACTIONS for e in events):
        raise ValueError(f"an event's action is not one of {ACTIONS}")
    forgotten = tuple(
        Forgotten(e["class"], e["stage"], e["at"], e.get("reason"), e["generation"], e["last_stage"], e["kept"])
        for e in entries
    )
    return ForgetLog(forgotten, tuple(events))


def _log_problem(log: ForgetLog, manifest: dict[str, Any], metas: dict[int, dict[str, Any]]) -> str | None:
    """What in a well-typed log does not fit the run's stages (None: nothing)."""
    pairs = [(f.stage, f.name) for f in log.forgotten]
    if len(set(pairs)) != len(pairs):
        return "a class is forgotten twice"
    newest = max(metas, default=0)
    for f in log.forgotten:
        if f.stage not in metas or f.name not in metas[f.stage]["classes"]:
            return f"class {f.name!r} is not a class of stage {f.stage}"
        if not f.stage <= f.last_stage <= newest or not 0 < f.generation <= manifest["generation"]:
            return f"class {f.name!r} has a stage or generation out of range"
        if f.kept and rundir.forgotten_rows_file(f.generation) not in manifest["files"]:
            return f"the kept rows of class {f.name!r} are not listed"
    active = [name for index in sorted(metas) for name in log.active(metas[index])]
    if len(set(active)) != len(active):
        return "a class name is active in two stages"
    return None


def read_log(run: RunDir, manifest: dict[str, Any], metas: dict[int, dict[str, Any]]) -> ForgetLog:
    """The run's forget log (empty when no class was ever forgotten), checked against the stages'
    metadata ``metas`` (stage index -> stage.json, already checked); IntegrityError if it does not fit."""
    data = run.forget_log(manifest)
    if data is None:
        return ForgetLog()
    name = run.forget_log_name(manifest)
    try:
        log = _parse(data)
    except (ValueError, TypeError, KeyError) as exc:
        raise IntegrityError(f"{run.path / name} is malformed ({exc}); restore it from a backup") from exc
    problem = _log_problem(log, manifest, metas)
    if problem:
        raise IntegrityError(f"{run.path / name} does not fit the run ({problem}); restore it from a backup")
    return log


def _class_count(spec: PerClass, index: int, classes: dict[int, list[str]]) -> int:
    """How many slices ``spec`` has in stage ``index``'s file: its active classes, or (seen) all up to it."""
    if spec.seen:
        return sum(len(names) for k, names in classes.items() if k <= index)
    return len(classes[index])


def check_tensors(
    run: RunDir, index: int, file: str, tensors: dict[str, Tensor], classes: dict[int, list[str]]
) -> None:
    """Every per-class tensor of stage ``index``'s ``file`` has one slice per active class
    (``classes``: stage -> active names); IntegrityError naming the stage otherwise."""
    for spec in PER_CLASS:
        tensor = tensors.get(spec.name)
        if spec.file != file or tensor is None:
            continue
        expected = _class_count(spec, index, classes)
        if tensor.dim() <= spec.axis or tensor.shape[spec.axis] != expected:
            raise IntegrityError(
                f"stage {index} of run {run.path} does not fit its classes ({spec.name} has shape "
                f"{tuple(tensor.shape)}, expected {expected} along axis {spec.axis}); restore it from a backup"
            )


def active_classes(
    run: RunDir, manifest: dict[str, Any], stages: list[StageRecord]
) -> tuple[ForgetLog, list[list[str]]]:
    """The forget log and each stage's active classes, every per-class tensor of the stages' weights
    checked against them (``api.load_run``: a forgotten class is never scored)."""
    log = read_log(run, manifest, {s.index: s.meta for s in stages})
    classes = {s.index: log.active(s.meta) for s in stages}
    for stage in stages:
        check_tensors(run, stage.index, STAGE_WEIGHTS, stage.tensors, classes)
    return log, [classes[s.index] for s in stages]


def without_forgotten(images: ImageSet, log: ForgetLog, active: list[str]) -> ImageSet | None:
    """A registered eval set without the images of forgotten classes (None: nothing left)."""
    gone = log.names() - set(active)
    return images.without_classes(gone) if gone & set(images.class_names) else images


def check(run: RunDir, manifest: dict[str, Any]) -> int:
    """``drl verify``: the forget log fits the stages, every stage file fits the active classes and
    every kept rows file parses. Returns the number of forgotten classes."""
    stages = run.stages(manifest)
    from .api import check_stage_meta

    for stage in stages:
        check_stage_meta(run, stage.index, stage.meta)
    log, _ = active_classes(run, manifest, stages)
    state = _State(run, manifest, stages, log)
    for index in state.indices:  # one at a time: a long ridge run's statistics do not fit in memory together
        check_tensors(run, index, STATISTICS, run.stage_statistics(index, manifest), state.classes)
    for entry in log.forgotten:
        if entry.kept:
            _rows(state, entry)
    return len(log.forgotten)


# ------------------------------------------------------------------------- the run read once


class _State:
    """One forget or restore's view of the run (under its lock): stages, active classes, files."""

    def __init__(self, run: RunDir, manifest: dict[str, Any], stages: list[StageRecord], log: ForgetLog):
        self.run, self.manifest, self.log = run, manifest, log
        self.indices = [s.index for s in stages]
        self.metas = {s.index: s.meta for s in stages}
        self.classes = {s.index: log.active(s.meta) for s in stages}
        self._files: dict[tuple[int, str], dict[str, Tensor]] = {(s.index, STAGE_WEIGHTS): s.tensors for s in stages}

    @classmethod
    def read(cls, run: RunDir) -> _State:
        from .api import check_stage_meta, read_record

        manifest = run.manifest()
        read_record(run, manifest)  # a run.yaml that is not a run's config is refused here too
        stages = run.stages(manifest)
        for stage in stages:
            check_stage_meta(run, stage.index, stage.meta)
        log, _ = active_classes(run, manifest, stages)
        return cls(run, manifest, stages, log)

    def tensors(self, index: int, file: str) -> dict[str, Tensor]:
        """Stage ``index``'s weights or statistics (empty: none), checked against the active classes."""
        key = (index, file)
        if key not in self._files:  # the weights were read with the stages: statistics, read when needed
            tensors = self.run.stage_statistics(index, self.manifest)
            check_tensors(self.run, index, file, tensors, self.classes)
            self._files[key] = tensors
        return self._files[key]

    def file_name(self, index: int, file: str) -> str | None:
        return self.run.stage_file_name(index, file, self.manifest)

    def where(self, index: int, name: str, classes: list[str]) -> tuple[int, int]:
        """(row among stage ``index``'s ``classes``, column among every class seen up to it)."""
        row = classes.index(name)
        return row, sum(len(self.classes[k]) for k in self.indices if k < index) + row

    @property
    def generation(self) -> int:
        """The generation the commit will have."""
        return self.manifest["generation"] + 1

    def active_stage(self, name: str) -> int | None:
        return next((k for k in self.indices if name in self.classes[k]), None)


def _key(index: int, spec: PerClass) -> str:
    """A slice's name in a rows file: ``<stage>/<file>/<tensor>``."""
    return f"{index}/{spec.file}/{spec.name}"


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

    def rewrite(self, state: _State, index: int, file: str, tensors: dict[str, Tensor]) -> None:
        name = rundir.stage_file(index, file, generation=state.generation)
        self.files[name] = rundir.encode_tensors(tensors)
        self.supersede.append(state.file_name(index, file))


Edit = Callable[[int, PerClass, Tensor, int], Tensor]  # (stage, spec, tensor, slice index) -> new tensor


def _edit_stage_files(state: _State, stage: int, row: int, column: int, edit: Edit, change: _Change) -> None:
    """Apply ``edit`` to the class's slice of every per-class tensor: its row in stage ``stage``'s
    files, its column of W in that stage's and every later one's."""
    for index in [k for k in state.indices if k >= stage]:
        for file in (STAGE_WEIGHTS, STATISTICS):
            specs = _specs(file, index, stage)
            tensors = state.tensors(index, file) if specs else {}  # a later stage's statistics: not read
            edited = {
                spec.name: edit(index, spec, tensors[spec.name], column if spec.seen else row)
                for spec in specs
                if spec.name in tensors
            }
            if edited:
                change.rewrite(state, index, file, {**tensors, **edited})


def _specs(file: str, index: int, stage: int) -> list[PerClass]:
    """The per-class tensors of stage ``index``'s ``file`` that hold a slice of a class of ``stage``."""
    return [spec for spec in PER_CLASS if spec.file == file and (spec.seen or index == stage)]


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


def _unknown(state: _State, name: str) -> DataError:
    names = [n for k in state.indices for n in state.classes[k]]
    near = [n for n in names if class_key(n) == class_key(name)]
    hint = f"; did you mean {near[0]!r}?" if near else f"; its classes are listed by `drl info --run {state.run.path}`"
    return DataError(f"class {name!r} is not a class of run {state.run.path}{hint}")


def _say(progress: Callable[[Any], None] | None, phase: str, detail: str) -> None:
    if progress is not None:
        from .api import Progress

        progress(Progress(phase, 0, 0, detail))


def _commit(writer: rundir.RunWriter, state: _State, change: _Change, log: ForgetLog) -> None:
    old_log = state.run.forget_log_name(state.manifest)
    change.files[rundir.forget_log_file(state.generation)] = rundir.encode_json(log.to_json())
    supersede = [*change.supersede, *([old_log] if old_log else [])]
    writer.commit(change.files, manifest=state.manifest, supersede=tuple(supersede))


def _result(
    state: _State, action: str, entry: Forgotten, log: ForgetLog, change: _Change, *, kept: bool
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
    run_dir: Path | str,
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
    run = RunDir(run_dir)
    with run.writer() as writer:
        _say(progress, "read", "the run's stage files")
        state = _State.read(run)
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
            removed[_key(index, spec)] = piece.clone()
            return torch.cat([before, after], dim=spec.axis)

        change = _Change()
        row, column = state.where(stage, name, state.classes[stage])
        _edit_stage_files(state, stage, row, column, take_out, change)
        if not purge:
            change.files[rundir.forgotten_rows_file(state.generation)] = rundir.encode_tensors(removed)
        log = ForgetLog(
            (*state.log.forgotten, entry),
            (*state.log.events, _event("forget", entry, at, reason, state.generation)),
        )
        _commit(writer, state, change, log)
    return _result(state, "forget", entry, log, change, kept=not purge)


def _latest(state: _State, name: str) -> Forgotten | None:
    entries = [f for f in state.log.forgotten if f.name == name]
    return max(entries, key=lambda f: f.generation) if entries else None


def _refuse_forget(state: _State, name: str) -> ForgetResult:
    entry = _latest(state, name)
    if entry is None:
        raise _unknown(state, name)
    how = "with its slices kept" if entry.kept else "and purged"
    raise RunStateError(
        f"class {name!r} was already forgotten {how} (stage {entry.stage}, {entry.at}); nothing to do"
        + (f": bring it back with `drl forget --restore {name}`" if entry.kept else "")
    )


def _purge_kept(writer: rundir.RunWriter, state: _State, name: str, reason: str | None) -> ForgetResult:
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
    change = _Change(supersede=[rundir.forgotten_rows_file(entry.generation)])
    _commit(writer, state, change, log)
    return replace(_result(state, "purge", purged, log, change, kept=False), at=at, reason=reason)


# ---------------------------------------------------------------------------- restore


def restore_class(
    run_dir: Path | str, name: str, *, reason: str | None = None, progress: Callable[[Any], None] | None = None
) -> ForgetResult:
    """Put a forgotten class back from its kept slices: the run answers as if it had never been
    forgotten. Columns of W for stages learned after the forget are solved again from the stored
    statistics at each stage's λ. A purged class cannot be restored (learn it again instead)."""
    reason = _check_reason(reason)
    run = RunDir(run_dir)
    with run.writer() as writer:
        _say(progress, "read", "the run's stage files")
        state = _State.read(run)
        entry = _restorable(state, name)
        rows = _rows(state, entry)
        classes = [n for n in state.metas[entry.stage]["classes"] if n in state.classes[entry.stage] or n == name]
        row, column = state.where(entry.stage, name, classes)

        def put_back(index: int, spec: PerClass, tensor: Tensor, position: int) -> Tensor:
            piece = rows.get(_key(index, spec))
            if piece is None:
                piece = _solve_column(state, index, entry, rows, spec)
            return torch.cat(
                [
                    tensor.narrow(spec.axis, 0, position),
                    piece.to(tensor.dtype),
                    tensor.narrow(spec.axis, position, tensor.shape[spec.axis] - position),
                ],
                dim=spec.axis,
            )

        change = _Change(supersede=[rundir.forgotten_rows_file(entry.generation)])
        _edit_stage_files(state, entry.stage, row, column, put_back, change)
        at = _now()
        log = ForgetLog(
            tuple(f for f in state.log.forgotten if f != entry),
            (*state.log.events, _event("restore", entry, at, reason, state.generation)),
        )
        _commit(writer, state, change, log)
    return replace(_result(state, "restore", entry, log, change, kept=False), at=at, reason=reason)


def _restorable(state: _State, name: str) -> Forgotten:
    """The entry ``restore`` brings back: the latest forget of ``name`` whose slices were kept."""
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
    kept = [f for f in entries if f.kept]
    if not kept:
        raise RunStateError(
            f"class {name!r} was forgotten with --purge ({entries[-1].at}): nothing of it was kept, so it cannot be "
            "restored; learn it again from new images with `drl learn-stage`"
        )
    entry = max(kept, key=lambda f: f.generation)
    from .data import refuse_near_duplicates

    learned = {n: k for k in state.indices for n in state.classes[k]}
    refuse_near_duplicates([name], learned, what=f"forgotten class {name!r}")
    return entry


def _rows(state: _State, entry: Forgotten) -> dict[str, Tensor]:
    """The kept slices of ``entry``, each checked: named after a per-class tensor, shaped like one slice."""
    rows = state.run.forgotten_rows(entry.generation, state.manifest)
    specs = {_key(k, spec): (k, spec) for k in state.indices for spec in PER_CLASS}
    for key, piece in rows.items():
        index, spec = specs.get(key, (None, None))
        if spec is None or piece.dim() <= spec.axis or piece.shape[spec.axis] != 1 or not piece.is_floating_point():
            raise _rows_error(state, entry, f"{key!r} is not one class's slice of a per-class tensor")
        if not torch.isfinite(piece).all():
            raise _rows_error(state, entry, f"{key} holds NaN or infinite values")
        tensor = state.tensors(index, spec.file).get(spec.name)
        expected = None if tensor is None else tensor.shape[: spec.axis] + (1,) + tensor.shape[spec.axis + 1 :]
        if expected is not None and tuple(piece.shape) != tuple(expected):
            raise _rows_error(state, entry, f"{key} has shape {tuple(piece.shape)}, expected {tuple(expected)}")
    for index in [k for k in state.indices if entry.stage <= k <= entry.last_stage]:  # every slice it took
        for file in (STAGE_WEIGHTS, STATISTICS):
            specs = _specs(file, index, entry.stage)
            tensors = state.tensors(index, file) if specs else {}
            missing = [_key(index, spec) for spec in specs if spec.name in tensors and _key(index, spec) not in rows]
            if missing:
                raise _rows_error(state, entry, f"{missing[0]} is missing")
    return rows


def _rows_error(state: _State, entry: Forgotten, problem: str) -> IntegrityError:
    path = state.run.path / rundir.forgotten_rows_file(entry.generation)
    return IntegrityError(f"{path} does not fit the run ({problem}); restore it from a backup")


def _solve_column(state: _State, index: int, entry: Forgotten, rows: dict[str, Tensor], spec: PerClass) -> Tensor:
    """The class's column of W in a stage learned after it was forgotten: (G + λI)⁻¹ q, G summed over
    stages 1..index, λ that stage's, q the class's kept columns of Q (exactly what that stage's fit
    gives the class at its λ: the columns of the ridge solution are independent)."""
    if spec.name != RIDGE_WEIGHT or index <= entry.last_stage:
        raise _rows_error(state, entry, f"{_key(index, spec)} is missing")
    from . import ranpac

    ridge = state.metas[index].get("ridge")
    lam = ridge.get("lambda") if isinstance(ridge, dict) else None
    if not isinstance(lam, (int, float)) or isinstance(lam, bool) or not 0 < lam < float("inf"):
        raise IntegrityError(
            f"stage {index} of run {state.run.path} records no valid ridge λ; restore it from a backup"
        )
    parts = [ranpac.Statistics.from_tensors(state.tensors(k, STATISTICS)) for k in state.indices if k <= index]
    total = ranpac.Statistics.accumulate(parts)
    q = {
        part: rows[_key(entry.stage, PerClass(STATISTICS, part, 1))].to(ranpac.STAT_DTYPE)
        for part in ("q_fit", "q_val")
    }
    return ranpac.solve(replace(total, q_fit=q["q_fit"], q_val=q["q_val"]), lam).float()
