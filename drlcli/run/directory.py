"""``RunDir``: read access to a run directory (the manifest, listed files checked on every read,
one whole generation at a time) and its one write handle (``writer()``, under the lock)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from safetensors import SafetensorError
from torch import Tensor

from .. import jsonio, storage
from ..errors import IntegrityError, RunStateError, StorageError
from .access import check_path, no_run, read_nofollow, real_dir
from .checkpoint import read_checkpoint
from .files import decode_tensors, parser_for
from .layout import (
    CHECKPOINT,
    FORGET_LOG,
    FORGOTTEN,
    FORMAT,
    FROZEN_TRACK,
    LOCK,
    MANIFEST,
    OWN_FOLDERS,
    PTM_WEIGHTS,
    READABLE_VERSIONS,
    RESERVED,
    RUN_CONFIG,
    STAGE_META,
    STAGE_WEIGHTS,
    STAGING,
    STATISTICS,
    TOTALS,
    current_file,
    forgotten_rows_file,
    sha256_bytes,
    stage_dir,
    stage_file,
    supersedable,
    track_name,
)
from .lock import acquire, refuse_existing, require_locks
from .writer import RunWriter

log = logging.getLogger(__name__)


T = TypeVar("T")


class ListedFileGone(IntegrityError):
    """A file the manifest lists is not there (see ``RunDir.read_generation``)."""


def _gone(path: Path) -> ListedFileGone:
    return ListedFileGone(
        f"{path} is missing: the run is damaged, or another drl process changed it while this one "
        "read it; re-run the command, and if it persists check the run with `drl verify`"
    )


def read_pinned(fd: int, path: Path, entry: dict[str, Any]) -> bytes:
    """A pinned file's bytes (``RunDir._pinning``), with ``read_nofollow``'s checks."""
    try:
        return storage.read_open(fd, path, limit=entry["bytes"], what="run file")
    except ValueError as exc:
        raise IntegrityError(f"{exc}; remove it or restore the run from a backup") from None


@dataclass(frozen=True)
class StageRecord:
    """One committed stage as read back: its metadata and its tensors."""

    index: int
    meta: dict[str, Any]
    tensors: dict[str, Tensor]  # its weights file
    totals: dict[str, Tensor] = field(default_factory=dict)  # its totals file (the newest stage's only)

    @property
    def merged(self) -> dict[str, Tensor]:
        """Its weights and totals together: what the heads read of it."""
        return {**self.tensors, **self.totals} if self.totals else self.tensors


class RunDir:
    """Read access to a run directory; ``writer()`` gives the one write handle."""

    def __init__(self, path: Path | str, *, nested: bool = False):
        self.path = Path(path)
        self._pinned: dict[str, int] = {}  # name -> descriptor, while read_generation reads (``_pinning``)
        self._nested = nested  # a switched run's frozen track, read through that run (``track.py``)

    def _refuse_track(self) -> None:
        """A run's frozen track handed as a run of its own (``--run RUN/frozen``) is refused: it is
        read and written only through its run, in that run's commits."""
        if not self._nested and self.path.name == FROZEN_TRACK and os.path.lexists(self.path.parent / MANIFEST):
            raise RunStateError(
                f"{self.path} is the frozen track of run {self.path.parent}, read and written only through that "
                f"run: pass --run {self.path.parent}"
            )

    # ------------------------------------------------------------------ reading

    def exists(self) -> bool:
        return os.path.lexists(self.path / MANIFEST)  # a link there is refused by manifest(), not ignored

    def manifest(self) -> dict[str, Any]:
        self._refuse_track()
        path = self.path / MANIFEST
        if not self.path.is_dir() or not os.path.lexists(path):
            raise no_run(self.path)
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
                f"{', '.join(map(str, READABLE_VERSIONS))}; use the drl release that wrote it"
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
            pinned = self._pinned.get(name)
            data = read_nofollow(path, limit=entry["bytes"]) if pinned is None else read_pinned(pinned, path, entry)
        except FileNotFoundError:
            raise _gone(path) from None
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
                with self._pinning(manifest):
                    return read(manifest)
            except ListedFileGone:
                if attempt == attempts - 1 or self.manifest()["generation"] == manifest["generation"]:
                    raise
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _pinning(self, manifest: dict[str, Any]) -> Iterator[None]:
        """Open every listed file a later commit may supersede (and so delete) first, and read them
        through those descriptors for the block: the generation's bytes stay readable even once
        deleted, so a reader is never starved by commits that come faster than its whole read. A
        file gone before it was opened is ``ListedFileGone`` (``read_generation`` takes the newer
        manifest); past the process's descriptor limit the rest are read by name, as before."""
        fds: dict[str, int] = {}
        try:
            for name in manifest["files"]:
                if supersedable(name):
                    path = self._inside(name)
                    try:
                        fds[name] = storage.open_nofollow(path, os.O_RDONLY | os.O_NONBLOCK)
                    except FileNotFoundError:
                        raise _gone(path) from None
                    except OSError:  # EMFILE, or a file that read_bytes will report on by name
                        break
            self._pinned = fds
            yield
        finally:
            self._pinned = {}
            for fd in fds.values():
                os.close(fd)

    def parsed(self, name: str, manifest: dict[str, Any] | None, parse: Callable[[bytes], Any]) -> Any:
        """A listed file, checksummed, then parsed into a mapping. A file whose checksum matches but
        whose content does not parse (or is no mapping) was crafted or damaged before it was listed."""
        data = self.read_bytes(name, manifest)
        try:
            value = parse(data)
        except (ValueError, SafetensorError, RecursionError, MemoryError) as exc:  # UnicodeDecodeError: a ValueError
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise IntegrityError(f"{self.shown(name)} cannot be parsed ({reason}); restore it from a backup") from exc
        if not isinstance(value, dict):
            raise IntegrityError(
                f"{self.shown(name)} holds a {type(value).__name__} where a mapping belongs; restore it from a backup"
            )
        return value

    def shown(self, name: str) -> Path:
        """Where the listed file ``name`` lies, for a message (unchecked: never opened)."""
        return self.path / name

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
        name = self.stage_file_name(index, TOTALS, manifest)
        totals = self.parsed(name, manifest, decode_tensors) if name is not None else {}
        clash = sorted(set(totals) & set(tensors))
        if clash:
            raise IntegrityError(
                f"stage {index} of run {self.path} holds {clash[0]} twice (weights and totals); restore it from a backup"
            )
        return StageRecord(index, meta, tensors, totals)

    def stage_statistics(self, index: int, manifest: dict[str, Any] | None = None) -> dict[str, Tensor]:
        """A stage's statistics file (empty when the stage has none)."""
        manifest = manifest or self.manifest()
        name = self.stage_file_name(index, STATISTICS, manifest)
        return self.parsed(name, manifest, decode_tensors) if name is not None else {}

    def totals_files(self, manifest: dict[str, Any] | None = None) -> tuple[str, ...]:
        """The listed totals files (the newest stage's; an interrupted upgrade never leaves two)."""
        manifest = manifest or self.manifest()
        names = (self.stage_file_name(i, TOTALS, manifest) for i in self.stage_indices(manifest))
        return tuple(name for name in names if name is not None)

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
            parse = parser_for(name)
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
        warning says so: the stage then starts over)."""
        return read_checkpoint(self.path / CHECKPOINT)

    def size_bytes(self, manifest: dict[str, Any] | None = None, prefix: str = "") -> int:
        files = (manifest or self.manifest())["files"]
        return sum(e["bytes"] for n, e in files.items() if n.startswith(prefix))

    def stage_bytes(self, index: int, manifest: dict[str, Any] | None = None) -> int:
        """Bytes on disk of stage ``index``'s files (parameters, prototypes, metadata, statistics),
        not counting a switched run's frozen track's beside them (format 5, ``track.py``)."""
        files, folder = (manifest or self.manifest())["files"], f"{stage_dir(index)}/"
        return sum(e["bytes"] for n, e in files.items() if n.startswith(folder) and track_name(n) is None)

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
        self._refuse_track()
        require_locks(self.path)
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
        fd = acquire(lock_path, self.path)
        try:
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
    if not (_is_int(manifest.get("generation")) and isinstance(files, dict) and isinstance(stages, list)):
        return False
    if not (all(map(_is_entry, files.values())) and all(_is_int(i) and i > 0 for i in stages)):
        return False
    return isinstance(superseded, list) and all(_deletable(n, files) for n in superseded)


def _is_entry(entry: Any) -> bool:
    """A manifest entry: {"sha256": str, "bytes": int}."""
    return isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _is_int(entry.get("bytes"))


def _deletable(name: Any, files: dict[str, Any]) -> bool:
    return isinstance(name, str) and supersedable(name) and name not in files


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
