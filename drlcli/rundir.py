"""The run directory: the product's memory. Only this module knows the file names inside it.

Layout (format version 1)::

    manifest.json              format, version, generation, every file with sha256 and size
    run.yaml                   method, PTM (name, args, sha256, data config), hyper-parameters
    ptm.safetensors            PTM weights, only for --random-init runs
    stages/NNN/stage.json      classes, data fingerprint, options, metrics of stage NNN
    stages/NNN/weights.safetensors   stage parameters + real prototypes of its classes
    stages/NNN/statistics.safetensors  accumulated statistics of the stage's images (ranpac's Gram
                               increments); read only to learn a later stage, never for inference
    .lock                      writer lock (flock) with the holder's pid, host and start time
    .staging/                  files being written; never trusted, cleaned by the next writer
    .checkpoint/               the last finished epoch of an interrupted learn-stage (not part
                               of the model; checksummed; resumed or discarded by the next one)
    .quarantine/<time>/        leftovers a writer moved aside instead of deleting (unlisted
                               stage folders, unknown names in the run's own folders)

Every file is immutable once listed in the manifest. A commit writes new files into
``.staging``, fsyncs them, renames them into place under names no committed file uses, then
replaces ``manifest.json`` by an atomic rename and fsyncs the directory. A crash at any moment
leaves the old manifest (and the old state) or the new one. Readers trust only files the manifest
lists, and verify their sha256 on every read. Nothing here is ever unpickled.

Files are created, written, renamed and removed only through ``storage.py`` (fsynced, no links
followed); this module decides which names they get.

A run directory is untrusted input (it is copied, downloaded, shared): no file or folder of a run
is ever followed out of it. Every access goes through the no-follow helpers below (``O_NOFOLLOW``
opens, ``lstat`` checks of every path component below the run's root), and a symbolic link where
the run keeps its own file or folder is refused (``IntegrityError``, exit 5). Writers delete only
names they create themselves; anything else they find in the run's folders is moved to
``.quarantine/`` with a logged warning, never deleted.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import socket
import stat
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from . import jsonio, storage
from .errors import IntegrityError, RunBusyError, RunStateError, StorageError, UsageError

try:
    import fcntl
except ImportError:  # Windows: the package still imports; writing a run refuses (RunDir.writer)
    fcntl = None  # type: ignore[assignment]

FORMAT = "drl-run"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
RUN_CONFIG = "run.yaml"
PTM_WEIGHTS = "ptm.safetensors"
STAGES = "stages"
LOCK = ".lock"
STAGING = ".staging"
CHECKPOINT = ".checkpoint"
CHECKPOINT_META = "checkpoint.json"
QUARANTINE = ".quarantine"
# every name a run keeps at its top level: never a link, and never a user's file that init would take over
RESERVED = (MANIFEST, RUN_CONFIG, PTM_WEIGHTS, STAGES, LOCK, STAGING, CHECKPOINT, QUARANTINE)
OWN_FOLDERS = (STAGES, CHECKPOINT, STAGING)  # folders whose every entry is the run's
_STAGING_NAME = re.compile(r"[0-9a-f]{32}")
_CHECKPOINT_TENSORS = re.compile(r"[0-9a-f]{32}\.safetensors")
_CHECKPOINT_TMP = f".{CHECKPOINT_META}.tmp"
log = logging.getLogger(__name__)

STAGE_META = "stage.json"
STAGE_WEIGHTS = "weights.safetensors"
STATISTICS = "statistics.safetensors"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stage_dir(index: int) -> str:
    """The run-relative folder of stage ``index`` (1-based): ``stages/NNN``."""
    return f"{STAGES}/{index:03d}"


def stage_file(index: int, name: str) -> str:
    """The run-relative name of one of stage ``index``'s files (``STAGE_META``, ``STAGE_WEIGHTS``...)."""
    return f"{stage_dir(index)}/{name}"


# --------------------------------------------------------------- no-follow access (the one place)


def _not_plain_error(path: Path, what: str) -> IntegrityError:
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
        raise _not_plain_error(path, "folder")
    return True


def make_dirs(root: Path, rel: str | PurePosixPath) -> Path:
    """``root/rel`` as a folder, each missing component made, none of them followed if a link."""
    path = root
    for part in PurePosixPath(rel).parts:
        path = path / part
        real_dir(path, create=True)
    return path


def read_nofollow(path: Path) -> bytes:
    """A regular file's bytes; a link, folder, FIFO or device in its place is refused (IntegrityError)."""
    with open(storage.open_nofollow(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise _not_plain_error(path, "regular file")
        return handle.read()


def _is_run(folder: Path) -> bool:
    try:
        data = json.loads(read_nofollow(folder / MANIFEST))
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


@dataclass(frozen=True)
class StageRecord:
    """One committed stage as read back: its metadata and its tensors."""

    index: int
    meta: dict[str, Any]
    tensors: dict[str, Tensor]


class RunDir:
    """Read access to a run directory; ``writer()`` gives the one write handle."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    # ------------------------------------------------------------------ reading

    def exists(self) -> bool:
        return os.path.lexists(self.path / MANIFEST)  # a link there is refused by manifest(), not ignored

    def manifest(self) -> dict[str, Any]:
        path = self.path / MANIFEST
        if not self.path.is_dir():
            raise RunStateError(
                f"run directory {self.path} does not exist; create it with `drl init --run {self.path}`"
            )
        if not os.path.lexists(path):
            raise RunStateError(f"{self.path} is not a drl run directory (no {MANIFEST}); create one with `drl init`")
        try:
            data = json.loads(read_nofollow(path))
        except (OSError, ValueError) as exc:
            raise IntegrityError(f"{path} is unreadable or damaged ({exc}); restore it from a backup") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise IntegrityError(f"{path} is not a drl manifest; restore it from a backup")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise IntegrityError(
                f"run {self.path} has format version {version}, this drl reads version "
                f"{FORMAT_VERSION}; use the drl release that wrote it"
            )
        if not _well_formed(data):
            raise IntegrityError(
                f"{path} is malformed (files, stages or generation of the wrong type); restore it from a backup"
            )
        self._refuse_links(data)
        return data

    def _refuse_links(self, manifest: dict[str, Any]) -> None:
        """Refuse the whole run if a link stands where it keeps a file or folder of its own."""
        try:
            names = [*RESERVED, *manifest["files"]]
        except (KeyError, TypeError) as exc:
            raise IntegrityError(f"{self.path / MANIFEST} is incomplete ({exc}); restore it from a backup") from exc
        for name in names:
            self._inside(name)
        for folder in OWN_FOLDERS:
            if real_dir(self.path / folder):
                for child in os.listdir(self.path / folder):
                    check_path(self.path / folder, child)

    def read_bytes(self, name: str, manifest: dict[str, Any] | None = None) -> bytes:
        """A listed file's bytes, after checking its size and sha256 against the manifest."""
        manifest = manifest or self.manifest()
        entry = manifest["files"].get(name)
        if entry is None:
            raise IntegrityError(f"{name} is not listed in {self.path / MANIFEST}; the run is incomplete")
        path = self._inside(name)
        try:
            data = read_nofollow(path)
        except OSError as exc:
            raise IntegrityError(f"{path} is missing or unreadable ({exc.strerror}); restore it from a backup") from exc
        if len(data) != entry["bytes"] or sha256_bytes(data) != entry["sha256"]:
            raise IntegrityError(f"{path} is damaged (checksum mismatch); restore it from a backup")
        return data

    def parsed(self, name: str, manifest: dict[str, Any] | None, parse: Callable[[bytes], Any]) -> Any:
        """A listed file, checksummed, then parsed into a mapping. A file whose checksum matches but
        whose content does not parse (or is no mapping) was crafted or damaged before it was listed."""
        data = self.read_bytes(name, manifest)
        try:
            value = parse(data)
        except (ValueError, yaml.YAMLError, SafetensorError) as exc:  # UnicodeDecodeError is a ValueError
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise IntegrityError(f"{self.path / name} cannot be parsed ({reason}); restore it from a backup") from exc
        if not isinstance(value, dict):
            raise IntegrityError(
                f"{self.path / name} holds a {type(value).__name__} where a mapping belongs; restore it from a backup"
            )
        return value

    def run_config(self, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.parsed(RUN_CONFIG, manifest, yaml.safe_load)

    def has_ptm_weights(self, manifest: dict[str, Any] | None = None) -> bool:
        return PTM_WEIGHTS in (manifest or self.manifest())["files"]

    def ptm_weights(self, manifest: dict[str, Any] | None = None) -> dict[str, Tensor]:
        return self.parsed(PTM_WEIGHTS, manifest, st_load)

    def stage_indices(self, manifest: dict[str, Any] | None = None) -> list[int]:
        return list((manifest or self.manifest())["stages"])

    def stage_meta(self, index: int, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.parsed(stage_file(index, STAGE_META), manifest, json.loads)

    def stage(self, index: int, manifest: dict[str, Any] | None = None) -> StageRecord:
        manifest = manifest or self.manifest()
        meta = self.stage_meta(index, manifest)
        tensors = self.parsed(stage_file(index, STAGE_WEIGHTS), manifest, st_load)
        return StageRecord(index, meta, tensors)

    def stage_statistics(self, index: int, manifest: dict[str, Any] | None = None) -> dict[str, Tensor]:
        """A stage's statistics file (empty when the stage has none)."""
        manifest = manifest or self.manifest()
        name = stage_file(index, STATISTICS)
        return self.parsed(name, manifest, st_load) if name in manifest["files"] else {}

    def stages(self, manifest: dict[str, Any] | None = None) -> list[StageRecord]:
        manifest = manifest or self.manifest()
        return [self.stage(i, manifest) for i in self.stage_indices(manifest)]

    def verify(self) -> list[str]:
        """Every problem found (empty when the run is intact): version, files, checksums."""
        try:
            manifest = self.manifest()
        except (IntegrityError, RunStateError) as exc:
            return [str(exc)]
        problems = []
        for name in manifest["files"]:
            try:
                self.read_bytes(name, manifest)
            except IntegrityError as exc:
                problems.append(str(exc))
        return problems

    def checkpoint(self) -> tuple[dict[str, Any], dict[str, Tensor]] | None:
        """The interrupted stage's last epoch (meta, tensors), or None if absent or damaged."""
        folder = self.path / CHECKPOINT
        try:
            if not real_dir(folder):
                return None
            meta = json.loads(read_nofollow(folder / CHECKPOINT_META))
            name = meta["tensors"]["file"]
            if not _CHECKPOINT_TENSORS.fullmatch(name):
                return None
            data = read_nofollow(folder / name)
            if sha256_bytes(data) != meta["tensors"]["sha256"]:
                return None
            return meta, st_load(data)
        except (OSError, ValueError, KeyError, TypeError, SafetensorError):
            return None

    def size_bytes(self, manifest: dict[str, Any] | None = None, prefix: str = "") -> int:
        files = (manifest or self.manifest())["files"]
        return sum(e["bytes"] for n, e in files.items() if n.startswith(prefix))

    def stage_bytes(self, index: int, manifest: dict[str, Any] | None = None) -> int:
        """Bytes on disk of stage ``index``'s files (parameters, prototypes, metadata, statistics)."""
        return self.size_bytes(manifest, prefix=f"{stage_dir(index)}/")

    def _inside(self, name: str) -> Path:
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise IntegrityError(f"manifest entry {name!r} points outside the run directory; the run is damaged")
        return check_path(self.path, rel)

    # ------------------------------------------------------------------ writing

    @contextlib.contextmanager
    def writer(self, *, create: bool = False, allow_nonempty: bool = False) -> Iterator[RunWriter]:
        """Hold the writer lock for the block. Fails fast (RunBusyError) if another holds it.
        ``create`` (init) first checks the folder holds nothing of a user's under the run's names
        (and nothing at all unless ``allow_nonempty``), before the lock file is even opened."""
        if fcntl is None or not hasattr(os, "O_NOFOLLOW"):
            raise StorageError(
                f"cannot write run {self.path}: this platform ({sys.platform}) lacks POSIX file locks (fcntl) "
                "and O_NOFOLLOW, which keep concurrent writers and symbolic links out of a run; "
                "use Linux or macOS (on Windows: WSL)"
            )
        if create:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"cannot create run directory {self.path}: {exc.strerror}") from exc
            refuse_existing(self.path, allow_nonempty=allow_nonempty)
        elif not self.path.is_dir():
            self.manifest()  # raises the right "no run here" error
        lock_path = self.path / LOCK
        fd = _open_lock(lock_path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunBusyError(
                    f"run {self.path} is busy: {_holder(lock_path)} is writing to it; wait for it to "
                    "finish (a lock from a dead process is released automatically)"
                ) from None
            holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, jsonio.dumps(holder).encode(), 0)
            if create:  # another init may have finished while this one waited
                refuse_existing(self.path, allow_nonempty=allow_nonempty)
            writer = RunWriter(self)
            writer.clean_staging()
            yield writer
        finally:
            os.close(fd)  # releases the flock


def _well_formed(manifest: dict[str, Any]) -> bool:
    """The manifest's fields have the types this module reads (a crafted one may not)."""
    files, stages = manifest.get("files"), manifest.get("stages")
    return (
        _is_int(manifest.get("generation"))
        and isinstance(files, dict)
        and isinstance(stages, list)
        and all(_is_int(i) and i > 0 for i in stages)
        and all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) and _is_int(e.get("bytes")) for e in files.values()
        )
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _open_lock(path: Path) -> int:
    """The lock file, opened without following a link; anything but a plain file of its own is refused."""
    try:
        fd = storage.open_nofollow(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK)
    except OSError as exc:
        raise StorageError(f"cannot open lock {path}: {exc.strerror}") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # a hard link would let the lock write elsewhere
        os.close(fd)
        raise _not_plain_error(path, "plain lock file (it is a special file or has other hard links)")
    return fd


def _lock_info(lock_path: Path) -> dict[str, Any] | None:
    """What a drl lock file says (pid, host, start), {} when empty; None when it is not a drl lock."""
    try:
        data = read_nofollow(lock_path)
        info = json.loads(data) if data else {}
    except (OSError, ValueError, IntegrityError):
        return None
    return info if isinstance(info, dict) and (not info or {"pid", "host", "started"} <= info.keys()) else None


def _holder(lock_path: Path) -> str:
    info = _lock_info(lock_path)
    return f"pid {info['pid']} on {info['host']} (since {info['started']})" if info else "another process"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class RunWriter:
    """Stages files and commits them atomically. Only exists while the writer lock is held."""

    def __init__(self, run: RunDir):
        self.run = run
        self._quarantine: Path | None = None  # this writer's .quarantine/<time>/, made on first use

    def clean_staging(self) -> None:
        """Tidy what interrupted writers left. Only the run's own temporary names are deleted;
        unlisted stage folders and unknown names are moved to the quarantine, never deleted."""
        listed = {stage_dir(i) for i in self.run.stage_indices()} if self.run.exists() else set()
        self._tidy(STAGING, keep=_never, delete=_STAGING_NAME.fullmatch, why="not a name drl writes there")
        storage.remove_dir_if_empty(self.run.path / STAGING)
        if not self.run.exists():
            return
        self._tidy(
            STAGES,
            keep=lambda name: f"{STAGES}/{name}" in listed,
            delete=_never,
            why=f"not listed in {MANIFEST}: left by an interrupted commit or a restored older manifest",
        )
        self._tidy(CHECKPOINT, keep=_is_checkpoint_file, delete=_never, why="not a name drl writes there")

    def _tidy(self, folder: str, *, keep: Callable[[str], object], delete: Callable[[str], object], why: str) -> None:
        """Keep, delete (the run's own names only) or quarantine each entry of one of the run's folders."""
        root = self.run.path / folder
        try:
            if not real_dir(root):
                return
            for name in sorted(os.listdir(root)):
                if keep(name):
                    continue
                if delete(name):
                    storage.remove(root / name)
                else:
                    self.quarantine(f"{folder}/{name}", why=why)
        except OSError as exc:
            raise StorageError(
                f"tidying {root} failed ({exc.strerror or exc}); the committed state is intact: check the "
                "folder's permissions and retry"
            ) from exc

    def quarantine(self, name: str, *, why: str) -> Path:
        """Move ``name`` (run-relative) to ``.quarantine/<time>/name`` and log a warning saying so."""
        if self._quarantine is None:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{uuid.uuid4().hex[:6]}"
            self._quarantine = make_dirs(self.run.path, PurePosixPath(QUARANTINE, stamp))
        rel = PurePosixPath(name)
        target = make_dirs(self._quarantine, rel.parent) / rel.name
        storage.rename(check_path(self.run.path, rel), target)  # rename moves a link itself, never its target
        log.warning(
            "%s is not part of the run (%s); moved it to %s instead of deleting it: delete it when you "
            "no longer need it",
            self.run.path / rel,
            why,
            target,
        )
        return target

    def save_checkpoint(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        """Replace the checkpoint atomically: tensors under a fresh name, then the meta by rename."""
        folder = self.run.path / CHECKPOINT
        data = encode_tensors(tensors)
        name = f"{uuid.uuid4().hex}.safetensors"
        try:
            real_dir(folder, create=True)
            storage.write_durable(folder / name, data)
            full = {**meta, "tensors": {"file": name, "sha256": sha256_bytes(data)}}
            storage.write_atomic(folder / CHECKPOINT_META, encode_json(full), tmp=folder / _CHECKPOINT_TMP)
        except OSError as exc:
            raise StorageError(
                f"writing the epoch checkpoint in {folder} failed ({exc.strerror or exc}); the committed "
                "state is intact" + ("; free some disk space" if exc.errno == errno.ENOSPC else "")
            ) from exc
        current = {CHECKPOINT_META, name}  # superseded tensors and temp files go
        self._tidy(CHECKPOINT, keep=current.__contains__, delete=_is_checkpoint_file, why="not a name drl writes there")

    def discard_checkpoint(self) -> None:
        self._tidy(CHECKPOINT, keep=_never, delete=_is_checkpoint_file, why="not a name drl writes there")
        storage.remove_dir_if_empty(self.run.path / CHECKPOINT)

    def commit(
        self,
        files: dict[str, bytes],
        *,
        manifest: dict[str, Any] | None,
        new_stage: int | None = None,
    ) -> dict[str, Any]:
        """Publish ``files`` (run-relative name → bytes; names must be new) with a new manifest."""
        old_files = dict(manifest["files"]) if manifest else {}
        clash = sorted(set(files) & set(old_files))
        if clash:
            raise RunStateError(f"{clash[0]} is already committed; committed files are never rewritten")
        finals = {name: self.run._inside(name) for name in files}  # refuses names escaping the run, links
        staging = self.run.path / STAGING / uuid.uuid4().hex
        placed: list[Path] = []  # files moved into place; taken back unless the manifest is replaced
        data = None
        try:
            make_dirs(self.run.path, PurePosixPath(STAGING, staging.name))
            entries = self._place(files, staging, finals, placed)
            new_manifest = _next_manifest(manifest, entries, new_stage)
            data = encode_json(new_manifest)
            storage.write_atomic(self.run.path / MANIFEST, data, tmp=staging / MANIFEST)  # the commit point
        except OSError as exc:
            raise self._commit_error(exc, published=self._published(data)) from exc
        finally:
            if not self._published(data):
                _take_back(placed, self.run.path)
            storage.discard(staging)
            storage.remove_dir_if_empty(self.run.path / STAGING)
        return new_manifest

    def _place(
        self, files: dict[str, bytes], staging: Path, finals: dict[str, Path], placed: list[Path]
    ) -> dict[str, dict[str, Any]]:
        """Write ``files`` into ``staging``, fsynced, then rename each to its final name (recorded in
        ``placed``), and fsync the folders they landed in. Returns their manifest entries."""
        entries = {}
        for name, data in files.items():
            rel = PurePosixPath(name)
            storage.write_durable(make_dirs(staging, rel.parent) / rel.name, data)
            entries[name] = {"sha256": sha256_bytes(data), "bytes": len(data)}
        for name in files:  # move into place; parents that appear are fsynced below
            make_dirs(self.run.path, PurePosixPath(name).parent)
            storage.replace(staging / name, finals[name])
            placed.append(finals[name])
        for parent in {final.parent for final in finals.values()} | {self.run.path}:
            storage.fsync_dir(parent)
        return entries

    def _published(self, data: bytes | None) -> bool:
        """Whether ``manifest.json`` is the one holding ``data`` (the commit point was passed)."""
        if data is None:
            return False
        try:
            return read_nofollow(self.run.path / MANIFEST) == data
        except (OSError, IntegrityError):
            return False

    def _commit_error(self, exc: OSError, *, published: bool) -> StorageError:
        reason = f"writing to {self.run.path} failed ({exc.strerror or exc})"
        if published:  # only the folder's fsync after the rename failed: the new state is in place
            return StorageError(f"{reason} after the new state was committed; check it with `drl verify`")
        return StorageError(
            f"{reason}; nothing was committed, the previous state is intact"
            + ("; free some disk space" if exc.errno == errno.ENOSPC else "")
        )


def _next_manifest(manifest: dict[str, Any] | None, entries: dict[str, Any], new_stage: int | None) -> dict[str, Any]:
    """The manifest after a commit: one generation on, the new files (and stage) listed."""
    stages = list(manifest["stages"]) if manifest else []
    if new_stage is not None:
        stages.append(new_stage)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "generation": (manifest["generation"] + 1) if manifest else 1,
        "committed": _now(),
        "stages": stages,
        "files": {**(manifest["files"] if manifest else {}), **entries},
    }


def _never(_: str) -> bool:
    return False


def _is_checkpoint_file(name: str) -> bool:
    return name in (CHECKPOINT_META, _CHECKPOINT_TMP) or bool(_CHECKPOINT_TENSORS.fullmatch(name))


def _take_back(placed: list[Path], root: Path) -> None:
    """Undo a commit that failed before its manifest: remove the files it moved in (its own, new names)."""
    for path in placed:
        storage.discard(path)
        if path.parent != root:
            storage.remove_dir_if_empty(path.parent)


def encode_json(obj: Any) -> bytes:
    return (jsonio.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def encode_yaml(obj: Any) -> bytes:
    return yaml.safe_dump(obj, sort_keys=False).encode()


def encode_tensors(tensors: dict[str, Tensor]) -> bytes:
    return st_save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def stage_files(
    index: int, meta: dict[str, Any], tensors: dict[str, Tensor], statistics: dict[str, Tensor] | None = None
) -> dict[str, bytes]:
    files = {
        stage_file(index, STAGE_META): encode_json(meta),
        stage_file(index, STAGE_WEIGHTS): encode_tensors(tensors),
    }
    if statistics:
        files[stage_file(index, STATISTICS)] = encode_tensors(statistics)
    return files


def init_files(run_config: dict[str, Any], ptm_state: dict[str, Tensor] | None) -> dict[str, bytes]:
    files = {RUN_CONFIG: encode_yaml(run_config)}
    if ptm_state is not None:
        files[PTM_WEIGHTS] = encode_tensors(ptm_state)
    return files


RUN_CONFIG_KIND = "drl-run-config"


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
        return _lock_info(path) is not None
    if path.name in (STAGING, QUARANTINE):
        return path.is_dir() and not path.is_symlink()
    if path.name == RUN_CONFIG:
        try:
            record = yaml.safe_load(read_nofollow(path))
        except (OSError, yaml.YAMLError):
            return False
        return isinstance(record, dict) and record.get("kind") == RUN_CONFIG_KIND
    return False
