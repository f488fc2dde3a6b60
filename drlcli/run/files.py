"""What bytes a run file holds: strict JSON, YAML, safetensors (of the dtypes drl writes only),
and the files a stage or an init commits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

import torch
import yaml
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from .. import jsonio
from .layout import PTM_WEIGHTS, RUN_CONFIG, STAGE_META, STAGE_WEIGHTS, STATISTICS, TOTALS, stage_file


def _raw(data: bytes) -> dict[str, Any]:
    return {}


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


def parser_for(name: str) -> Callable[[bytes], Any]:
    """How a listed file named ``name`` parses (by its suffix; an unknown one: not at all)."""
    return _PARSERS.get(PurePosixPath(name).suffix, _raw)


def stage_files(
    index: int,
    meta: dict[str, Any],
    tensors: dict[str, Tensor],
    statistics: dict[str, Tensor] | None = None,
    totals: dict[str, Tensor] | None = None,
) -> dict[str, bytes]:
    files = {
        stage_file(index, STAGE_META): encode_json(meta),
        stage_file(index, STAGE_WEIGHTS): encode_tensors(tensors),
    }
    if statistics:
        files[stage_file(index, STATISTICS)] = encode_tensors(statistics)
    if totals:
        files[stage_file(index, TOTALS)] = encode_tensors(totals)
    return files


def init_files(run_config: dict[str, Any], ptm_state: dict[str, Tensor] | None) -> dict[str, bytes]:
    files = {RUN_CONFIG: encode_yaml(run_config)}
    if ptm_state is not None:
        files[PTM_WEIGHTS] = encode_tensors(ptm_state)
    return files
