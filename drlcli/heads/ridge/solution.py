"""A stage's ridge solution offered to a second fit of the very same sums: a switched run's set that
no stage has trained is the frozen PTM, so its head's sums are its frozen track's, bit for bit, and
searching λ and solving W again would give that track's answer a second time (``fit.fit_stage``:
``offer`` makes one, ``given`` takes one). The sums are compared by digest, not trusted: a fit whose
sums, projection or λ search differ in any bit solves for itself."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .statistics import Statistics


@dataclass(frozen=True)
class Solution:
    """λ, its validation errors over ``validated`` classes and W (M, C), solved from sums whose
    ``digest`` is ``sums_digest``'s (the Grams, Q, the counts, the λ before, R and the λ search)."""

    digest: str
    lam: float
    errors: dict[float, float]
    validated: int
    weight: Tensor

    def solves(self, digest: str) -> bool:
        """Whether this is the solution of sums with that ``digest`` (every bit the same)."""
        return digest == self.digest


def sums_digest(total: Statistics, projection: Tensor, search: tuple[Any, ...]) -> str:
    """sha256 over every input of the λ search and the solve: the Grams, Q, the image counts and the
    λ the stage before chose, the projection R, and ``search`` (the λ grid, the search's options and
    seed, whether this is the run's first stage)."""
    digest = hashlib.sha256(repr((total.num_fit, total.num_val, total.lam, search)).encode())
    for tensor in (total.gram_fit, total.gram_val, total.q_fit, total.q_val, projection):
        if tensor is None:
            digest.update(b"none")
            continue
        data = tensor.detach().to("cpu", torch.float64).contiguous()
        digest.update(repr(tuple(data.shape)).encode())
        digest.update(data.numpy())  # its buffer, not a copy
    return digest.hexdigest()
