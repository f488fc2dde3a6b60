"""The epoch checkpoint's names and its sealed meta: the JSON carries the sha256 of its own content
(and of the tensors file), so no byte of it is used unchecked."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from torch import Tensor

from .. import jsonio
from ..errors import IntegrityError
from .access import read_nofollow, real_dir
from .files import decode_tensors, encode_json
from .layout import CHECKPOINT_META, sha256_bytes

log = logging.getLogger(__name__)


CHECKPOINT_TENSORS = re.compile(r"[0-9a-f]{32}\.safetensors")


# the checkpoint meta's temporary names: fresh ones (storage.fresh_name), and the fixed one of older releases
CHECKPOINT_TMP = re.compile(rf"\.{re.escape(CHECKPOINT_META)}\.tmp(-[0-9a-f]{{32}})?")


def is_checkpoint_file(name: str) -> bool:
    return name == CHECKPOINT_META or bool(CHECKPOINT_TMP.fullmatch(name) or CHECKPOINT_TENSORS.fullmatch(name))


def seal_checkpoint(meta: dict[str, Any]) -> bytes:
    """The checkpoint meta as written: its fields and ``sha256``, the checksum of the rest."""
    return encode_json({**meta, "sha256": sha256_bytes(encode_json(meta))})


def checked_meta(data: bytes) -> dict[str, Any]:
    """The checkpoint meta ``seal_checkpoint`` wrote; ``ValueError`` when its checksum does not match
    (a changed byte, or a checkpoint of a release that wrote none)."""
    meta = jsonio.loads(data)
    if not isinstance(meta, dict):
        raise ValueError("it is not a mapping")
    claimed = meta.pop("sha256", None)
    if claimed != sha256_bytes(encode_json(meta)):
        raise ValueError("its content does not match its checksum")
    return meta


def read_checkpoint(folder: Path) -> tuple[dict[str, Any], dict[str, Tensor]] | None:
    """The checkpoint in ``folder`` (meta, tensors); None if absent, or if damaged (a warning says
    so: an interrupted stage then starts over)."""
    try:
        if not real_dir(folder) or not os.path.lexists(folder / CHECKPOINT_META):
            return None
        meta = checked_meta(read_nofollow(folder / CHECKPOINT_META))
        name = meta["tensors"]["file"]
        if not CHECKPOINT_TENSORS.fullmatch(name):
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
