"""The run directory: the product's memory. Only this module knows the file names inside it.

Layout (format version 1)::

    manifest.json              format, version, generation, every file with sha256 and size
    run.yaml                   method, PTM (name, args, sha256, data config), hyper-parameters
    ptm.safetensors            PTM weights, only for --random-init runs
    stages/NNN/stage.json      classes, data fingerprint, options, metrics of stage NNN
    stages/NNN/weights.safetensors   stage parameters + real prototypes of its classes
    stages/NNN/statistics.safetensors  accumulated statistics of the stage's images (ranpac's Gram
                               increments); read only to learn a later stage, never for inference
    stages/NNN/weights-gGGGGGG.safetensors, statistics-gGGGGGG.safetensors
                               the same files as rewritten by the commit of generation GGGGGG
                               (``drl forget``): the manifest lists exactly one version of each
    forgotten/log-gGGGGGG.json the forget log: forgotten classes and every forget/restore (forget.py)
    forgotten/rows-gGGGGGG.safetensors  what the forget of generation GGGGGG took out of the stage
                               files (one class's slices), kept so that ``--restore`` can put it back
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

A commit may also supersede listed files (``drl forget`` rewrites a stage's files under new names):
the new manifest no longer lists them and names them under ``superseded``; the writer deletes them
right after the commit point, and the next writer deletes any that a crash left. A run whose
manifest lists a ``forgotten/`` file is format version 2 (older releases refuse it by its version,
never misread it); every other run stays version 1, readable by older releases.

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
from typing import Any, TypeVar

import torch
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
FORMAT_VERSION = 1  # a run without forget files; one with them is FORGET_FORMAT_VERSION
FORGET_FORMAT_VERSION = 2
READABLE_VERSIONS = (FORMAT_VERSION, FORGET_FORMAT_VERSION)
MANIFEST = "manifest.json"
RUN_CONFIG = "run.yaml"
PTM_WEIGHTS = "ptm.safetensors"
STAGES = "stages"
LOCK = ".lock"
STAGING = ".staging"
CHECKPOINT = ".checkpoint"
CHECKPOINT_META = "checkpoint.json"
QUARANTINE = ".quarantine"
FORGOTTEN = "forgotten"
# every name a run keeps at its top level: never a link, and never a user's file that init would take over
RESERVED = (MANIFEST, RUN_CONFIG, PTM_WEIGHTS, STAGES, LOCK, STAGING, CHECKPOINT, QUARANTINE, FORGOTTEN)
OWN_FOLDERS = (STAGES, CHECKPOINT, STAGING, FORGOTTEN)  # folders whose every entry is the run's
_STAGING_NAME = re.compile(r"[0-9a-f]{32}")
_CHECKPOINT_TENSORS = re.compile(r"[0-9a-f]{32}\.safetensors")
# the checkpoint meta's temporary names: fresh ones (storage.fresh_name), and the fixed one of older releases
_CHECKPOINT_TMP = re.compile(rf"\.{re.escape(CHECKPOINT_META)}\.tmp(-[0-9a-f]{{32}})?")
MAX_RECORD_BYTES = 64 * 2**20  # the most drl reads of a file not listed with its size (manifest, lock, checkpoint)
log = logging.getLogger(__name__)

STAGE_META = "stage.json"
STAGE_WEIGHTS = "weights.safetensors"
STATISTICS = "statistics.safetensors"
FORGET_LOG = "log.json"
FORGOTTEN_ROWS = "rows.safetensors"
# a file rewritten by the commit of generation G: <stem>-g<G, 6+ digits>.<suffix>
_REVISION = re.compile(r"(?P<stem>[a-z]+)(?:-g(?P<generation>[0-9]{6,}))?\.(?P<suffix>json|safetensors)")


T = TypeVar("T")


class ListedFileGone(IntegrityError):
    """A file the manifest lists is not there (see ``RunDir.read_generation``)."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stage_dir(index: int) -> str:
    """The run-relative folder of stage ``index`` (1-based): ``stages/NNN``."""
    return f"{STAGES}/{index:03d}"


def revision(name: str, generation: int | None) -> str:
    """``name`` as written by the commit of ``generation`` (``weights.safetensors`` ->
    ``weights-g000007.safetensors``); ``name`` itself for None."""
    if generation is None:
        return name
    stem, _, suffix = name.partition(".")
    return f"{stem}-g{generation:06d}.{suffix}"


def stage_file(index: int, name: str, *, generation: int | None = None) -> str:
    """The run-relative name of one of stage ``index``'s files (``STAGE_META``, ``STAGE_WEIGHTS``...);
    with ``generation``, the name that commit rewrites it under (``STAGE_WEIGHTS`` and ``STATISTICS``)."""
    return f"{stage_dir(index)}/{revision(name, generation)}"


def forget_log_file(generation: int) -> str:
    """The forget log as the commit of ``generation`` writes it."""
    return f"{FORGOTTEN}/{revision(FORGET_LOG, generation)}"


def forgotten_rows_file(generation: int) -> str:
    """The slices the forget of ``generation`` took out of the stage files."""
    return f"{FORGOTTEN}/{revision(FORGOTTEN_ROWS, generation)}"


def current_file(manifest: dict[str, Any], name: str) -> str | None:
    """The listed version of a file that commits may rewrite (``stage_file(i, STAGE_WEIGHTS)``,
    ``f"{FORGOTTEN}/{FORGET_LOG}"``): the name itself or one revision of it; None when none is listed."""
    folder, _, base = name.rpartition("/")
    stem, _, suffix = base.partition(".")
    found = []
    for listed in manifest["files"]:
        parent, _, leaf = listed.rpartition("/")
        match = _REVISION.fullmatch(leaf) if parent == folder else None
        if match and match["stem"] == stem and match["suffix"] == suffix:
            found.append(listed)
    if len(found) > 1:
        raise IntegrityError(
            f"{MANIFEST} lists {len(found)} versions of {name} ({', '.join(sorted(found))}); the run is damaged: "
            "restore it from a backup"
        )
    return found[0] if found else None


def _supersedable(name: str) -> bool:
    """Whether ``name`` is a file a commit may supersede: a stage's weights or statistics, or a forget file."""
    parts = PurePosixPath(name).parts
    match = _REVISION.fullmatch(parts[-1]) if parts else None
    if match is None or len(parts) not in (2, 3):
        return False
    if parts[0] == FORGOTTEN and len(parts) == 2:
        return f"{match['stem']}.{match['suffix']}" in (FORGET_LOG, FORGOTTEN_ROWS)
    return (
        parts[0] == STAGES
        and len(parts) == 3
        and re.fullmatch(r"[0-9]{3,}", parts[1]) is not None
        and f"{match['stem']}.{match['suffix']}" in (STAGE_WEIGHTS, STATISTICS)
    )


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
            data = jsonio.loads(read_nofollow(path))
        except (OSError, ValueError) as exc:
            raise IntegrityError(f"{path} is unreadable or damaged ({exc}); restore it from a backup") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise IntegrityError(f"{path} is not a drl manifest; restore it from a backup")
        version = data.get("format_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise IntegrityError(
                f"run {self.path} has format version {version}, this drl reads versions "
                f"{' and '.join(map(str, READABLE_VERSIONS))}; use the drl release that wrote it"
            )
        if not _well_formed(data):
            raise IntegrityError(
                f"{path} is malformed (files, stages, generation or superseded of the wrong type); restore it "
                "from a backup"
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
        """A listed file's bytes, after checking its size (before reading: never more than the
        manifest lists) and sha256 against the manifest. A listed file that is gone is
        ``ListedFileGone``: damage, or a writer that superseded it after this reader took its
        manifest (``read_generation`` tells them apart)."""
        manifest = manifest or self.manifest()
        entry = manifest["files"].get(name)
        if entry is None:
            raise IntegrityError(f"{name} is not listed in {self.path / MANIFEST}; the run is incomplete")
        path = self._inside(name)
        try:
            data = read_nofollow(path, limit=entry["bytes"])
        except FileNotFoundError:
            raise ListedFileGone(
                f"{path} is missing: the run is damaged, or another drl process changed it while this one "
                "read it; re-run the command, and if it persists check the run with `drl verify`"
            ) from None
        except OSError as exc:
            raise IntegrityError(f"{path} is unreadable ({exc.strerror}); restore it from a backup") from exc
        if len(data) != entry["bytes"] or sha256_bytes(data) != entry["sha256"]:
            raise IntegrityError(f"{path} is damaged (checksum mismatch); restore it from a backup")
        return data

    def read_generation(self, read: Callable[[dict[str, Any]], T], *, attempts: int = 20) -> T:
        """``read(manifest)`` against one whole generation of the run. A committed file is never
        changed, but a commit that supersedes files (``drl forget``) deletes them once its new
        manifest is in place: a reader that took the older manifest then finds one gone. It reads
        again from the newer manifest; only a file gone while the generation stays is damage."""
        for attempt in range(attempts):
            manifest = self.manifest()
            try:
                return read(manifest)
            except ListedFileGone:
                if attempt == attempts - 1 or self.manifest()["generation"] == manifest["generation"]:
                    raise
        raise AssertionError("unreachable")

    def parsed(self, name: str, manifest: dict[str, Any] | None, parse: Callable[[bytes], Any]) -> Any:
        """A listed file, checksummed, then parsed into a mapping. A file whose checksum matches but
        whose content does not parse (or is no mapping) was crafted or damaged before it was listed."""
        data = self.read_bytes(name, manifest)
        try:
            value = parse(data)
        except (ValueError, SafetensorError, RecursionError, MemoryError) as exc:  # UnicodeDecodeError: a ValueError
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise IntegrityError(f"{self.path / name} cannot be parsed ({reason}); restore it from a backup") from exc
        if not isinstance(value, dict):
            raise IntegrityError(
                f"{self.path / name} holds a {type(value).__name__} where a mapping belongs; restore it from a backup"
            )
        return value

    def run_config(self, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.parsed(RUN_CONFIG, manifest, jsonio.load_yaml)

    def has_ptm_weights(self, manifest: dict[str, Any] | None = None) -> bool:
        return PTM_WEIGHTS in (manifest or self.manifest())["files"]

    def ptm_weights(self, manifest: dict[str, Any] | None = None) -> dict[str, Tensor]:
        return self.parsed(PTM_WEIGHTS, manifest, decode_tensors)

    def stage_indices(self, manifest: dict[str, Any] | None = None) -> list[int]:
        return list((manifest or self.manifest())["stages"])

    def stage_meta(self, index: int, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.parsed(stage_file(index, STAGE_META), manifest, jsonio.loads)

    def stage_file_name(self, index: int, name: str, manifest: dict[str, Any] | None = None) -> str | None:
        """The listed version of stage ``index``'s ``name`` (``STAGE_WEIGHTS``, ``STATISTICS``), or None."""
        return current_file(manifest or self.manifest(), stage_file(index, name))

    def stage(self, index: int, manifest: dict[str, Any] | None = None) -> StageRecord:
        manifest = manifest or self.manifest()
        meta = self.stage_meta(index, manifest)
        weights = self.stage_file_name(index, STAGE_WEIGHTS, manifest) or stage_file(index, STAGE_WEIGHTS)
        tensors = self.parsed(weights, manifest, decode_tensors)  # an unlisted name: "the run is incomplete"
        return StageRecord(index, meta, tensors)

    def stage_statistics(self, index: int, manifest: dict[str, Any] | None = None) -> dict[str, Tensor]:
        """A stage's statistics file (empty when the stage has none)."""
        manifest = manifest or self.manifest()
        name = self.stage_file_name(index, STATISTICS, manifest)
        return self.parsed(name, manifest, decode_tensors) if name is not None else {}

    def forget_log_name(self, manifest: dict[str, Any] | None = None) -> str | None:
        """The listed forget log, or None when no class was ever forgotten."""
        return current_file(manifest or self.manifest(), f"{FORGOTTEN}/{FORGET_LOG}")

    def forget_log(self, manifest: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The forget log (``forget.py`` reads it), or None when no class was ever forgotten."""
        manifest = manifest or self.manifest()
        name = self.forget_log_name(manifest)
        return self.parsed(name, manifest, jsonio.loads) if name is not None else None

    def forgotten_rows(self, generation: int, manifest: dict[str, Any] | None = None) -> dict[str, Tensor]:
        """The slices the forget of ``generation`` kept (IntegrityError when the manifest does not list them)."""
        return self.parsed(forgotten_rows_file(generation), manifest, decode_tensors)

    def stages(self, manifest: dict[str, Any] | None = None) -> list[StageRecord]:
        manifest = manifest or self.manifest()
        return [self.stage(i, manifest) for i in self.stage_indices(manifest)]

    def verify(self) -> list[str]:
        """Every problem found (empty when the run is intact): version, files, checksums, and that
        each file parses as what its name says (JSON, YAML, tensors of dtypes drl writes)."""
        try:
            return self.read_generation(self.problems)
        except (IntegrityError, RunStateError) as exc:
            return [str(exc)]

    def problems(
        self, manifest: dict[str, Any], *, progress: Callable[[int, int, str], None] | None = None
    ) -> list[str]:
        """``verify`` of one manifest's files; ``ListedFileGone`` propagates (see ``read_generation``).
        ``progress(step, total, name)`` before each file."""
        problems = []
        for step, name in enumerate(manifest["files"]):
            if progress is not None:
                progress(step, len(manifest["files"]), name)
            parse = _PARSERS.get(PurePosixPath(name).suffix, _raw)
            try:
                self.parsed(name, manifest, parse)
            except ListedFileGone as exc:
                if self.manifest()["generation"] != manifest["generation"]:
                    raise  # superseded meanwhile: read_generation reads the newer generation
                problems.append(str(exc))
            except IntegrityError as exc:
                problems.append(str(exc))
        return problems

    def checkpoint(self) -> tuple[dict[str, Any], dict[str, Tensor]] | None:
        """The interrupted stage's last epoch (meta, tensors); None if absent, or if damaged (a
        warning says so: the stage then starts over). The meta carries the sha256 of its own
        content and that of the tensors file, so no byte of either is used unchecked."""
        folder = self.path / CHECKPOINT
        try:
            if not real_dir(folder) or not os.path.lexists(folder / CHECKPOINT_META):
                return None
            meta = _checked_meta(read_nofollow(folder / CHECKPOINT_META))
            name = meta["tensors"]["file"]
            if not _CHECKPOINT_TENSORS.fullmatch(name):
                raise ValueError(f"it names the tensors file {name!r}")
            data = read_nofollow(folder / name, limit=2**40)
            if sha256_bytes(data) != meta["tensors"]["sha256"]:
                raise ValueError("its tensors file does not match its checksum")
            return meta, decode_tensors(data)
        except (OSError, ValueError, KeyError, TypeError, SafetensorError, IntegrityError) as exc:
            log.warning(
                "the epoch checkpoint in %s is damaged or unreadable (%s); it is not used: an interrupted stage "
                "starts over",
                folder,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
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
        created = create and not os.path.lexists(self.path)  # a failed init removes what it made
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
            if created and not os.path.lexists(self.path / MANIFEST):  # init failed: no folder left behind
                storage.discard(lock_path)
                storage.remove_dir_if_empty(self.path / STAGING)
                storage.remove_dir_if_empty(self.path)


def _well_formed(manifest: dict[str, Any]) -> bool:
    """The manifest's fields have the types this module reads (a crafted one may not). A superseded
    file is one a commit may supersede and is no longer listed: nothing else is ever deleted by it."""
    files, stages = manifest.get("files"), manifest.get("stages")
    superseded = manifest.get("superseded", [])
    return (
        _is_int(manifest.get("generation"))
        and isinstance(files, dict)
        and isinstance(stages, list)
        and all(_is_int(i) and i > 0 for i in stages)
        and all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) and _is_int(e.get("bytes")) for e in files.values()
        )
        and isinstance(superseded, list)
        and all(isinstance(n, str) and _supersedable(n) and n not in files for n in superseded)
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
        info = jsonio.loads(data) if data else {}
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
        manifest = self.run.manifest()
        self.delete_superseded(manifest)  # first: a superseded file must go, never into the quarantine
        unlisted = f"not listed in {MANIFEST}: left by an interrupted commit or a restored older manifest"
        self._tidy(STAGES, keep=lambda name: f"{STAGES}/{name}" in listed, delete=_never, why=unlisted)
        for folder in sorted(listed) + [FORGOTTEN]:  # files an interrupted commit renamed into place
            self._tidy(
                folder, keep=lambda name, f=folder: f"{f}/{name}" in manifest["files"], delete=_never, why=unlisted
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
        """Replace the checkpoint atomically: tensors under a fresh name, then the meta (with the
        tensors' sha256 and its own) by rename from a fresh temporary name."""
        folder = self.run.path / CHECKPOINT
        data = encode_tensors(tensors)
        name = f"{uuid.uuid4().hex}.safetensors"
        try:
            real_dir(folder, create=True)
            storage.write_new(folder / name, data)
            full = {**meta, "tensors": {"file": name, "sha256": sha256_bytes(data)}}
            storage.write_atomic(folder / CHECKPOINT_META, seal_checkpoint(full))
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
        supersede: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """Publish ``files`` (run-relative name → bytes; names must be new) with a new manifest.
        ``supersede``: listed files the new manifest drops (a stage file rewritten under a new name,
        an old forget file); they are deleted once the new manifest is in place."""
        old_files = dict(manifest["files"]) if manifest else {}
        clash = sorted(set(files) & set(old_files))
        if clash:
            raise RunStateError(f"{clash[0]} is already committed; committed files are never rewritten")
        unknown = [name for name in supersede if name not in old_files or not _supersedable(name)]
        if unknown:
            raise RunStateError(f"{unknown[0]} is not a committed file a commit may supersede")
        finals = {name: self.run._inside(name) for name in files}  # refuses names escaping the run, links
        staging = self.run.path / STAGING / uuid.uuid4().hex
        placed: list[Path] = []  # files moved into place; taken back unless the manifest is replaced
        data = None
        try:
            make_dirs(self.run.path, PurePosixPath(STAGING, staging.name))
            entries = self._place(files, staging, finals, placed)
            new_manifest = _next_manifest(manifest, entries, new_stage, supersede)
            data = encode_json(new_manifest)
            storage.write_atomic(self.run.path / MANIFEST, data, tmp=staging / MANIFEST)  # the commit point
        except OSError as exc:
            raise self._commit_error(exc, published=self._published(data)) from exc
        finally:
            if not self._published(data):
                _take_back(placed, self.run.path)
            storage.discard(staging)
            storage.remove_dir_if_empty(self.run.path / STAGING)
        self.delete_superseded(new_manifest)
        return new_manifest

    def delete_superseded(self, manifest: dict[str, Any]) -> None:
        """Delete the files ``manifest``'s commit superseded (its ``superseded`` list): done by that
        commit itself, and again by the next writer when a crash came first."""
        names = manifest.get("superseded", [])
        try:
            paths = [self.run._inside(name) for name in names]
            gone = [path for path in paths if os.path.lexists(path)]
            for path in gone:
                storage.remove(path)
            for parent in {path.parent for path in gone}:
                storage.fsync_dir(parent)
        except OSError as exc:
            raise StorageError(
                f"the new state of {self.run.path} is committed, but deleting the files it superseded failed "
                f"({exc.strerror or exc}); any later drl command that writes to the run deletes them: re-run this one"
            ) from exc

    def _place(
        self, files: dict[str, bytes], staging: Path, finals: dict[str, Path], placed: list[Path]
    ) -> dict[str, dict[str, Any]]:
        """Write ``files`` into ``staging``, fsynced, then rename each to its final name (recorded in
        ``placed``), and fsync the folders they landed in. Returns their manifest entries."""
        entries = {}
        for name, data in files.items():
            rel = PurePosixPath(name)
            storage.write_new(make_dirs(staging, rel.parent) / rel.name, data)
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


def _next_manifest(
    manifest: dict[str, Any] | None, entries: dict[str, Any], new_stage: int | None, supersede: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The manifest after a commit: one generation on, the new files (and stage) listed, the
    superseded ones dropped and named (deleted next)."""
    stages = list(manifest["stages"]) if manifest else []
    if new_stage is not None:
        stages.append(new_stage)
    kept = {k: v for k, v in (manifest["files"] if manifest else {}).items() if k not in supersede}
    files = {**kept, **entries}
    new = {
        "format": FORMAT,
        "format_version": format_version(files),
        "generation": (manifest["generation"] + 1) if manifest else 1,
        "committed": _now(),
        "stages": stages,
        "files": files,
    }
    if supersede:
        new["superseded"] = sorted(supersede)
    return new


def format_version(files: dict[str, Any]) -> int:
    """2 once the run lists a forget file (older releases must refuse it, not misread it), else 1."""
    return FORGET_FORMAT_VERSION if any(name.startswith(f"{FORGOTTEN}/") for name in files) else FORMAT_VERSION


def _never(_: str) -> bool:
    return False


def _is_checkpoint_file(name: str) -> bool:
    return name == CHECKPOINT_META or bool(_CHECKPOINT_TMP.fullmatch(name) or _CHECKPOINT_TENSORS.fullmatch(name))


def seal_checkpoint(meta: dict[str, Any]) -> bytes:
    """The checkpoint meta as written: its fields and ``sha256``, the checksum of the rest."""
    return encode_json({**meta, "sha256": sha256_bytes(encode_json(meta))})


def _checked_meta(data: bytes) -> dict[str, Any]:
    """The checkpoint meta ``seal_checkpoint`` wrote; ``ValueError`` when its checksum does not match
    (a changed byte, or a checkpoint of a release that wrote none)."""
    meta = jsonio.loads(data)
    if not isinstance(meta, dict):
        raise ValueError("it is not a mapping")
    claimed = meta.pop("sha256", None)
    if claimed != sha256_bytes(encode_json(meta)):
        raise ValueError("its content does not match its checksum")
    return meta


def _raw(data: bytes) -> dict[str, Any]:
    return {}


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


# the dtypes drl writes; a crafted file's float8 or complex tensor would pass every finite check
# (complex is not floating point to torch) and crash or mislead the maths that reads it
TENSOR_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool}
)


def decode_tensors(data: bytes) -> dict[str, Tensor]:
    """A safetensors file's tensors; ``ValueError`` for a tensor of a dtype drl never writes."""
    tensors = st_load(data)
    for name, tensor in tensors.items():
        if tensor.dtype not in TENSOR_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which drl never writes")
    return tensors


# how ``verify`` parses a listed file, by suffix
_PARSERS: dict[str, Callable[[bytes], Any]] = {
    ".json": jsonio.loads,
    ".yaml": jsonio.load_yaml,
    ".safetensors": decode_tensors,
}


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
            record = jsonio.load_yaml(read_nofollow(path))
        except (OSError, ValueError, IntegrityError):
            return False
        return isinstance(record, dict) and record.get("kind") == RUN_CONFIG_KIND
    return False
