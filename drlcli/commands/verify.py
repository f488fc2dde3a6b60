"""``drl verify``: every file of a run checked against its manifest (size, sha256, content), the
forget log against the stages, and an interrupted stage's checkpoint reported."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, RunStateError
from ..progress import Progress, ProgressFn
from ..run import forgotten
from ..run.directory import RunDir
from ..run.records import checked_metas
from ..run.track import switched, tied_track
from ..stage.resume import checkpoint_meta_ok


@dataclass(frozen=True)
class VerifyResult:
    run_dir: str
    format_version: int
    generation: int
    num_stages: int
    files_checked: int
    bytes_checked: int
    interrupted_stage: dict[str, Any] | None  # a resumable checkpoint, if one is waiting
    frozen_track: dict[str, Any] | None = None  # a switched run's frozen track, verified the same way

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify(run_dir: Path | str | RunDir, *, progress: ProgressFn | None = None) -> VerifyResult:
    """Check every file the manifest lists (size, sha256, content) and the format; raise naming each damage."""
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    return run.read_generation(lambda manifest: _verify(run, manifest, progress))


def _verify(run: RunDir, manifest: dict[str, Any], progress: ProgressFn | None) -> VerifyResult:
    report = (lambda step, total, name: progress(Progress("verify", step, total, name))) if progress else None
    problems = run.problems(manifest, progress=report)
    if problems:
        raise IntegrityError(f"run {run.path} is damaged: {'; '.join(problems)}" if len(problems) > 1 else problems[0])
    forgotten.check(run, manifest)  # the forget log and what it kept fit the stages
    checkpoint = run.checkpoint()
    waiting = None
    if checkpoint is not None and checkpoint[0].get("generation") == manifest["generation"]:
        meta = checkpoint[0]
        if checkpoint_meta_ok(meta):
            waiting = {"stage": meta.get("stage"), "epoch": meta["epoch"], "epochs": meta["train"].get("epochs")}
    return VerifyResult(
        str(run.path),
        manifest["format_version"],
        manifest["generation"],
        len(manifest["stages"]),
        len(manifest["files"]),
        run.size_bytes(manifest),
        waiting,
        _frozen_track(run, manifest, progress),
    )


def _frozen_track(run: RunDir, manifest: dict[str, Any], progress: ProgressFn | None) -> dict[str, Any] | None:
    """A switched run's frozen track (``run/track.py``): its files verified the same way, its records
    tied to the run's, and which track the run answers from as its records say."""
    if not switched(run, manifest):
        return None
    metas = checked_metas(run, manifest)
    if not metas:
        return None
    try:
        track, _, answers = tied_track(run, manifest, metas)
    except RunStateError as exc:  # a run of an earlier release, left between its two commits: damage to name
        raise IntegrityError(str(exc)) from exc
    # the track has no format of its own: its files are the run's, in the run's format
    checked = verify(track, progress=progress).to_dict()
    return {**checked, "format_version": manifest["format_version"], "answers": answers}
