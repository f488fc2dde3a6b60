"""The EASE baseline (Zhou et al., CVPR 2024; SPEC §3): one independent adapter set per stage.

In every block of the frozen PTM an AdaptFormer-style adapter runs parallel to the MLP and reads
the post-attention stream:

    x = x + Attn(LN1(x));   x = x + MLP(LN2(x)) + s·Up(ReLU(Down(x)))      (r = 64, s = 0.1)

Stage k's subspace is the class token of the PTM run with stage k's adapters. Every stage's
adapters start from the PTM (Up = 0) and are trained alone, so subspaces are independent, and
inference costs one full ViT pass per stage: the cost DRL removes. There is no PTM subspace
(EASE's default ``use_init_ptm = false``), so prototypes and scores use ``offset`` 0.

The network follows the ``features.StageNetwork`` protocol, as ``IPANetwork`` does, so training,
prototypes, evaluation, storage and export are shared with drl; ``methods/`` holds the method's
other facts (its training recipe and rules).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...ptm import backbone
from ...seeding import seeded
from . import EaseConfig


class EaseAdapters(nn.Module):
    """One stage's adapters, stacked over the L blocks: Down (L, d, r), Up (L, r, d), biases."""

    def __init__(self, *, width: int, depth: int, adapter_dim: int):
        super().__init__()
        bound = 1.0 / math.sqrt(width)  # nn.Linear's default init for Down; Up starts at zero
        self.down = nn.Parameter(torch.empty(depth, width, adapter_dim).uniform_(-bound, bound))
        self.down_bias = nn.Parameter(torch.zeros(depth, adapter_dim))
        self.up = nn.Parameter(torch.zeros(depth, adapter_dim, width))
        self.up_bias = nn.Parameter(torch.zeros(depth, width))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class EaseNetwork(nn.Module):
    """Frozen PTM + one ``EaseAdapters`` per stage. ``forward`` gives (B, S, d): one ViT pass per stage."""

    def __init__(self, ptm: nn.Module, cfg: EaseConfig):
        super().__init__()
        self.ptm = ptm
        self.cfg = cfg
        self.width = backbone.width(ptm)
        self.depth = len(ptm.blocks)
        self.stages = nn.ModuleList()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_subspaces(self) -> int:
        """Width of ``forward``'s subspace axis."""
        return len(self.stages)

    def new_stage(self, *, seed: int) -> EaseAdapters:
        with seeded(seed):  # on the CPU, then moved
            stage = EaseAdapters(width=self.width, depth=self.depth, adapter_dim=self.cfg.adapter_dim)
        stage.to(next(self.ptm.parameters()).device)
        self.stages.append(stage)
        return stage

    def forward(
        self, images: Tensor, stages: int | None = None, layout: int = 0, probes: tuple[int, ...] = ()
    ) -> Tensor:
        """Every stage's subspace, (B, S, d); S full ViT passes (only the first ``stages`` when given).
        EASE has no PTM subspace, so no PTM layout (``layout`` must be 0)."""
        if layout or probes:
            raise ValueError("EASE's network has no PTM subspace to give a layout or probe block of")
        run = list(self.stages)[:stages]
        if not run:
            return images.new_zeros(images.shape[0], 0, self.width)
        return torch.stack([self._run(images, stage) for stage in run], dim=1)

    def forward_train(self, images: Tensor) -> tuple[None, Tensor]:
        """(None, f_S): the newest stage's feature with gradients (no PTM stream to distil from)."""
        return None, self._run(images, self.stages[-1])

    def _run(self, images: Tensor, stage: EaseAdapters) -> Tensor:
        ptm, scale = self.ptm, self.cfg.scale
        drop = self.cfg.dropout if stage.training else 0.0
        x = backbone.embed_tokens(ptm, images)
        for l, block in enumerate(ptm.blocks):
            x = x + block.ls1(block.attn(block.norm1(x)))
            hidden = F.dropout(F.relu(x @ stage.down[l] + stage.down_bias[l]), p=drop, training=drop > 0)
            x = x + block.ls2(block.mlp(block.norm2(x))) + scale * (hidden @ stage.up[l] + stage.up_bias[l])
        return ptm.fc_norm(ptm.norm(x)[:, 0])
