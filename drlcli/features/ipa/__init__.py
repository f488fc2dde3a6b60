"""The paper's Incremental Parallel Adapter streams (SPEC §2.1): the PTM's subspace and one per stage,
one pass for all of them (``network.py``). With no stage it is the frozen PTM alone, which the
recipes that train nothing read. This module holds the ``ipa`` section of a
run config and the builder, and imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...options import MAX_DIM, Range, option

if TYPE_CHECKING:
    from torch import nn

    from ...config import RunConfig
    from .. import StageNetwork


@dataclass(frozen=True)
class IPAConfig:
    """Shape of each stage's Incremental Parallel Adapter (SPEC §2.1)."""

    # r; None: d // 16 (48 for ViT-B, 12 for DeiT-Tiny), at least 8
    adapter_dim: int | None = option(None, within=Range(1, MAX_DIM))
    gamma: float = option(0.9, within=Range(0, 1))  # gate input mix: (1-γ)·previous stage + γ·PTM
    # adapter and gate bottleneck activation
    activation: str = option("relu", choices=("relu", "gelu"))
    gate: str = option("adapt", choices=("adapt", "sum", "part"))  # adapt: (1-M)a + Mg | sum: a + g | part: a + Mg
    # reuse: the PTM's A^l mixes the adapter output | none | learned: each stage's own q/k per block (r wide a
    # head) over the PTM block's normalised stream give the A that mixes it (the ablation of reusing A^l)
    attention: str = option("reuse", choices=("reuse", "none", "learned"))
    # M starts at sigmoid(3) = 0.95: a new stream ≈ what it inherits
    gate_bias_init: float = option(3.0, within=Range(-100, 100))
    # transfer block FFN hidden width; None: d (the paper's d→d→d)
    ffn_dim: int | None = option(None, within=Range(1, MAX_DIM))

    def resolved_adapter_dim(self, width: int) -> int:
        return self.adapter_dim if self.adapter_dim is not None else max(8, width // 16)


def build(ptm: nn.Module, config: RunConfig) -> StageNetwork:
    """The IPA network over the frozen PTM (no stage yet)."""
    from .network import IPANetwork

    return IPANetwork(ptm, config.ipa)
