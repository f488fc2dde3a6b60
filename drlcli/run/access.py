"""No-follow access to a run's files: every component below the run's root checked, never a
link followed out of it; the rule that no command's output lands inside a run; and what to say
where no run is."""

from __future__ import annotations

import difflib
import os
import stat
from pathlib import Path, PurePosixPath

from .. import jsonio, storage
from ..errors import IntegrityError, RunStateError, UsageError
from .layout import FORMAT, MANIFEST, MAX_RECORD_BYTES


def not_plain_error(path: Path, what: str) -> IntegrityError:
    return IntegrityError(f"{path} is not a {what}; remove it or restore the run from a backup")


def check_path(root: Path, rel: str | PurePosixPath) -> Path:
    """``root/rel``, after checking that no existing component below ``root`` is a symbolic link."""
    path = root
    for part in PurePosixPath(rel).parts:
        path = path / part
        if path.is_symlink():
            raise storage.link_error(path)
    return path


def real_dir(path: Path, *, create: bool = False) -> bool:
    """Whether ``path`` is a folder (made first when ``create``); a link or file in its place is refused."""
    if create:
        storage.make_dir(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(mode):
        raise storage.link_error(path)
    if not stat.S_ISDIR(mode):
        raise not_plain_error(path, "folder")
    return True


def make_dirs(root: Path, rel: str | PurePosixPath) -> Path:
    """``root/rel`` as a folder, each missing component made, none of them followed if a link."""
    path = root
    for part in PurePosixPath(rel).parts:
        path = path / part
        real_dir(path, create=True)
    return path


def read_nofollow(path: Path, *, limit: int = MAX_RECORD_BYTES) -> bytes:
    """A regular file's bytes, at most ``limit``; a link, folder, FIFO or device in its place, or
    a bigger file, is refused (IntegrityError) before anything is read."""
    try:
        return storage.read_regular(path, limit=limit, what="run file")
    except ValueError as exc:
        raise IntegrityError(f"{exc}; remove it or restore the run from a backup") from None


def _is_run(folder: Path) -> bool:
    try:
        data = jsonio.loads(read_nofollow(folder / MANIFEST))
    except (OSError, ValueError, IntegrityError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def enclosing_run(path: Path | str) -> Path | None:
    """The run directory ``path`` would land in (itself or an ancestor), links resolved; else None."""
    path = Path(path)
    for target in (path.parent.resolve() / path.name, path.resolve()):
        for folder in (target, *target.parents):
            if _is_run(folder):
                return folder
    return None


def refuse_inside_run(path: Path | str, *, option: str) -> None:
    """A command's output file must never land inside a run directory (it could replace the run's files)."""
    run = enclosing_run(path)
    if run is not None:
        raise UsageError(
            f"{option} {path} is inside the drl run directory {run}; writing there could destroy the run: "
            "pick a path outside it"
        )


def no_run(path: Path) -> RunStateError:
    """No run at ``path``: a run beside it with a similar name is named (a typo), else how to make one."""
    if str(path) == ".":
        return RunStateError(f"the current folder is not a drl run (no {MANIFEST}); pass --run RUN (or set DRL_RUN)")
    near = nearby_run(path)
    what = "does not exist" if not path.is_dir() else f"is not a drl run directory (no {MANIFEST})"
    if near is not None:
        return RunStateError(f"{path} {what}; did you mean --run {near}?")
    return RunStateError(f"{path} {what}; a new run is made with `drl init --run {path}`")


def nearby_run(path: Path, *, limit: int = 2000) -> Path | None:
    """The run directory beside ``path`` whose name is closest to it (a typo), if one is close: among
    the first ``limit`` entries of its parent, those holding a manifest."""
    try:
        with os.scandir(path.parent) as entries:
            names = [e.name for _, e in zip(range(limit), entries) if e.name != path.name]
    except OSError:
        return None
    for name in difflib.get_close_matches(path.name, names, n=5, cutoff=0.6):
        if os.path.isfile(path.parent / name / MANIFEST):
            return path.parent / name
    return None
