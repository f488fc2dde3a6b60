"""``RunWriter``: stages files and commits them atomically (see the folder's docstring); tidies what
interrupted writers left; keeps the epoch checkpoint. Only exists while the writer lock is held."""

from __future__ import annotations

import errno
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import storage
from ..errors import IntegrityError, RunStateError, StorageError
from .access import check_path, make_dirs, read_nofollow, real_dir
from .checkpoint import is_checkpoint_file, seal_checkpoint
from .files import encode_json, encode_tensors
from .layout import (
    CHECKPOINT,
    CHECKPOINT_META,
    FORGOTTEN,
    FORMAT,
    MANIFEST,
    QUARANTINE,
    STAGES,
    STAGING,
    STAGING_NAME,
    format_version,
    sha256_bytes,
    stage_dir,
    supersedable,
)
from .lock import now

if TYPE_CHECKING:
    from .directory import RunDir

log = logging.getLogger(__name__)


class RunWriter:
    """Stages files and commits them atomically. Only exists while the writer lock is held."""

    def __init__(self, run: RunDir):
        self.run = run
        self._quarantine: Path | None = None  # this writer's .quarantine/<time>/, made on first use
        # a switched run's frozen track's files and supersedes (run-relative names), published by
        # this writer's next commit (``defer``): the track and the run commit as one
        self._deferred: tuple[dict[str, bytes], list[str]] = ({}, [])

    def defer(self, files: dict[str, bytes], supersede: tuple[str, ...]) -> None:
        """Publish ``files`` and supersede ``supersede`` with the next ``commit`` (dropped with it)."""
        self._deferred[0].update(files)
        self._deferred[1].extend(supersede)

    def clean_staging(self) -> None:
        """Tidy what interrupted writers left. Only the run's own temporary names are deleted;
        unlisted stage folders and unknown names are moved to the quarantine, never deleted."""
        listed = {stage_dir(i) for i in self.run.stage_indices()} if self.run.exists() else set()
        self._tidy(STAGING, keep=_never, delete=STAGING_NAME.fullmatch, why="not a name drl writes there")
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
        self._tidy(CHECKPOINT, keep=is_checkpoint_file, delete=_never, why="not a name drl writes there")

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
        tensors' sha256 and its own) by rename from a fresh temporary name. What ``defer`` holds
        (a switched run's frozen track's stage) is kept in it too (``deferred_files``), so that a
        resumed stage does not learn it again."""
        folder = self.run.path / CHECKPOINT
        files, supersede = self._deferred
        if files:
            tensors = {
                **tensors,
                **{DEFERRED + n: torch.frombuffer(bytearray(b), dtype=torch.uint8) for n, b in files.items()},
            }
            meta = {
                **meta,
                "deferred": {"files": {n: sha256_bytes(b) for n, b in files.items()}, "supersede": supersede},
            }
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
        self._tidy(CHECKPOINT, keep=current.__contains__, delete=is_checkpoint_file, why="not a name drl writes there")

    def discard_checkpoint(self) -> None:
        self._tidy(CHECKPOINT, keep=_never, delete=is_checkpoint_file, why="not a name drl writes there")
        storage.remove_dir_if_empty(self.run.path / CHECKPOINT)

    def commit(
        self,
        files: dict[str, bytes],
        *,
        manifest: dict[str, Any] | None,
        new_stage: int | None = None,
        supersede: tuple[str, ...] = (),
        adopt: dict[str, dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Publish ``files`` (run-relative name → bytes; names must be new) with a new manifest, with
        what ``defer`` handed it. ``supersede``: listed files the new manifest drops (a stage file
        rewritten under a new name, an old forget file); they are deleted once the new manifest is in
        place. ``adopt``: files already in place, checked by the caller, listed as they are."""
        deferred, self._deferred = self._deferred, ({}, [])
        files, supersede = {**files, **deferred[0]}, (*supersede, *deferred[1])
        old_files = dict(manifest["files"]) if manifest else {}
        clash = sorted((set(files) | set(adopt or {})) & set(old_files))
        if clash:
            raise RunStateError(f"{clash[0]} is already committed; committed files are never rewritten")
        unknown = [name for name in supersede if name not in old_files or not supersedable(name)]
        if unknown:
            raise RunStateError(f"{unknown[0]} is not a committed file a commit may supersede")
        finals = {name: self.run._inside(name) for name in files}  # refuses names escaping the run, links
        staging = self.run.path / STAGING / uuid.uuid4().hex
        placed: list[Path] = []  # files moved into place; taken back unless the manifest is replaced
        data = None
        try:
            make_dirs(self.run.path, PurePosixPath(STAGING, staging.name))
            entries = {**(adopt or {}), **self._place(files, staging, finals, placed)}
            new_manifest = next_manifest(manifest, entries, new_stage, supersede)
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


DEFERRED = "deferred/"  # the checkpoint's tensors holding a deferred file's bytes


def deferred_files(meta: dict[str, Any], tensors: dict[str, Tensor]) -> tuple[dict[str, bytes], list[str]] | None:
    """What ``save_checkpoint`` kept of ``defer`` (files, supersede), each file's bytes checked against
    its sha256 in the sealed meta; None when it kept none or any of it does not check out."""
    held = meta.get("deferred")
    if not isinstance(held, dict) or not isinstance(held.get("files"), dict):
        return None
    supersede = held.get("supersede")
    if not isinstance(supersede, list) or not all(isinstance(n, str) for n in supersede):
        return None
    files = {}
    for name, sha in held["files"].items():
        tensor = tensors.get(DEFERRED + name)
        if tensor is None or tensor.dtype != torch.uint8 or tensor.dim() != 1:
            return None
        data = tensor.numpy().tobytes()
        if sha256_bytes(data) != sha:
            return None
        files[name] = data
    return files, supersede


def next_manifest(
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
        "committed": now(),
        "stages": stages,
        "files": files,
    }
    if supersede:
        new["superseded"] = sorted(supersede)
    return new


def _never(_: str) -> bool:
    return False


def _take_back(placed: list[Path], root: Path) -> None:
    """Undo a commit that failed before its manifest: remove the files it moved in (its own, new names)."""
    for path in placed:
        storage.discard(path)
        if path.parent != root:
            storage.remove_dir_if_empty(path.parent)
