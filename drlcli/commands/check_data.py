"""``drl check-data``: a drop checked before ``learn-stage``, against the run it would go to, every
problem named in one call: its classes and image counts, images that do not decode, images shared
between classes or with --eval-data (by the sha256 of their bytes), classes the run has learned,
the layout (split folders, stray files, empty classes), and what the stage would cost. It reads
the run as any reader does (no lock) and writes nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..data import ImageSet
from ..data.survey import Finding, ImageFacts, inspect_images, near_duplicate_names, survey_folder
from ..methods import Method, method_of, trains_stage
from ..progress import Progress, ProgressFn
from ..run.directory import RunDir
from ..run.forgotten import read_log
from ..run.records import checked_metas, read_record, set_has_trained, trial_declined

TRAIN_PASSES = 3  # forward-pass equivalents of one training step per image: forward and backward


@dataclass(frozen=True)
class StageCost:
    """What learning the drop would cost, in forward-pass equivalents (one image through the PTM
    once), an estimate: ``train`` (images x epochs x 3 when the recipe trains this stage),
    ``features`` (the feature pass, and any the recipe adds) and ``evaluation`` (--eval-data)."""

    stage: int
    num_images: int
    trained: bool
    epochs: int  # 0: the recipe trains nothing at this stage
    train: int
    features: int
    evaluation: int
    notes: list[str]

    @property
    def passes(self) -> int:
        return self.train + self.features + self.evaluation

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "passes": self.passes}


@dataclass(frozen=True)
class DataCheck:
    """A drop as ``learn-stage`` would see it: its classes (name -> images), every problem (each
    with learn-stage's exit code; ``exit_code`` the highest, 0 when there is none), notes that stop
    nothing, and the stage's cost."""

    run_dir: str
    data_dir: str
    eval_data_dir: str | None
    classes: dict[str, int]
    eval_classes: dict[str, int] | None
    problems: list[Finding]
    notes: list[Finding]
    cost: StageCost | None  # None: --data lists no usable image
    learned_as: int | None  # the committed stage that learned exactly this drop (learn-stage: unchanged)

    @property
    def exit_code(self) -> int:
        return max((p.exit_code for p in self.problems), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": self.run_dir,
            "data_dir": self.data_dir,
            "eval_data_dir": self.eval_data_dir,
            "clean": not self.problems,
            "exit_code": self.exit_code,
            "num_images": sum(self.classes.values()),
            "classes": self.classes,
            "num_eval_images": sum(self.eval_classes.values()) if self.eval_classes is not None else None,
            "eval_classes": self.eval_classes,
            "problems": [p.to_dict() for p in self.problems],
            "notes": [n.to_dict() for n in self.notes],
            "cost": self.cost.to_dict() if self.cost else None,
            "learned_as": self.learned_as,
        }


@dataclass(frozen=True)
class _RunState:
    config: RunConfig
    method: Method
    learned: dict[str, int]  # active classes -> stage
    metas: list[dict[str, Any]]
    index: int  # of the stage the drop would be


def _run_state(run: RunDir, manifest: dict[str, Any]) -> _RunState:
    _, config = read_record(run, manifest)
    metas = checked_metas(run, manifest)
    forgotten = read_log(run, manifest, {meta["stage"]: meta for meta in metas})
    learned = {name: meta["stage"] for meta in metas for name in forgotten.active(meta)}
    index = max(run.stage_indices(manifest), default=0) + 1
    return _RunState(config, method_of(config), learned, metas, index)


def check_data(
    run_dir: Path | str,
    data_dir: Path | str,
    *,
    eval_data_dir: Path | str | None = None,
    num_threads: int | None = None,
    progress: ProgressFn | None = None,
) -> DataCheck:
    """Check ``data_dir`` (and ``eval_data_dir``) as ``learn-stage --run run_dir`` would take them,
    collecting every problem; nothing is written to the run or the folders."""
    run = RunDir(run_dir)
    if progress is not None:
        progress(Progress("read", 0, 0, "the run's records and the data folders"))
    state = run.read_generation(lambda manifest: _run_state(run, manifest))
    images, problems = survey_folder(data_dir, what="--data")
    eval_images, found = survey_folder(eval_data_dir, what="--eval-data") if eval_data_dir else (None, [])
    problems += found
    sets = [("--data", images), ("--eval-data", eval_images)]
    found, notes = _image_findings(sets, num_threads, progress)
    problems += found
    learned_as = _learned_as(state, images) if not problems else None
    if learned_as is not None:
        notes.append(
            Finding(
                "already_learned",
                f"run {run.path} learned this drop as stage {learned_as}: learn-stage would change nothing",
                exit_code=0,
            )
        )
    else:
        problems += _against_run(state, images, eval_images)
    return DataCheck(
        run_dir=str(run.path),
        data_dir=str(data_dir),
        eval_data_dir=str(eval_data_dir) if eval_data_dir is not None else None,
        classes=images.counts() if images is not None else {},
        eval_classes=eval_images.counts() if eval_images is not None else None,
        problems=problems,
        notes=notes,
        cost=_cost(state, images, eval_images) if images is not None and learned_as is None else None,
        learned_as=learned_as,
    )


def _image_findings(
    sets: list[tuple[str, ImageSet | None]], num_threads: int | None, progress: ProgressFn | None
) -> tuple[list[Finding], list[Finding]]:
    """Every image decoded and hashed once: (problems, notes) of unreadable, bounded and shared images."""
    facts = {what: _inspect(listing, what, num_threads, progress) for what, listing in sets if listing is not None}
    problems: list[Finding] = []
    notes: list[Finding] = []
    for what, listing in sets:
        if listing is not None:
            problems += _unreadable(listing, facts[what])
            notes += _bounded(listing, facts[what])
    shared, same_class = _duplicates(sets, facts)
    return problems + shared, notes + same_class


def _inspect(listing: ImageSet, what: str, num_threads: int | None, progress: ProgressFn | None) -> list[ImageFacts]:
    def step(done: int, total: int) -> None:
        if progress is not None:
            progress(Progress("validate", done, total, f"{what} {listing.root}"))

    step(0, len(listing.paths))
    return inspect_images(listing.paths, num_threads=num_threads, progress=step)


def _class_of(listing: ImageSet, index: int) -> str:
    return listing.class_names[listing.labels[index]]


def _unreadable(listing: ImageSet, facts: list[ImageFacts]) -> list[Finding]:
    return [
        Finding(
            "unreadable", f"image {path} {fact.problem}; fix or remove the file", [str(path)], [_class_of(listing, i)]
        )
        for i, (path, fact) in enumerate(zip(listing.paths, facts))
        if fact.problem is not None
    ]


def _bounded(listing: ImageSet, facts: list[ImageFacts]) -> list[Finding]:
    return [
        Finding("oversized", f"image {path} {fact.note}", [str(path)], [_class_of(listing, i)], exit_code=0)
        for i, (path, fact) in enumerate(zip(listing.paths, facts))
        if fact.note is not None
    ]


def _duplicates(
    sets: Sequence[tuple[str, ImageSet | None]], facts: dict[str, list[ImageFacts]]
) -> tuple[list[Finding], list[Finding]]:
    """(problems: identical files in two classes of --data or in both folders; notes: identical files
    within one class, which only weigh twice)."""
    groups: dict[str, list[tuple[str, str, Path]]] = {}
    for what, listing in sets:
        if listing is None:
            continue
        for i, (path, fact) in enumerate(zip(listing.paths, facts[what])):
            if fact.sha256 is not None:
                groups.setdefault(fact.sha256, []).append((what, _class_of(listing, i), path))
    problems, notes = [], []
    for sha, group in groups.items():
        if len(group) > 1:
            finding = _duplicate(sha, group)
            (problems if finding.exit_code else notes).append(finding)
    return problems, notes


def _duplicate(sha: str, group: list[tuple[str, str, Path]]) -> Finding:
    where = "; ".join(f"{what} class {name!r}: {path}" for what, name, path in group)
    classes = sorted({name for _, name, _ in group})
    paths = [str(path) for _, _, path in group]
    data_classes = {name for what, name, _ in group if what == "--data"}
    if len(data_classes) > 1:
        fix = "one image cannot teach two classes: keep it in the class it shows"
    elif len({what for what, _, _ in group}) > 1:
        fix = "an evaluation image that is also learned scores memory, not new images: remove it from one folder"
    else:
        return Finding(
            "duplicate",
            f"the same image (sha256 {sha[:12]}) is in one class twice ({where})",
            paths,
            classes,
            exit_code=0,
        )
    return Finding("shared_image", f"the same image (sha256 {sha[:12]}) is in {where}; {fix}", paths, classes)


def _learned_as(state: _RunState, images: ImageSet | None) -> int | None:
    """The committed stage of exactly this drop (its classes and fingerprint), as learn-stage finds it."""
    if images is None:
        return None
    classes, fingerprint = list(images.class_names), images.fingerprint()
    meta = next((m for m in state.metas if m["classes"] == classes and m["data_fingerprint"] == fingerprint), None)
    return None if meta is None else meta["stage"]


def _against_run(state: _RunState, images: ImageSet | None, eval_images: ImageSet | None) -> list[Finding]:
    """Classes the run has learned (active ones: a forgotten class may come again), names that differ
    from a learned one only by case or form, and --eval-data classes neither learned nor in --data."""
    if images is None:
        return []
    found = [
        Finding(
            "learned_class",
            f"class {name!r} in --data was already learned in stage {state.learned[name]}; "
            "new stages bring new classes only: rename or remove that folder",
            [str(images.root / name)],
            [name],
        )
        for name in images.class_names
        if name in state.learned
    ]
    found += near_duplicate_names(images.class_names, state.learned, what="--data", within=False)
    if eval_images is not None:
        unknown = [c for c in eval_images.class_names if c not in state.learned and c not in images.class_names]
        if unknown:
            found.append(
                Finding(
                    "eval_class_unknown",
                    f"--eval-data {eval_images.root} has class(es) neither learned nor in --data: {unknown[:5]}; "
                    "remove them or add them to --data",
                    [str(eval_images.root / c) for c in unknown],
                    unknown,
                )
            )
    return found


def _cost(state: _RunState, images: ImageSet, eval_images: ImageSet | None) -> StageCost:
    config, method, index, n = state.config, state.method, state.index, len(images)
    schedule = method.schedule(config)
    trained = trains_stage(config, index) and not (schedule.pauses and trial_declined(state.metas))
    epochs = schedule.epochs(config.train.epochs, trained_before=set_has_trained(state.metas)) if trained else 0
    passes, notes = _feature_passes(state, trained)
    if any(m.get("eval_data") for m in state.metas):
        notes.append("the eval sets earlier stages registered are evaluated too (1 pass per image, not counted)")
    evaluation = len(eval_images) if eval_images is not None else 0
    return StageCost(index, n, trained, epochs, n * epochs * TRAIN_PASSES, n * passes, evaluation, notes)


def _feature_passes(state: _RunState, trained: bool) -> tuple[int, list[str]]:
    """Feature passes per image of the stage's images beside training, and what they are."""
    schedule, index = state.method.schedule(state.config), state.index
    passes, notes = 1, []
    if trained and schedule.carries and index > 1:
        passes += 1
        notes.append("a carried run's stage after the first passes its images through the network as it begins")
    if schedule.switches:
        passes += 1
        notes.append("the run's frozen track makes its own feature pass")
        if schedule.pauses and index > 1:
            notes.append("training may pause at this stage if the run's forward transfer stalls (no training passes)")
    notes += _trial_notes(state)
    if trained and schedule.decides_first and index == 1:
        notes.append("stage 1 trains on part of its images and scores the rest with both PTMs")
    return passes, notes


def _trial_notes(state: _RunState) -> list[str]:
    """What the trial (``stage/trial.py``) changes about the estimate, if the run tries adapting first."""
    if not state.method.schedule(state.config).tries:
        return []
    if state.index == 1:
        trial = state.config.schedule
        return [
            f"stage 1 first tries adapting on half its classes ({trial.trial_epochs} epochs on at most "
            f"{trial.trial_images} images of each, not counted) and trains only where that moves their features; "
            "otherwise it has no training passes"
        ]
    if trial_declined(state.metas):
        return [
            "the run's trials kept its adapter set untrained: this stage may be tried again, else it does not train"
        ]
    return []
