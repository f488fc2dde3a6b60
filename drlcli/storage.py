"""Durable file operations: the one place drl creates, writes, renames and removes files.

``write_atomic`` is the one atomic write: the bytes go to a temporary name beside the target
(or a given one), are flushed and fsynced, renamed over the target, and the folder is fsynced,
so a crash at any moment leaves the old file or the new one, never a mix. Run files (manifest,
epoch checkpoint), ``.drl`` exports, serving graphs and plots are written through it.

Every primitive refuses a symbolic link where it writes (``O_NOFOLLOW``), never following it.
The run directory's commit (``rundir.py``) is built from these primitives only, so a test can
make the storage layer fail, or simulate a crash, at any one call (tests/test_crash_points.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from .errors import IntegrityError


def link_error(path: Path) -> IntegrityError:
    return IntegrityError(
        f"{path} is a symbolic link; drl never follows links inside a run directory: replace it with "
        "the run's own file or folder, or restore the run from a backup"
    )


def open_nofollow(path: Path, flags: int) -> int:
    """``os.open`` that refuses (IntegrityError) a symbolic link at ``path`` instead of following it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise link_error(path) from None
        raise


def write_durable(path: Path, data: bytes) -> None:
    """Write, flush and fsync ``path``; a link in its place is refused, never followed."""
    with open(open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def replace(source: Path, target: Path) -> None:
    """Rename ``source`` over ``target`` (atomic on POSIX; a link at ``target`` is replaced, not followed)."""
    os.replace(source, target)


def rename(source: Path, target: Path) -> None:
    """Move ``source`` to ``target``; a link is moved itself, never its target."""
    os.rename(source, target)


def fsync_dir(path: Path) -> None:
    """Make the folder's entries (files renamed or created in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dir(path: Path) -> None:
    """Create the folder ``path`` unless something is already there (the caller checks what)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)


def remove(path: Path) -> None:
    """Delete a file or folder drl created; a link in its place is refused, an absent path ignored."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise link_error(path)
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)  # fd-based on Linux: links inside are removed, never followed
    else:
        os.unlink(path)


def discard(path: Path) -> None:
    """Best-effort cleanup of drl's own leftover (a temporary file or folder): errors are ignored."""
    with contextlib.suppress(OSError, IntegrityError):
        remove(path)


def remove_dir_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):  # not empty, absent, or a link (rmdir never follows)
        os.rmdir(path)


def write_atomic(
    path: Path, data: bytes, *, tmp: Path | None = None, check: Callable[[Path], None] | None = None
) -> None:
    """Replace ``path`` with ``data`` atomically and durably (see the module docstring).

    ``tmp`` is the temporary name (default ``.<name>.tmp-<pid>`` beside ``path``); ``check`` is
    called with it once written, and an exception from it leaves ``path`` untouched. The
    temporary file never outlives a failed call."""
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_durable(tmp, data)
        if check is not None:
            check(tmp)
        replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise
    fsync_dir(path.parent)
