"""TorchScript (``.pt``) and torch.export (``.pt2``) graphs (see ``graph.py``): written with the
spec as an extra file; loaded only with ``trust_code`` (TorchScript runs the file's code,
``torch.export.load`` unpickles)."""

from __future__ import annotations

import io
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import jsonio
from ..errors import IntegrityError
from ..ptm import backbone
from . import modelfile
from .graph import PT2_CONSTANT, SPEC_FILE, GraphModel, ScoringGraph, batch_dim, check_spec, quiet, short


def torchscript_bytes(graph: ScoringGraph, example: Tensor, spec: dict[str, Any]) -> bytes:
    with warnings.catch_warnings():
        # only the tracer's own notes on shapes read as Python numbers (block and stage counts, head
        # sizes, fixed by the model; the batch axis stays dynamic, checked by write_graph); torch's
        # deprecation warnings for TorchScript go through
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(graph, example, check_trace=False)
    spec = modelfile.with_checksum({**spec, "payload_sha256": backbone.tensors_sha256(traced.state_dict())})
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer, _extra_files={SPEC_FILE: jsonio.dumps(spec)})
    return buffer.getvalue()


def _pt2_payload(program: Any) -> dict[str, Tensor]:
    """What ``payload_sha256`` covers in a .pt2: the program's state_dict and its tensor constants."""
    tensors = dict(program.state_dict)
    tensors.update({PT2_CONSTANT + k: v for k, v in program.constants.items() if isinstance(v, Tensor)})
    return tensors


def pt2_bytes(graph: ScoringGraph, example: Tensor, spec: dict[str, Any]) -> bytes:
    """``torch.export`` (strict=False: no TorchDynamo bytecode tracing) of the graph, saved with the spec."""
    program = torch.export.export(graph, (example,), dynamic_shapes=batch_dim(), strict=False)
    spec = modelfile.with_checksum({**spec, "payload_sha256": backbone.tensors_sha256(_pt2_payload(program))})
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files={SPEC_FILE: jsonio.dumps(spec)})
    return buffer.getvalue()


def load_torchscript(path: Path, device: str) -> GraphModel:
    extra = {SPEC_FILE: ""}
    try:
        module = torch.jit.load(str(path), map_location=torch.device(device), _extra_files=extra)
    except (RuntimeError, ValueError, OSError) as exc:
        raise IntegrityError(
            f"{path} is not a readable drl TorchScript export ({short(exc)}); export it again"
        ) from exc
    if not extra[SPEC_FILE]:
        raise IntegrityError(
            f"{path} is a torchscript file but not a drl export (no {SPEC_FILE}); pass a file written by `drl export`"
        )
    spec = modelfile.parse_spec(path, extra[SPEC_FILE])
    check_spec(path, spec, "torchscript")
    if backbone.tensors_sha256(module.state_dict()) != spec["payload_sha256"]:
        raise IntegrityError(f"{path} is damaged (checksum mismatch); export it again")
    module.eval()
    return GraphModel("torchscript", spec, module, torch.device(device))


def load_pt2(path: Path, device: str) -> GraphModel:
    extra = {SPEC_FILE: ""}
    program = _pt2_step(path, "not a readable drl pt2 export", lambda: _read_pt2(path, extra))
    text = extra[SPEC_FILE]
    if not text:
        raise IntegrityError(
            f"{path} is a pt2 file but not a drl export (no {SPEC_FILE}); pass a file written by `drl export`"
        )
    spec = modelfile.parse_spec(path, text.decode() if isinstance(text, bytes) else text)
    check_spec(path, spec, "pt2")
    if backbone.tensors_sha256(_pt2_payload(program)) != spec["payload_sha256"]:
        raise IntegrityError(f"{path} is damaged (checksum mismatch); export it again")
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        # the program's metadata asserts then name the GPU the inputs will be on: some torch releases
        # compare devices exactly, and "cuda" is not "cuda:0" there
        target = torch.device("cuda", torch.cuda.current_device())
    if target.type != "cpu":
        from torch.export import passes  # a submodule `import torch` leaves unimported

        program = _pt2_step(path, f"not movable to {target}", lambda: passes.move_to_device_pass(program, target))
    module = _pt2_step(path, "not a runnable drl pt2 export", program.module)
    return GraphModel("pt2", spec, module, target)


def _read_pt2(path: Path, extra: dict[str, Any]) -> Any:
    with open(path, "rb") as handle, quiet("torch.export"):
        zipfile.ZipFile(handle).namelist()  # an unreadable archive is refused here, before torch reads it
        handle.seek(0)
        # a handle, not the path: torch.export.load takes a path by its suffix, a handle as pt2;
        # its own failures are logged as warnings with a trace: the IntegrityError says it
        return torch.export.load(handle, extra_files=extra)


def _pt2_step(path: Path, what: str, step: Callable[[], Any]) -> Any:
    """One step of reading a .pt2: whatever torch raises on a damaged or crafted archive is exit 5."""
    try:
        return step()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # torch's deserializer meets a file: any failure means damage
        raise IntegrityError(f"{path} is {what} ({short(exc)}); export it again") from exc
