"""What a model file must prove before drl uses it, for every export format (``.drl``, TorchScript,
torch.export ``.pt2``, ONNX): its format comes from its name, its content is that format, and its ``spec`` (class names,
preprocessing, PTM identity, scoring options, the weights' checksum) is checksummed and well formed.

Trust. A ``.drl`` file (safetensors + JSON) and an ONNX file (standard operators run by
onnxruntime; no Python, no custom-op libraries, no external data files) hold data only. A
TorchScript file holds code: loading it runs its ``__setstate__``, scoring runs its ``forward``,
and either can read or write files. A ``.pt2`` (``torch.export.save``) is read by
``torch.export.load``, which unpickles parts of the archive and falls back to
``torch.load(weights_only=False)`` (arbitrary code) when the safe unpickler refuses them; its own
docs say never to load one from an untrusted source. So TorchScript and ``.pt2`` load only with ``trust_code=True``
(``drl predict --trust-code``), and a file is never loaded as a format its name does not say: a
``.drl`` that holds TorchScript is refused, not run.

Checksums. ``payload_sha256`` covers the weights (names, dtypes, shapes, bytes); ``spec_sha256``
covers the spec's canonical JSON (sorted keys, ASCII, no whitespace) without itself, so one
changed byte that changes any value is refused (exit 5) and one that changes none (say, JSON
whitespace) changes nothing the user sees. An ONNX file's graph decides its answers as much as its
weights do, so it also carries ``model_sha256`` over the whole model (``serving.seal_onnx``).
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, UsageError
from ..ptm.record import check_data_config as check_ptm_data_config

SUFFIX_FORMATS = {
    ".onnx": "onnx",
    ".pt": "torchscript",
    ".ts": "torchscript",
    ".torchscript": "torchscript",
    ".pt2": "pt2",
}
FORMAT_SUFFIX = {"drl": ".drl", "torchscript": ".pt", "pt2": ".pt2", "onnx": ".onnx"}
CODE_FORMATS = ("torchscript", "pt2")  # formats whose files may run their own code when loaded
ZIP_FORMATS = ("torchscript", "pt2")  # both are zip archives; a pt2 archive names its format in a member
PT2_MARKER = "archive_format"  # torch.export.save's member that says "pt2"
SPEC_SHA256 = "spec_sha256"


def format_of(path: Path | str) -> str:
    """The format a file's name says: .pt/.ts/.torchscript, .pt2, .onnx, anything else drl (no code)."""
    return SUFFIX_FORMATS.get(Path(path).suffix.lower(), "drl")


def content_format(head: bytes) -> str:
    """What the first bytes look like: torchscript (a zip; ``zip_format`` tells pt2 apart), drl
    (safetensors), onnx or unknown."""
    if head.startswith(b"PK\x03\x04"):
        return "torchscript"
    if len(head) > 8 and head[8:9] == b"{":  # safetensors: 8-byte header length, then JSON
        return "drl"
    if head[:1] == b"\x08":  # ModelProto field 1 (ir_version), a varint
        return "onnx"
    return "unknown"


def require_trust(path: Path, fmt: str, trust_code: bool) -> None:
    """Refuse a code-carrying format unless the caller opted in (before the file is even read)."""
    if fmt in CODE_FORMATS and not trust_code:
        raise UsageError(
            f"{path} is a {fmt} file, which runs its own code when loaded; pass --trust-code "
            "(trust_code=True) only for files from someone you trust, or use a .drl export (no code)"
        )


def check_content(path: Path, fmt: str) -> None:
    """Refuse a file whose content is not the format its name says (a renamed file is never run)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(16)
    except OSError as exc:
        raise IntegrityError(f"cannot read model file {path}: {exc.strerror or exc}; pass an exported file") from exc
    found = content_format(head)
    if found in ZIP_FORMATS:
        found = zip_format(path, fmt)
    if found != fmt and not (fmt == "drl" and found == "unknown"):  # the drl reader names junk itself
        raise IntegrityError(
            f"{path} is named as a {fmt} file but holds {found} content; refused (drl never loads a file as "
            f"another format): export it again as *{FORMAT_SUFFIX[fmt]}"
        )


def zip_format(path: Path, named: str) -> str:
    """torchscript or pt2, by the archive's members (pt2: ``<archive>/archive_format``). A zip whose
    member list cannot be read is taken as what its name says: that format's loader refuses it."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return named if named in ZIP_FORMATS else "torchscript"
    is_pt2 = any(name == PT2_MARKER or name.endswith("/" + PT2_MARKER) for name in names)
    return "pt2" if is_pt2 else "torchscript"


# ------------------------------------------------------------------------------- the spec


def spec_sha256(spec: dict[str, Any]) -> str:
    """sha256 of the spec's canonical JSON, its own checksum left out."""
    body = {k: v for k, v in spec.items() if k != SPEC_SHA256}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def with_checksum(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, SPEC_SHA256: spec_sha256(spec)}


def parse_json(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"{path} has an unreadable spec ({str(exc)[:100]}); export it again") from exc


def parse_spec(path: Path, text: str) -> dict[str, Any]:
    """The JSON spec of a model file, as a mapping (exit 5 otherwise)."""
    spec = parse_json(path, text)
    if not isinstance(spec, dict):
        raise IntegrityError(f"{path} has a malformed spec (not a JSON object); export it again")
    return spec


def check_version(
    path: Path,
    found: Any,
    expected: str,
    *,
    what: str,
    also: tuple[str, ...] = (),
    older: str = "without metadata checksums",
) -> None:
    """``found`` must be ``expected`` (what this drl writes) or one of ``also`` (older formats it still
    reads); an older one is refused saying what it lacks (``older``) and to export it again."""
    if found == expected or found in also:
        return
    if isinstance(found, str) and found.isdigit() and int(found) < int(expected):
        raise IntegrityError(
            f"{path} is a {what} of format {found}, from an older drl {older}; export it again from its run with this drl"
        )
    raise IntegrityError(
        f"{path} has {what} format {found!r}, this drl reads {expected}; use the drl release that wrote it"
    )


def check_spec_sha256(path: Path, spec: dict[str, Any]) -> None:
    try:
        found = spec_sha256(spec)
    except (ValueError, TypeError) as exc:  # NaN or a value JSON cannot hold
        raise IntegrityError(f"{path} has a malformed spec ({exc}); export it again") from exc
    if found != spec.get(SPEC_SHA256):
        raise IntegrityError(f"{path} is damaged (metadata checksum mismatch); export it again")


def require_keys(path: Path, spec: dict[str, Any], types: dict[str, type]) -> None:
    """Every key present with a value of its type (bool is never an int here)."""
    for key, kind in types.items():
        value = spec.get(key)
        if value is None or (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            raise IntegrityError(f"{path} has a malformed spec ({key!r} missing or not {_name(kind)}); export it again")


def check_class_names(path: Path, names: Any) -> list[str]:
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise IntegrityError(f"{path} has malformed class names (not a list of names); export it again")
    if len(set(names)) != len(names):
        raise IntegrityError(f"{path} lists a class name twice; export it again")
    return names


def check_data_config(path: Path, cfg: Any) -> dict[str, Any]:
    """The preprocessing that ``data.eval_transform`` reads, checked as a run's is (``config.py``)."""
    try:
        check_ptm_data_config(cfg)
    except UsageError as exc:
        raise IntegrityError(f"{path} has a malformed data_config ({exc}); export it again") from exc
    return cfg


def _name(kind: type) -> str:
    return {"dict": "a mapping", "list": "a list", "str": "a string", "int": "an int"}.get(kind.__name__, kind.__name__)
