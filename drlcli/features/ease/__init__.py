"""The EASE baseline's network (SPEC §3): one independent AdaptFormer set per stage, one ViT pass per
stage, no PTM subspace (``network.py``). This module holds the ``ease`` section of a run config and
the builder, and imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...options import MAX_DIM, Range, option

if TYPE_CHECKING:
    from torch import nn

    from ...config import RunConfig
    from .. import StageNetwork


@dataclass(frozen=True)
class EaseConfig:
    """x + MLP(LN(x)) + s·Up(ReLU(Down(x))) in every block, one adapter set per stage."""

    adapter_dim: int = option(64, within=Range(1, MAX_DIM))  # r
    scale: float = option(0.1, within=Range(0, 100))  # s
    # on the bottleneck, training only (as in the public EASE code)
    dropout: float = option(0.1, within=Range(0, 1, high_open=True))


def build(ptm: nn.Module, config: RunConfig) -> StageNetwork:
    """The EASE network over the frozen PTM (no stage yet)."""
    from .network import EaseNetwork

    return EaseNetwork(ptm, config.ease)
