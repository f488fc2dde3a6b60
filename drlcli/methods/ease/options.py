"""The ``ease`` section of a run config: the EASE baseline's per-stage AdaptFormer adapter (SPEC §3)."""

from __future__ import annotations

from dataclasses import dataclass

from ...options import MAX_DIM, Range, option


@dataclass(frozen=True)
class EaseConfig:
    """x + MLP(LN(x)) + s·Up(ReLU(Down(x))) in every block, one adapter set per stage."""

    adapter_dim: int = option(64, within=Range(1, MAX_DIM))  # r
    scale: float = option(0.1, within=Range(0, 100))  # s
    # on the bottleneck, training only (as in the public EASE code)
    dropout: float = option(0.1, within=Range(0, 1, high_open=True))
