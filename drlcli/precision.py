"""Mixed precision: the dtype the network's forward runs in (``--precision``).

``fp32`` runs plain, bit-identical to a call without the option, and on CUDA in IEEE fp32
(``ieee_fp32``: torch enables TF32 for cuDNN convolutions by default, and the ViT's patch embedding
is one; TF32 moves the ridge head's scores by about 1e-3 from the CPU's). ``bf16`` and ``fp16`` run the
forward (and, in training, the loss) under ``torch.autocast``; the scoring stays fp32 whatever
autocast does (``IncrementalModel.scores``: cosines of near-equal prototypes differ below bf16's
resolution). fp16's narrow range needs a loss scale in training (``torch.amp.GradScaler``); bf16
has fp32's range and needs none. fp16 is for CUDA: CPU kernels for it are few and slow, bf16 is
CPU's half precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch

from .errors import UsageError
from .options import PRECISIONS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, device: torch.device) -> None:
    """``UsageError`` for an unknown precision, or fp16 on a device other than CUDA."""
    if precision not in PRECISIONS:
        raise UsageError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp16" and device.type != "cuda":
        raise UsageError(f"--precision fp16 needs CUDA (this call runs on {device.type}); use --precision bf16")


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """The context the network's forward runs in: ``torch.autocast`` for bf16 and fp16; for fp32 no
    autocast, and on CUDA IEEE fp32 (``ieee_fp32``)."""
    if precision == "fp32":
        return ieee_fp32() if torch.device(device).type == "cuda" else contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 matmuls natively (faster than fp32): CUDA with bf16 support, a
    CPU with AMX tiles (Intel Sapphire Rapids and later). Elsewhere bf16 is emulated, often slower."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
        return bool(amx()) if callable(amx) else False
    return False


def training_precision(setting: str, call: str, device: torch.device) -> str:
    """The dtype a stage's training steps run in (``train.precision``): ``call``, the call's
    ``--precision`` (runs before the key); ``auto``, the call's where it is not fp32, else bf16 where
    the device computes it natively (``native_bf16``) and fp32 elsewhere; or the one named. The
    statistics, the fit and the evaluation always run in the call's precision."""
    if setting == "call" or (setting == "auto" and call != "fp32"):
        return call
    if setting == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    check_precision(setting, device)
    return setting


def _tf32_switches() -> list[tuple[object, str, object]]:
    """(object, attribute, IEEE value) of the switches that let CUDA's fp32 convolutions and matmuls
    run in TF32: torch's ``fp32_precision`` API where it has it (reading the legacy ``allow_tf32``
    there raises once a caller has used the new one), else ``allow_tf32``."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        return [(conv, "fp32_precision", "ieee"), (torch.backends.cuda.matmul, "fp32_precision", "ieee")]
    return [(torch.backends.cudnn, "allow_tf32", False), (torch.backends.cuda.matmul, "allow_tf32", False)]


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """CUDA's fp32 as IEEE fp32 for the block: no TF32 in cuDNN convolutions (on by default in torch)
    or cuBLAS matmuls; the switches are put back as they were. Costs the patch embedding's one
    convolution per forward (torch's matmuls are IEEE fp32 by default already)."""
    switches = _tf32_switches()
    before = [getattr(owner, name) for owner, name, _ in switches]
    try:
        for owner, name, value in switches:
            setattr(owner, name, value)
        yield
    finally:
        for (owner, name, _), value in zip(switches, before):
            setattr(owner, name, value)


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """The loss scaler fp16 training needs (None for fp32 and bf16)."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
