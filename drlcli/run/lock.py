"""The writer lock (``.lock``: flock, with the holder's pid, host and start time) and the rule that
``init`` never takes over a run or a user's file."""

from __future__ import annotations

import os
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any

from .. import jsonio, storage
from ..errors import IntegrityError, RunBusyError, RunStateError, StorageError
from .access import check_path, not_plain_error, read_nofollow
from .layout import LOCK, MANIFEST, QUARANTINE, RESERVED, RUN_CONFIG, RUN_CONFIG_KIND, STAGING

try:
    import fcntl
except ImportError:  # Windows: the package still imports; writing a run refuses (require_locks)
    fcntl = None  # type: ignore[assignment]


def require_locks(run_path: Path) -> None:
    """A run is written only where POSIX file locks and O_NOFOLLOW keep writers and links out."""
    if fcntl is None or not hasattr(os, "O_NOFOLLOW"):
        raise StorageError(
            f"cannot write run {run_path}: this platform ({sys.platform}) lacks POSIX file locks (fcntl) "
            "and O_NOFOLLOW, which keep concurrent writers and symbolic links out of a run; "
            "use Linux or macOS (on Windows: WSL)"
        )


def acquire(lock_path: Path, run_path: Path) -> int:
    """Open and take the writer lock (its fd; closing it releases the lock), recording this process
    as its holder. Fails fast (RunBusyError) if another process holds it."""
    fd = open_lock(lock_path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunBusyError(
            f"run {run_path} is busy: {holder(lock_path)} is writing to it; wait for it to "
            "finish (a lock from a dead process is released automatically)"
        ) from None
    try:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": now()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, jsonio.dumps(me).encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_lock(path: Path) -> int:
    """The lock file, opened without following a link; anything but a plain file of its own is refused."""
    try:
        fd = storage.open_nofollow(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK)
    except OSError as exc:
        raise StorageError(f"cannot open lock {path}: {exc.strerror}") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # a hard link would let the lock write elsewhere
        os.close(fd)
        raise not_plain_error(path, "plain lock file (it is a special file or has other hard links)")
    return fd


def writer_active(run_path: Path) -> bool:
    """Whether another process holds the run's writer lock now: probed with a shared lock taken and
    dropped at once, never waited on (False where locks are not available)."""
    if "fcntl" not in globals():
        return False
    try:
        fd = storage.open_nofollow(run_path / LOCK, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the probe's shared lock
    return False


def lock_info(lock_path: Path) -> dict[str, Any] | None:
    """What a drl lock file says (pid, host, start), {} when empty; None when it is not a drl lock."""
    try:
        data = read_nofollow(lock_path)
        info = jsonio.loads(data) if data else {}
    except (OSError, ValueError, IntegrityError):
        return None
    return info if isinstance(info, dict) and (not info or {"pid", "host", "started"} <= info.keys()) else None


def holder(lock_path: Path) -> str:
    info = lock_info(lock_path)
    return f"pid {info['pid']} on {info['host']} (since {info['started']})" if info else "another process"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def refuse_existing(path: Path, *, allow_nonempty: bool = False) -> None:
    """``init`` never takes over a run or a user's file. The folder may hold only what an
    interrupted init left (its lock, staging, quarantine, its own run.yaml), or with
    ``allow_nonempty`` other files too, but never a user's file under one of the run's names."""
    for name in RESERVED:
        check_path(path, name)
    if os.path.lexists(path / MANIFEST):
        raise RunStateError(f"{path} already holds a drl run; pick another --run or remove it first")
    foreign = sorted(name for name in os.listdir(path) if not _init_leftover(path / name))
    taken = [name for name in foreign if name in RESERVED]
    if taken:
        raise RunStateError(
            f"{path / taken[0]} exists and is not drl's; init never overwrites a file: move it out of "
            f"{path} or pick another --run"
        )
    if foreign and not allow_nonempty:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise RunStateError(
            f"{path} is not empty (it holds {shown}); init creates a run in an empty folder: pick another "
            "--run, or pass --allow-nonempty to create it beside those files (drl never changes them)"
        )


def _init_leftover(path: Path) -> bool:
    """Whether ``path`` is something an interrupted ``init`` of drl's own left behind."""
    if path.name == LOCK:
        return lock_info(path) is not None
    if path.name in (STAGING, QUARANTINE):
        return path.is_dir() and not path.is_symlink()
    if path.name == RUN_CONFIG:
        try:
            record = jsonio.load_yaml(read_nofollow(path))
        except (OSError, ValueError, IntegrityError):
            return False
        return isinstance(record, dict) and record.get("kind") == RUN_CONFIG_KIND
    return False
