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

Every file is immutable once listed in the manifest. A commit writes new files into
``.staging``, fsyncs them, renames them into place under names no committed file uses, then
replaces ``manifest.json`` by an atomic rename and fsyncs the directory. A crash at any moment
leaves the old manifest (and the old state) or the new one. Readers trust only files the manifest
lists, and verify their sha256 on every read. Nothing here is ever unpickled.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from .errors import IntegrityError, RunBusyError, RunStateError, StorageError

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
STATISTICS = "statistics.safetensors"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stage_dir(index: int) -> str:
    return f"{STAGES}/{index:03d}"


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
        return (self.path / MANIFEST).is_file()

    def manifest(self) -> dict[str, Any]:
        path = self.path / MANIFEST
        if not self.path.is_dir():
            raise RunStateError(
                f"run directory {self.path} does not exist; create it with `drl init --run {self.path}`"
            )
        if not path.is_file():
            raise RunStateError(f"{self.path} is not a drl run directory (no {MANIFEST}); create one with `drl init`")
        try:
            data = json.loads(path.read_text())
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
        return data

    def read_bytes(self, name: str, manifest: dict[str, Any] | None = None) -> bytes:
        """A listed file's bytes, after checking its size and sha256 against the manifest."""
        manifest = manifest or self.manifest()
        entry = manifest["files"].get(name)
        if entry is None:
            raise IntegrityError(f"{name} is not listed in {self.path / MANIFEST}; the run is incomplete")
        path = self._inside(name)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise IntegrityError(f"{path} is missing or unreadable ({exc.strerror}); restore it from a backup") from exc
        if len(data) != entry["bytes"] or sha256_bytes(data) != entry["sha256"]:
            raise IntegrityError(f"{path} is damaged (checksum mismatch); restore it from a backup")
        return data

    def run_config(self, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
        return yaml.safe_load(self.read_bytes(RUN_CONFIG, manifest))

    def has_ptm_weights(self, manifest: dict[str, Any] | None = None) -> bool:
        return PTM_WEIGHTS in (manifest or self.manifest())["files"]

    def ptm_weights(self, manifest: dict[str, Any] | None = None) -> dict[str, Tensor]:
        return st_load(self.read_bytes(PTM_WEIGHTS, manifest))

    def stage_indices(self, manifest: dict[str, Any] | None = None) -> list[int]:
        return list((manifest or self.manifest())["stages"])

    def stage_meta(self, index: int, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
        return json.loads(self.read_bytes(f"{stage_dir(index)}/stage.json", manifest))

    def stage(self, index: int, manifest: dict[str, Any] | None = None) -> StageRecord:
        manifest = manifest or self.manifest()
        base = stage_dir(index)
        meta = self.stage_meta(index, manifest)
        tensors = st_load(self.read_bytes(f"{base}/weights.safetensors", manifest))
        return StageRecord(index, meta, tensors)

    def stage_statistics(self, index: int, manifest: dict[str, Any] | None = None) -> dict[str, Tensor]:
        """A stage's statistics file (empty when the stage has none)."""
        manifest = manifest or self.manifest()
        name = f"{stage_dir(index)}/{STATISTICS}"
        return st_load(self.read_bytes(name, manifest)) if name in manifest["files"] else {}

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
            meta = json.loads((folder / CHECKPOINT_META).read_text())
            name = PurePosixPath(meta["tensors"]["file"]).name
            data = (folder / name).read_bytes()
            if sha256_bytes(data) != meta["tensors"]["sha256"]:
                return None
            return meta, st_load(data)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def size_bytes(self, manifest: dict[str, Any] | None = None, prefix: str = "") -> int:
        files = (manifest or self.manifest())["files"]
        return sum(e["bytes"] for n, e in files.items() if n.startswith(prefix))

    def _inside(self, name: str) -> Path:
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise IntegrityError(f"manifest entry {name!r} points outside the run directory; the run is damaged")
        return self.path.joinpath(*rel.parts)

    # ------------------------------------------------------------------ writing

    @contextlib.contextmanager
    def writer(self, *, create: bool = False) -> Iterator[RunWriter]:
        """Hold the writer lock for the block. Fails fast (RunBusyError) if another holds it."""
        if create:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"cannot create run directory {self.path}: {exc.strerror}") from exc
        elif not self.path.is_dir():
            self.manifest()  # raises the right "no run here" error
        lock_path = self.path / LOCK
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot open lock {lock_path}: {exc.strerror}") from exc
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
            os.pwrite(fd, json.dumps(holder).encode(), 0)
            writer = RunWriter(self)
            writer.clean_staging()
            yield writer
        finally:
            os.close(fd)  # releases the flock


def _holder(lock_path: Path) -> str:
    try:
        info = json.loads(lock_path.read_text())
        return f"pid {info['pid']} on {info['host']} (since {info['started']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RunWriter:
    """Stages files and commits them atomically. Only exists while the writer lock is held."""

    def __init__(self, run: RunDir):
        self.run = run

    def clean_staging(self) -> None:
        """Remove debris of interrupted writers: staging files and unlisted stage folders."""
        shutil.rmtree(self.run.path / STAGING, ignore_errors=True)
        if not self.run.exists():
            return
        listed = {stage_dir(i) for i in self.run.stage_indices()}
        stages_root = self.run.path / STAGES
        if stages_root.is_dir():
            for child in stages_root.iterdir():
                if f"{STAGES}/{child.name}" not in listed:
                    shutil.rmtree(child, ignore_errors=True)

    def save_checkpoint(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        """Replace the checkpoint atomically: tensors under a fresh name, then the meta by rename."""
        folder = self.run.path / CHECKPOINT
        data = encode_tensors(tensors)
        name = f"{uuid.uuid4().hex}.safetensors"
        try:
            folder.mkdir(exist_ok=True)
            write_durable(folder / name, data)
            full = {**meta, "tensors": {"file": name, "sha256": sha256_bytes(data)}}
            tmp = folder / f".{CHECKPOINT_META}.tmp"
            write_durable(tmp, encode_json(full))
            os.replace(tmp, folder / CHECKPOINT_META)
            _fsync_dir(folder)
        except OSError as exc:
            raise StorageError(
                f"writing the epoch checkpoint in {folder} failed ({exc.strerror or exc}); the committed "
                "state is intact" + ("; free some disk space" if exc.errno == errno.ENOSPC else "")
            ) from exc
        for old in folder.iterdir():  # superseded tensors and temp files
            if old.name not in (CHECKPOINT_META, name):
                old.unlink(missing_ok=True)

    def discard_checkpoint(self) -> None:
        shutil.rmtree(self.run.path / CHECKPOINT, ignore_errors=True)

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
        staging = self.run.path / STAGING / uuid.uuid4().hex
        entries = {}
        try:
            for name, data in files.items():
                target = staging / name
                target.parent.mkdir(parents=True, exist_ok=True)
                write_durable(target, data)
                entries[name] = {"sha256": sha256_bytes(data), "bytes": len(data)}
            for name in files:  # move into place; parents that appear are fsynced below
                final = self.run._inside(name)
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / name, final)
            for parent in {self.run._inside(n).parent for n in files} | {self.run.path}:
                _fsync_dir(parent)
            stages = list(manifest["stages"]) if manifest else []
            if new_stage is not None:
                stages.append(new_stage)
            new_manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "generation": (manifest["generation"] + 1) if manifest else 1,
                "committed": _now(),
                "stages": stages,
                "files": {**old_files, **entries},
            }
            tmp = staging / MANIFEST
            write_durable(tmp, (json.dumps(new_manifest, indent=1, sort_keys=True) + "\n").encode())
            os.replace(tmp, self.run.path / MANIFEST)  # the commit point
            _fsync_dir(self.run.path)
        except OSError as exc:
            raise StorageError(
                f"writing to {self.run.path} failed ({exc.strerror or exc}); nothing was committed, "
                "the previous state is intact" + ("; free some disk space" if exc.errno == errno.ENOSPC else "")
            ) from exc
        finally:
            shutil.rmtree(self.run.path / STAGING, ignore_errors=True)
        return new_manifest


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def encode_json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def encode_yaml(obj: Any) -> bytes:
    return yaml.safe_dump(obj, sort_keys=False).encode()


def encode_tensors(tensors: dict[str, Tensor]) -> bytes:
    return st_save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def stage_files(
    index: int, meta: dict[str, Any], tensors: dict[str, Tensor], statistics: dict[str, Tensor] | None = None
) -> dict[str, bytes]:
    base = stage_dir(index)
    files = {f"{base}/stage.json": encode_json(meta), f"{base}/weights.safetensors": encode_tensors(tensors)}
    if statistics:
        files[f"{base}/{STATISTICS}"] = encode_tensors(statistics)
    return files


def init_files(run_config: dict[str, Any], ptm_state: dict[str, Tensor] | None) -> dict[str, bytes]:
    files = {RUN_CONFIG: encode_yaml(run_config)}
    if ptm_state is not None:
        files[PTM_WEIGHTS] = encode_tensors(ptm_state)
    return files


RUN_CONFIG_KIND = "drl-run-config"


def refuse_existing(path: Path) -> None:
    """``init`` never overwrites a run or a user's file; leftovers of a crashed init are fine."""
    if (path / MANIFEST).exists():
        raise RunStateError(f"{path} already holds a drl run; pick another --run or remove it first")
    config = path / RUN_CONFIG
    if config.exists():
        try:
            ours = (yaml.safe_load(config.read_text()) or {}).get("kind") == RUN_CONFIG_KIND
        except (OSError, yaml.YAMLError, AttributeError):
            ours = False
        if not ours:
            raise RunStateError(f"{config} exists and is not drl's; use an empty --run directory")
