"""The forget log and the classes a run answers with (see ``commands/forget.py`` for forgetting and
restoring): which classes are out, checked against the stages on every read; every per-class
tensor of a stage's files checked against its active classes; the kept slices of a forgotten class.

The per-class tensors are the heads' (``heads.per_class``): each head says which of its tensors
hold one slice per class, so nothing here knows a head's tensors by name."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import heads
from ..data import ImageSet
from ..errors import IntegrityError
from ..heads import Head, PerClass
from ..heads.checks import check_stages, dtype_problem, images_problem, recorded_images, slices_of
from .layout import STAGE_WEIGHTS, STATISTICS, TOTALS, forgotten_rows_file, stage_file
from .records import check_stage_meta, read_record
from .slices import slice_problem

if TYPE_CHECKING:
    from .directory import RunDir, StageRecord


LOG_KIND = "drl-forget-log"


FILES = {"weights": STAGE_WEIGHTS, "statistics": STATISTICS, "totals": TOTALS}  # heads.FILES -> file names
TENSOR_FILES = tuple(FILES.values())
# every tensor with one slice per class, as the heads declare them, naming the stage file it is in
PER_CLASS = tuple(replace(spec, file=FILES[spec.file]) for spec in heads.per_class())


@dataclass(frozen=True)
class Forgotten:
    """A class out of the answers: (stage, name) and how it went."""

    name: str
    stage: int
    at: str  # UTC, ISO 8601
    reason: str | None
    generation: int  # the commit that forgot it: its kept slices are forgotten_rows_file(generation)
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
    problem = next((p for f in log.forgotten if (p := _entry_problem(f, manifest, metas))), None)
    if problem:
        return problem
    active = [name for index in sorted(metas) for name in log.active(metas[index])]
    if len(set(active)) != len(active):
        return "a class name is active in two stages"
    return None


def _entry_problem(entry: Forgotten, manifest: dict[str, Any], metas: dict[int, dict[str, Any]]) -> str | None:
    """What in one forgotten class's entry does not fit the run (None: nothing)."""
    if entry.stage not in metas or entry.name not in metas[entry.stage]["classes"]:
        return f"class {entry.name!r} is not a class of stage {entry.stage}"
    newest = max(metas, default=0)
    if not entry.stage <= entry.last_stage <= newest or not 0 < entry.generation <= manifest["generation"]:
        return f"class {entry.name!r} has a stage or generation out of range"
    if entry.kept and forgotten_rows_file(entry.generation) not in manifest["files"]:
        return f"the kept rows of class {entry.name!r} are not listed"
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
        raise IntegrityError(f"{run.shown(name)} is malformed ({exc}); restore it from a backup") from exc
    problem = _log_problem(log, manifest, metas)
    if problem:
        raise IntegrityError(f"{run.shown(name)} does not fit the run ({problem}); restore it from a backup")
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
    (``classes``: stage -> active names), every head tensor the dtype drl writes it in; IntegrityError
    naming the stage otherwise."""
    odd = dtype_problem(tensors)
    if odd is not None:
        raise IntegrityError(
            f"stage {index} of run {run.path} is damaged ({stage_file(index, file)}: {odd}); restore it from a backup"
        )
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


def check_images(run: RunDir, stages: list[StageRecord], classes: dict[int, list[str]]) -> None:
    """Every per-class count of images in the stages' files (a carried run's: the draws a learn-stage
    makes follow them) at most the images each class's stage recorded; IntegrityError otherwise."""
    metas = {s.index: s.meta for s in stages}
    for stage in stages:
        for spec in PER_CLASS:
            tensor = {STAGE_WEIGHTS: stage.tensors, TOTALS: stage.totals}.get(spec.file, {}).get(spec.name)
            if not spec.images or tensor is None:
                continue
            for position, (k, name) in enumerate(slices_of(spec, stage.index, classes)):
                problem = images_problem(tensor.select(spec.axis, position), recorded_images(metas[k], name))
                if problem:
                    raise IntegrityError(
                        f"stage {stage.index} of run {run.path} is damaged ({stage_file(stage.index, spec.file)}: "
                        f"{spec.name} of class {name!r} {problem}); restore it from a backup"
                    )


def active_classes(
    run: RunDir, manifest: dict[str, Any], stages: list[StageRecord]
) -> tuple[ForgetLog, list[list[str]]]:
    """The forget log and each stage's active classes, every per-class tensor of the stages' weights
    checked against them (``api.load_run``: a forgotten class is never scored), every count of a
    class's images against its stage's record."""
    log = read_log(run, manifest, {s.index: s.meta for s in stages})
    classes = {s.index: log.active(s.meta) for s in stages}
    for stage in stages:
        check_tensors(run, stage.index, STAGE_WEIGHTS, stage.tensors, classes)
        check_tensors(run, stage.index, TOTALS, stage.totals, classes)
    check_images(run, stages, classes)
    return log, [classes[s.index] for s in stages]


def without_forgotten(images: ImageSet, log: ForgetLog, active: list[str]) -> ImageSet | None:
    """A registered eval set without the images of forgotten classes (None: nothing left)."""
    gone = log.names() - set(active)
    return images.without_classes(gone) if gone & set(images.class_names) else images


def check(run: RunDir, manifest: dict[str, Any]) -> int:
    """``drl verify``: the forget log fits the stages, every stage file fits the active classes and
    every kept rows file parses. Returns the number of forgotten classes."""
    stages = run.stages(manifest)
    for stage in stages:
        check_stage_meta(run, stage.index, stage.meta)
    log, _ = active_classes(run, manifest, stages)
    try:  # the heads' tensors together (the ridge's W against R), as a load reads them
        check_stages([stage.merged for stage in stages])
    except ValueError as exc:
        raise IntegrityError(f"run {run.path} is damaged ({exc}); restore it from a backup") from exc
    state = ForgetState(run, manifest, stages, log)
    for index in state.indices:  # one at a time: a long ridge run's statistics do not fit in memory together
        check_tensors(run, index, STATISTICS, run.stage_statistics(index, manifest), state.classes)
    for entry in log.forgotten:
        if entry.kept:
            kept_rows(state, entry)
    return len(log.forgotten)


class ForgetState:
    """One forget or restore's view of the run (under its lock): stages, active classes, files."""

    def __init__(self, run: RunDir, manifest: dict[str, Any], stages: list[StageRecord], log: ForgetLog):
        self.run, self.manifest, self.log = run, manifest, log
        self.indices = [s.index for s in stages]
        self.metas = {s.index: s.meta for s in stages}
        self.classes = {s.index: log.active(s.meta) for s in stages}
        self._files: dict[tuple[int, str], dict[str, Tensor]] = {(s.index, STAGE_WEIGHTS): s.tensors for s in stages}
        self._files.update({(s.index, TOTALS): s.totals for s in stages})

    @classmethod
    def read(cls, run: RunDir) -> ForgetState:
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


def slice_key(index: int, spec: PerClass) -> str:
    """A slice's name in a rows file: ``<stage>/<file>/<tensor>``."""
    return f"{index}/{spec.file}/{spec.name}"


def specs_of(file: str, index: int, stage: int) -> list[PerClass]:
    """The per-class tensors of stage ``index``'s ``file`` that hold a slice of a class of ``stage``."""
    return [spec for spec in PER_CLASS if spec.file == file and (spec.seen or index == stage)]


def kept_rows(state: ForgetState, entry: Forgotten) -> dict[str, Tensor]:
    """The kept slices of ``entry``, each checked: named after a per-class tensor, shaped like one
    slice, and every slice the forget took there."""
    rows = state.run.forgotten_rows(entry.generation, state.manifest)
    specs = {slice_key(k, spec): (k, spec) for k in state.indices for spec in PER_CLASS}
    for key, piece in rows.items():
        where = specs.get(key)
        if where is not None and not entry.stage <= where[0] <= entry.last_stage:  # the forget took none there
            where = None
        problem = slice_problem(state, key, piece, where)
        if not problem and where is not None and where[1].images:  # what the next learn-stage draws follows
            counted = images_problem(piece, recorded_images(state.metas[entry.stage], entry.name))
            problem = f"{key} {counted}" if counted else None
        if problem:
            raise rows_error(state, entry, problem)
    missing = _missing_slices(state, entry, rows)
    if missing:
        raise rows_error(state, entry, f"{missing} is missing")
    return rows


def _missing_slices(state: ForgetState, entry: Forgotten, rows: dict[str, Tensor]) -> str | None:
    """The first slice the forget of ``entry`` took out that its kept rows lack (None: none)."""
    for index in [k for k in state.indices if entry.stage <= k <= entry.last_stage]:
        for file in TENSOR_FILES:
            specs_here = specs_of(file, index, entry.stage)
            tensors = state.tensors(index, file) if specs_here else {}
            for spec in specs_here:
                if spec.name in tensors and slice_key(index, spec) not in rows:
                    return slice_key(index, spec)
    return None


def widened(piece: Tensor, like: Tensor, axis: int) -> Tensor:
    """A kept carried slice padded with zeros to one slice of ``like`` (along ``axis``): a class's
    Gaussian keeps as many directions as the run's widest class had at its forget, and later classes
    with more widen the run's (the rows past a class's rank are zero)."""
    want = like.shape[:axis] + (1,) + like.shape[axis + 1 :]
    return torch.nn.functional.pad(piece, [p for n, w in zip(want[::-1], piece.shape[::-1]) for p in (0, n - w)])


def rows_error(state: ForgetState, entry: Forgotten, problem: str) -> IntegrityError:
    path = state.run.shown(forgotten_rows_file(entry.generation))
    return IntegrityError(f"{path} does not fit the run ({problem}); restore it from a backup")


def solved_slice(state: ForgetState, index: int, entry: Forgotten, rows: dict[str, Tensor], spec: PerClass) -> Tensor:
    """The class's slice of a per-class tensor of a stage learned after it was forgotten (no slice
    was taken out there), solved again by the head that owns the tensor from that stage's records,
    the statistics up to it and the class's kept slices of its own stage's statistics."""
    head = next((h for h in heads.HEADS.values() if any(p.name == spec.name for p in h.per_class)), None)
    if head is None or not spec.seen or index <= entry.last_stage:
        raise rows_error(state, entry, f"{slice_key(index, spec)} is missing")
    kept = _kept_slices(head, entry, rows)
    statistics = [{**state.tensors(k, STATISTICS), **state.tensors(k, TOTALS)} for k in state.indices if k <= index]
    try:
        return head.load().restored_slice(spec.name, meta=state.metas[index], statistics=statistics, kept=kept)
    except (ValueError, KeyError) as exc:
        raise IntegrityError(
            f"stage {index} of run {state.run.path} cannot give back {spec.name} ({exc}); restore it from a backup"
        ) from exc


def _kept_slices(head: Head, entry: Forgotten, rows: dict[str, Tensor]) -> dict[str, Tensor]:
    """The slices of ``head``'s tensors kept at the forget of ``entry``: its stage's, and a carried run's
    as the newest stage held them at the forget."""
    return {
        p.name: rows[key]
        for p in head.per_class
        if (key := slice_key(entry.last_stage if p.carried else entry.stage, replace(p, file=FILES[p.file]))) in rows
    }
