"""Which device a command runs on: ``--device auto|cpu|cuda|cuda:N``, checked, and under torchrun
each process's own GPU."""

from __future__ import annotations

import os

import torch

from . import distributed
from .errors import UsageError


def resolve_device(device: str) -> torch.device:
    """auto: CUDA if present; under torchrun each process takes the GPU of its LOCAL_RANK."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device} requested but CUDA is not available; use --device cpu")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise UsageError(f"device {device} requested but this host has {count} GPU(s) (cuda:0 to cuda:{count - 1})")
    if resolved.type == "cuda" and distributed.launched():
        resolved = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return resolved
