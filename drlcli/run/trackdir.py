"""Where a switched run keeps its frozen track (``track.py``) and how it is read and written as a
run of its own: ``TrackDir`` and ``TrackWriter``, the one place the track's names are mapped onto
the run's. Every file of the track is the run's, listed in the run's manifest and published by the
run's commits. By the run's format (``track_format``):

- format 5 (``FLAT``): its stage and forget files beside the run's, each name's leaf prefixed
  (``layout.track_file``: ``stages/001/frozen-stage.json``, ``forgotten/frozen-log-g000004.json``);
  its run.yaml derived from the run's (``derived_config``: the config run.yaml records under
  ``TRACK_CONFIG``), its PTM weights the run's own. No nested run, no second config.
- format 4 (``NESTED``): the same files under ``frozen/``, with a run.yaml (and a --random-init run's
  PTM weights) of their own.
- before format 4 (``OWN``): ``frozen/`` as a run directory of its own (its own manifest), read as
  it is until ``track.adopt_track`` lists its files in the run's manifest (format 4).

A run stays in the format it has: nothing is copied or renamed, and a format-4 run stays readable
by the release that wrote it."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import IntegrityError, RunStateError, UsageError
from .access import real_dir
from .directory import RunDir
from .files import encode_yaml
from .layout import (
    FORMAT,
    FROZEN_TRACK,
    MANIFEST,
    PTM_WEIGHTS,
    RUN_CONFIG,
    RUN_CONFIG_KIND,
    STAGE_META,
    STAGES,
    TRACK_CONFIG,
    TRACK_LEAF,
    TRACK_PREFIX,
    format_version,
    sha256_bytes,
    track_file,
    track_name,
)
from .records import read_record
from .writer import RunWriter, next_manifest

# where a switched run keeps its frozen track: the run-directory format that put it there
FLAT, NESTED, OWN = 5, 4, 3

_STAGE_META = re.compile(rf"{STAGES}/([0-9]{{3,9}})/{re.escape(STAGE_META)}")


def track_format(run: RunDir, manifest: dict[str, Any]) -> int:
    """How the run keeps its frozen track: ``FLAT`` (format 5; also a run with no track file yet),
    ``NESTED`` (format 4) or ``OWN`` (before format 4: ``frozen/`` holds a manifest, the run's lists
    none of its files and its run.yaml no ``TRACK_CONFIG``). A manifest listing the track both ways
    is crafted: IntegrityError."""
    flat = any(track_name(name) is not None for name in manifest["files"])
    nested = any(name.startswith(TRACK_PREFIX) for name in manifest["files"])
    if flat and nested:
        raise IntegrityError(
            f"run {run.path} lists its frozen track's files twice (under {TRACK_PREFIX} and as "
            f"{STAGES}/NNN/{TRACK_LEAF}*); restore the run from a backup"
        )
    if nested:
        return NESTED
    if flat or not os.path.lexists(run.path / FROZEN_TRACK / MANIFEST):
        return FLAT
    # a run made for format 5 (its run.yaml records the track's config) has not yet learned a stage:
    # a frozen/ beside it is not its track, whatever it holds
    return FLAT if TRACK_CONFIG in run.run_config(manifest) else OWN


def _nested_name(name: str) -> str | None:
    return name[len(TRACK_PREFIX) :] if name.startswith(TRACK_PREFIX) else None


def track_manifest(manifest: dict[str, Any], *, derived: dict[str, Any] | None = None) -> dict[str, Any]:
    """The frozen track's files of the run's ``manifest``, as a manifest of the track's own (its
    names; its stages: those whose stage.json it lists): format 4's under ``frozen/``, or with
    ``derived`` (the entries of its derived run.yaml and of the run's PTM weights) format 5's."""
    name_of = _nested_name if derived is None else track_name
    files = {own: e for name, e in manifest["files"].items() if (own := name_of(name)) is not None}
    files.update(derived or {})
    stages = sorted(int(m[1]) for m in map(_STAGE_META.fullmatch, files) if m is not None)
    superseded = [own for name in manifest.get("superseded", []) if (own := name_of(name)) is not None]
    return {
        "format": FORMAT,
        "format_version": format_version(files),
        "generation": manifest["generation"],
        "committed": manifest.get("committed"),
        "stages": stages,
        "files": files,
        "superseded": superseded,
    }


def owned_bytes(manifest: dict[str, Any]) -> int:
    """Bytes of the run's files that are its frozen track's own (not its derived run.yaml, not the
    run's PTM weights it reads)."""
    owned = (n for n in manifest["files"] if track_name(n) is not None or n.startswith(TRACK_PREFIX))
    return sum(manifest["files"][name]["bytes"] for name in owned)


class TrackDir(RunDir):
    """A switched run's frozen track, read from one generation of the run (``manifest``) and written
    through the run's writer (``writer``): its every file is the run's, checked by the run's manifest,
    named through ``run_name`` (format 5, or with ``in_folder`` format 4's ``frozen/``)."""

    def __init__(self, run: RunDir, manifest: dict[str, Any], writer: RunWriter | None = None, *, in_folder: bool):
        super().__init__(run.path / FROZEN_TRACK if in_folder else run.path, nested=True)
        self.parent, self._held, self._writer, self.in_folder = run, manifest, writer, in_folder
        self._config: bytes | None = None

    def run_name(self, name: str, *, write: bool = False) -> str:
        """The run's name of the track's file ``name``. Format 5 maps only stage and forget files
        (and, to read, the run's PTM weights) onto names no file of the run's own takes, so that
        neither track reads the other's files; anything else is refused."""
        if self.in_folder:
            return TRACK_PREFIX + name
        mapped = track_file(name)
        if mapped is None or (write and mapped == PTM_WEIGHTS):
            raise IntegrityError(
                f"the frozen track of run {self.parent.path} has no file {name!r} of its own; restore the run from a backup"
            )
        return mapped

    def exists(self) -> bool:
        return not self.in_folder or f"{TRACK_PREFIX}{RUN_CONFIG}" in self._held["files"]

    def manifest(self) -> dict[str, Any]:
        if not self.exists():
            raise IntegrityError(
                f"switched run {self.parent.path} has lost its frozen track ({self.path}); restore the run from a backup"
            )
        if self.in_folder:
            return track_manifest(self._held)
        config = self._derived()
        derived = {RUN_CONFIG: {"sha256": sha256_bytes(config), "bytes": len(config)}}
        if PTM_WEIGHTS in self._held["files"]:
            derived[PTM_WEIGHTS] = self._held["files"][PTM_WEIGHTS]
        return track_manifest(self._held, derived=derived)

    def _derived(self) -> bytes:
        """Format 5: the track's run.yaml, derived from the run's (checked by the run's manifest)."""
        if self._config is None:
            self._config = derived_config(self.parent, self._held)
        return self._config

    def read_bytes(self, name: str, manifest: dict[str, Any] | None = None) -> bytes:
        if self.in_folder or name != RUN_CONFIG:
            return super().read_bytes(name, manifest)
        data = self._derived()
        entry = (manifest or self.manifest())["files"].get(name)
        if entry is None or entry.get("sha256") != sha256_bytes(data):
            raise IntegrityError(f"{self.parent.shown(RUN_CONFIG)} changed while it was read; run the command again")
        return data

    def _inside(self, name: str) -> Path:
        return self.parent._inside(self.run_name(name))

    def shown(self, name: str) -> Path:
        if not self.in_folder and name == RUN_CONFIG:
            return self.parent.shown(RUN_CONFIG)
        return self.parent.shown(self.run_name(name))

    def checkpoint(self) -> None:
        """None: the track trains nothing; a stage it learned waits in the run's checkpoint."""
        return None

    @contextlib.contextmanager
    def writer(self, *, create: bool = False, allow_nonempty: bool = False) -> Iterator[RunWriter]:
        if self._writer is None:
            raise RunStateError(f"{self.path} is written only with its run {self.parent.path}, under its lock")
        writer = TrackWriter(self, self._writer)
        writer.clean_staging()
        yield writer


class TrackWriter(RunWriter):
    """The frozen track's writer: its commits are handed to the run's writer, whose next commit
    publishes them with the run's own (``RunWriter.defer``), under the run's names."""

    def __init__(self, track: TrackDir, run_writer: RunWriter):
        super().__init__(track)
        self._track, self._run_writer = track, run_writer

    def clean_staging(self) -> None:
        """Format 4: the track's folders tidied as a run's. Format 5: nothing, its files lie in the
        run's own folders, which the run's writer tidied."""
        if self._track.in_folder:
            super().clean_staging()

    def commit(
        self,
        files: dict[str, bytes],
        *,
        manifest: dict[str, Any] | None,
        new_stage: int | None = None,
        supersede: tuple[str, ...] = (),
        adopt: dict[str, dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        def name(own: str) -> str:
            return self._track.run_name(own, write=True)

        self._run_writer.defer({name(n): b for n, b in files.items()}, tuple(map(name, supersede)))
        entries = {name: {"sha256": sha256_bytes(data), "bytes": len(data)} for name, data in files.items()}
        return next_manifest(manifest, entries, new_stage, supersede)

    def save_checkpoint(self, meta: dict[str, Any], tensors: dict[str, Any]) -> None:
        raise RunStateError(f"the frozen track of run {self._track.parent.path} trains nothing; it keeps no checkpoint")

    def discard_checkpoint(self) -> None:
        """Nothing: the checkpoint is the run's, kept or discarded by the run's writer."""

    def delete_superseded(self, manifest: dict[str, Any]) -> None:
        """Nothing: the run's writer deletes what the run's commits superseded."""


def frozen_track(run: RunDir, manifest: dict[str, Any], *, writer: RunWriter | None = None) -> RunDir:
    """The run's frozen track: a ``TrackDir`` of ``manifest``, or for a run written before format 4
    that has not been written since, the track's run directory of its own (a link or file in its
    place is refused, IntegrityError, so that no command follows a crafted run outside its folder)."""
    kept = track_format(run, manifest)
    if kept == OWN:
        real_dir(run.path / FROZEN_TRACK)
        return RunDir(run.path / FROZEN_TRACK, nested=True)
    return TrackDir(run, manifest, writer, in_folder=kept == NESTED)


def track_record(record: dict[str, Any], config: RunConfig) -> dict[str, Any]:
    """A switched run's run.yaml as ``drl init`` writes it: ``record`` with its frozen track's config
    (``TRACK_CONFIG``: ``frozen_config``), from which the track's run.yaml is derived (format 5)."""
    return {**record, TRACK_CONFIG: frozen_config(config).to_dict()}


def derived_config(run: RunDir, manifest: dict[str, Any]) -> bytes:
    """Format 5: the frozen track's run.yaml, derived from the run's: the config its ``TRACK_CONFIG``
    records (a run.yaml without it: ``frozen_config`` of the run's), the run's PTM record, version
    and time, so that the same run.yaml always gives the same bytes."""
    record, config = read_record(run, manifest)
    held = record.get(TRACK_CONFIG)
    try:
        own = frozen_config(config) if held is None else RunConfig.from_dict(held)
    except UsageError as exc:
        raise IntegrityError(
            f"{run.shown(RUN_CONFIG)} records no valid frozen-track config ({exc}); restore it from a backup"
        ) from exc
    fields = {"drl_version": record.get("drl_version"), "created": record.get("created")}
    return encode_yaml({"kind": RUN_CONFIG_KIND, **fields, "ptm": record["ptm"], "config": own.to_dict()})


def frozen_config(config: RunConfig) -> RunConfig:
    """The frozen track's config: recipe ``frozen`` with the run's seed, workers and "unknown" answer."""
    train = {"seed": config.train.seed, "num_workers": config.train.num_workers}
    return RunConfig.for_recipe("frozen", {"train": train, "open_set": config.to_dict()["open_set"]})
