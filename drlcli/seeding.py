"""Seeded randomness that leaves the caller's generators as they were.

``torch.manual_seed`` reseeds the CPU generator and every GPU's, and ``torch.random.fork_rng``
gives back only the devices it is told about: a library call that seeds with the first and forks
with the second leaves the caller's GPU generators reseeded. Here the CPU generator is seeded, and
a GPU's only when the work runs on it; both are forked, so the caller gets them back unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

CPU = torch.device("cpu")


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def reseed(seed: int, device: torch.device = CPU) -> None:
    """Seed the CPU generator and, for a CUDA ``device``, that GPU's (no other GPU's)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[_cuda_index(device)].manual_seed(seed)


@contextlib.contextmanager
def seeded(seed: int, device: torch.device = CPU) -> Iterator[None]:
    """``reseed(seed, device)`` inside; the CPU's and ``device``'s generators given back afterwards."""
    gpus = [_cuda_index(device)] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        reseed(seed, device)
        yield
