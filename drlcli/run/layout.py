"""The names inside a run directory (see the folder's docstring), and which versions of a
rewritable file the manifest lists."""

from __future__ import annotations

import hashlib
import re
from pathlib import PurePosixPath
from typing import Any

from ..errors import IntegrityError

FORMAT = "drl-run"


FORMAT_VERSION = 1  # a run without forget files; one with them is FORGET_FORMAT_VERSION


FORGET_FORMAT_VERSION = 2


TOTALS_FORMAT_VERSION = 3  # the newest stage carries the run's running totals (``TOTALS``)


# a switched run's frozen head inside the run's own manifest (``track.py``): one commit a stage
TRACK_FORMAT_VERSION = 4


# a switched run's frozen head in the run's own stage files (``TRACK_LEAF``): no nested run at all
FLAT_TRACK_FORMAT_VERSION = 5


READABLE_VERSIONS = (
    FORMAT_VERSION,
    FORGET_FORMAT_VERSION,
    TOTALS_FORMAT_VERSION,
    TRACK_FORMAT_VERSION,
    FLAT_TRACK_FORMAT_VERSION,
)


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


# a switched run's frozen track (``track.py``) in format 4: the frozen default's files, listed in the
# run's own manifest under this folder (a run written before format 4 kept a manifest of its own there)
FROZEN_TRACK = "frozen"


TRACK_PREFIX = f"{FROZEN_TRACK}/"


# format 5: the frozen track's stage and forget files in the run's own folders, their names prefixed
# (``stages/001/frozen-stage.json``, ``forgotten/frozen-log-g000004.json``; ``track_file``)
TRACK_LEAF = f"{FROZEN_TRACK}-"


# every name a run keeps at its top level: never a link, and never a user's file that init would take over
RESERVED = (MANIFEST, RUN_CONFIG, PTM_WEIGHTS, STAGES, LOCK, STAGING, CHECKPOINT, QUARANTINE, FORGOTTEN, FROZEN_TRACK)


OWN_FOLDERS = (STAGES, CHECKPOINT, STAGING, FORGOTTEN)  # folders whose every entry is the run's


STAGING_NAME = re.compile(r"[0-9a-f]{32}")


MAX_RECORD_BYTES = 64 * 2**20  # the most drl reads of a file not listed with its size (manifest, lock, checkpoint)


STAGE_META = "stage.json"


_STAGE_FOLDER = re.compile(r"[0-9]{3,}")


STAGE_WEIGHTS = "weights.safetensors"


STATISTICS = "statistics.safetensors"


# the run's running totals (the ridge's Grams and W, the pooled scatters): in the newest stage only,
# superseded by the next stage's commit, so that a run's size and a stage's reads do not grow with T
TOTALS = "totals.safetensors"


FORGET_LOG = "log.json"


FORGOTTEN_ROWS = "rows.safetensors"


# a file rewritten by the commit of generation G: <stem>-g<G, 6+ digits>.<suffix>
_REVISION = re.compile(r"(?P<stem>[a-z]+)(?:-g(?P<generation>[0-9]{6,}))?\.(?P<suffix>json|safetensors)")


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


def _track_folder(parts: tuple[str, ...]) -> bool:
    """Whether ``parts`` (a name's folders, its leaf excluded) is one where format 5 keeps the frozen
    track's files: a stage's folder, or the forget folder."""
    stage = len(parts) == 2 and parts[0] == STAGES and _STAGE_FOLDER.fullmatch(parts[1]) is not None
    return stage or parts == (FORGOTTEN,)


def track_file(name: str) -> str | None:
    """Format 5: the run-relative name of the frozen track's file ``name`` (as the track names it): a
    stage or forget file with its leaf prefixed (``stages/001/stage.json`` ->
    ``stages/001/frozen-stage.json``), the PTM's stored weights the run's own; None for any other
    name (the track's run.yaml is derived from the run's, ``track.py``: no file holds it)."""
    parts = PurePosixPath(name).parts
    if name == PTM_WEIGHTS:
        return name
    if not parts or not _track_folder(parts[:-1]):
        return None
    return "/".join((*parts[:-1], TRACK_LEAF + parts[-1]))


def track_name(name: str) -> str | None:
    """Format 5: the name the frozen track gives the run's file ``name`` (``track_file`` undone), or
    None when ``name`` is not one of the track's (the run's own files never take the prefix)."""
    parts = PurePosixPath(name).parts
    if not parts or not parts[-1].startswith(TRACK_LEAF) or not _track_folder(parts[:-1]):
        return None
    leaf = parts[-1][len(TRACK_LEAF) :]
    return "/".join((*parts[:-1], leaf)) if leaf else None


def supersedable(name: str) -> bool:
    """Whether ``name`` is a file a commit may supersede: a stage's weights or statistics, or a forget
    file, the run's own or its frozen track's (format 4 or 5)."""
    parts = PurePosixPath(name).parts
    if parts and parts[0] == FROZEN_TRACK:
        parts = parts[1:]
    elif track_name(name) is not None:
        parts = PurePosixPath(str(track_name(name))).parts
    match = _REVISION.fullmatch(parts[-1]) if parts else None
    if match is None or len(parts) not in (2, 3):
        return False
    if parts[0] == FORGOTTEN and len(parts) == 2:
        return f"{match['stem']}.{match['suffix']}" in (FORGET_LOG, FORGOTTEN_ROWS)
    return (
        parts[0] == STAGES
        and len(parts) == 3
        and re.fullmatch(r"[0-9]{3,}", parts[1]) is not None
        and f"{match['stem']}.{match['suffix']}" in (STAGE_WEIGHTS, STATISTICS, TOTALS)
    )


def format_version(files: dict[str, Any]) -> int:
    """5 once the run's stage folders hold its frozen track's files, 4 once the run lists them under
    ``frozen/``, 3 once a stage carries the run's totals, 2 once the run lists a forget file, else 1:
    older releases must refuse what they would misread (summing totals as one stage's increments,
    looking for the frozen track's own manifest or folder)."""
    if any(track_name(name) is not None for name in files):
        return FLAT_TRACK_FORMAT_VERSION
    if any(name.startswith(TRACK_PREFIX) for name in files):
        return TRACK_FORMAT_VERSION
    totals = TOTALS.partition(".")[0]
    if any(name.startswith(f"{STAGES}/") and name.rpartition("/")[2].startswith(totals) for name in files):
        return TOTALS_FORMAT_VERSION
    return FORGET_FORMAT_VERSION if any(name.startswith(f"{FORGOTTEN}/") for name in files) else FORMAT_VERSION


RUN_CONFIG_KIND = "drl-run-config"


# run.yaml's section holding a switched run's frozen track's config (format 5, ``track.py``): the
# track's run.yaml is derived from the run's, so a release that changes recipe ``frozen`` leaves it
TRACK_CONFIG = "frozen_track"
