"""Mixed precision: the dtype the network's forward runs in (``--precision``).

``fp32`` runs plain, bit-identical to a call without the option. ``bf16`` and ``fp16`` run the
forward (and, in training, the loss) under ``torch.autocast``; the scoring stays fp32 whatever
autocast does (``IncrementalModel.scores``: cosines of near-equal prototypes differ below bf16's
resolution). fp16's narrow range needs a loss scale in training (``torch.amp.GradScaler``); bf16
has fp32's range and needs none. fp16 is for CUDA: CPU kernels for it are few and slow, bf16 is
CPU's half precision.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

from .config import PRECISIONS
from .errors import UsageError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, device: torch.device) -> None:
    """``UsageError`` for an unknown precision, or fp16 on a device other than CUDA."""
    if precision not in PRECISIONS:
        raise UsageError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp16" and device.type != "cuda":
        raise UsageError(f"--precision fp16 needs CUDA (this call runs on {device.type}); use --precision bf16")


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """The context the network's forward runs in: nothing for fp32, ``torch.autocast`` otherwise."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """The loss scaler fp16 training needs (None for fp32 and bf16)."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
