"""Durable file operations: the one place drl creates, writes, renames and removes files.

``write_atomic`` is the one atomic write: the bytes go to a fresh temporary name beside the target
(or a given one), are flushed and fsynced, renamed over the target, and the folder is fsynced,
so a crash at any moment leaves the old file or the new one, never a mix. Run files (manifest,
epoch checkpoint), ``.drl`` exports, serving graphs and plots are written through it.

drl never writes into a file that already exists: ``write_new`` creates its file
(``O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK``), so a symbolic link, a hard link to a file
elsewhere, a FIFO or a device planted under the name is refused, never written through or waited
on; the target itself is only ever replaced by a rename. ``read_regular`` is the matching read: a
regular file only (checked on the open descriptor, before any byte is read), at most ``limit``
bytes, so a FIFO, a device or a sparse giant is refused instead of hanging or filling memory.
The run directory's commit (``rundir.py``) is built from these primitives only, so a test can
make the storage layer fail, or simulate a crash, at any one call (tests/test_crash_points.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
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


def write_new(path: Path, data: bytes) -> None:
    """Create ``path`` (it must not exist), write, flush and fsync it. Anything already there, a
    link included, is refused (``FileExistsError``, or IntegrityError for a symbolic link)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NONBLOCK
    fd = open_nofollow(path, flags)  # from here on the file is this call's own
    try:
        with open(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        discard(path)
        raise


def fresh_name(path: Path) -> Path:
    """A temporary name beside ``path`` that no one has used: ``.<name>.tmp-<random>``."""
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")


def read_regular(path: Path, *, limit: int, what: str, follow: bool = False) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them. The type and size are
    checked on the open descriptor before anything is read (a FIFO is opened non-blocking, never
    waited on); a link is refused unless ``follow``. ``ValueError`` names the problem (``what``
    names the file for the message); ``OSError`` when it cannot be opened at all."""
    flags = os.O_RDONLY | os.O_NONBLOCK
    fd = os.open(path, flags) if follow else open_nofollow(path, flags)
    with open(fd, "rb") as handle:
        return read_open(handle.fileno(), path, limit=limit, what=what)


def read_open(fd: int, path: Path, *, limit: int, what: str) -> bytes:
    """``read_regular`` on a descriptor already open (from its start; it stays open): the file's bytes
    even after its name was deleted."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} {path} is {_kind(info.st_mode)}, not a regular file")
    if info.st_size > limit:
        raise ValueError(f"{what} {path} is {info.st_size:,} bytes, more than the {limit:,} drl reads")
    chunks, offset = [], 0
    while offset <= info.st_size:  # one byte more shows a file whose size lies (procfs) or grows
        chunk = os.pread(fd, info.st_size + 1 - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    data = b"".join(chunks)
    if len(data) != info.st_size:
        raise ValueError(f"{what} {path} does not hold the {info.st_size:,} bytes its size says (it changed, or lies)")
    return data


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "a special file"


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

    ``tmp`` is the temporary name (default: ``fresh_name(path)``; a given one must not exist);
    ``check`` is called with it once written, and an exception from it leaves ``path`` untouched.
    The temporary file never outlives a failed call, and one that was there before is never
    touched (the call fails instead)."""
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else fresh_name(path)
    try:
        write_new(tmp, data)  # cleans up after itself
    except FileExistsError as exc:
        raise IntegrityError(
            f"{tmp} already exists; drl writes only files it creates: remove it, or restore from a backup"
        ) from exc
    try:
        if check is not None:
            check(tmp)
        replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise
    fsync_dir(path.parent)
