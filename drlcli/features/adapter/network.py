"""The PTM with one AdaptFormer adapter set: RanPAC's first-session adaptation (McDonnell et al.,
NeurIPS 2023, phase 1), trained on stage 1's classes and frozen afterwards, or, carried
(``schedule.stages all``, drl's default), trained again at every stage.

In every block an adapter runs parallel to the MLP and reads the post-attention stream, as in
the public RanPAC code (``ffn_option parallel``, no adapter layer norm, r 64, s 0.1); with
``adapter.blocks`` below 1, only the leading blocks have one:

    x = x + Attn(LN1(x));   x = x + MLP(LN2(x)) + s·Up(ReLU(Down(x)))

Stage 1's adapters replace the PTM: every later feature, the ridge head's input, the PTM's layout
rows, the class covariances and the "unknown" answer's probe blocks, come from the adapted pass,
one ViT pass per image as before. Later stages add no network (``Schedule.trained_stages``). The
network keeps the ``StageNetwork`` shape of a method with a PTM subspace (offset 1): subspace 0
is the adapted PTM's feature and stage 1's subspace is the same feature, computed once.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import distributed
from ...errors import UsageError
from ...ptm import backbone
from ...seeding import seeded
from ..ease.network import EaseAdapters
from . import AdapterConfig


def hold_loss(tokens: Tensor, target: Tensor) -> Tensor:
    """Mean over images and tokens of ‖t − t₀‖² / ‖t₀‖², (B, S, d) each, in float32: how far training
    moved the read tokens of a stage's images from ``target``, where the set put them when the stage
    began (``schedule.hold_weight``; issue 32's research: distillation on the new images only)."""
    tokens, target = tokens.float(), target.float()
    return ((tokens - target).pow(2).sum(-1) / target.pow(2).sum(-1).clamp_min(1e-12)).mean()


def token_cells(ptm: nn.Module, read_grid: int, keep_tokens: float) -> tuple[int, int]:
    """The side of the PTM's square patch grid and the cells a step keeps ``keep_tokens`` of (the layout's
    ``read_grid`` x ``read_grid``, or the whole grid); ``UsageError`` where the grid does not split into them."""
    patches = ptm.patch_embed.num_patches
    side, grid = math.isqrt(patches), max(1, read_grid)
    if side * side != patches or side % grid:
        raise UsageError(
            f"train.keep_tokens {keep_tokens:g} needs the PTM's patch grid to split into {grid} x {grid} "
            "layout cells; set train.keep_tokens 1"
        )
    return side, grid


def _keep(tokens: Tensor, kept: Tensor | None, prefix: int) -> Tensor:
    """The ``prefix`` tokens (the class token), then the patch tokens ``kept`` (B, K) names; all: None."""
    if kept is None:
        return tokens
    patches = tokens[:, prefix:].gather(1, kept[..., None].expand(-1, -1, tokens.shape[-1]))
    return torch.cat([tokens[:, :prefix], patches], 1)


class AdapterNetwork(nn.Module):
    """Frozen PTM + stage 1's ``EaseAdapters`` (AdaptFormer) inside it, once stage 1 is learned;
    ``carried``: the set learns again at every stage, held near each stage's start by ``hold_weight``
    on the leading ``hold_share`` of each batch's images."""

    def __init__(
        self,
        ptm: nn.Module,
        cfg: AdapterConfig,
        *,
        carried: bool = False,
        hold_weight: float = 0.0,
        hold_share: float = 1.0,
        read_grid: int = 0,
        keep_tokens: float = 1.0,
    ):
        super().__init__()
        self.ptm = ptm
        self.cfg = cfg
        self.carried, self.hold_weight, self.hold_share = carried, hold_weight, hold_share
        self.read_grid = read_grid  # the head's layout grid: the hold term's tokens are f_0 and its cells
        self.keep_tokens = keep_tokens  # the share of each layout cell's patch tokens a training step reads
        self.width = backbone.width(ptm)
        self.depth = len(ptm.blocks)
        self.stages = nn.ModuleList()
        self.__dict__["start"] = None  # carried: the set as the stage began (not a submodule)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_subspaces(self) -> int:
        """Width of ``forward``'s subspace axis: the adapted PTM's, and stage 1's (the same feature)."""
        return 1 + len(self.stages)

    @property
    def adapted_blocks(self) -> int:
        """How many leading blocks get adapters (``adapter.blocks``; the rest run as the PTM's)."""
        return max(1, round(self.cfg.blocks * self.depth))

    def new_stage(self, *, seed: int) -> EaseAdapters:
        if self.stages and self.carried:  # a carried run: the one set learns again
            stage = self.stages[0].requires_grad_(True).train()
            self.__dict__["start"] = copy.deepcopy(stage).requires_grad_(False).eval()
            return stage
        if self.stages:
            raise ValueError("only stage 1 adapts the PTM (RanPAC's first session); later stages add no network")
        with seeded(seed):  # on the CPU, then moved
            stage = EaseAdapters(width=self.width, depth=self.adapted_blocks, adapter_dim=self.cfg.adapter_dim)
        stage.to(next(self.ptm.parameters()).device)
        self.stages.append(stage)
        return stage

    @contextmanager
    def _swapped(self, stages: list[EaseAdapters]) -> Iterator[None]:
        kept = self.stages
        self.stages = nn.ModuleList(stages)
        try:
            yield
        finally:
            self.stages = kept

    def bare(self) -> contextlib.AbstractContextManager[None]:
        """The frozen PTM without stage 1's adapters, for the block (``schedule.decide``)."""
        return self._swapped([])

    def drop_start(self) -> None:
        self.__dict__["start"] = None

    def drop_adapters(self) -> None:
        """Forget stage 1's adapters: the run keeps the frozen PTM (``schedule.decide``)."""
        self.stages = nn.ModuleList()

    def forward(
        self, images: Tensor, stages: int | None = None, layout: int = 0, probes: tuple[int, ...] = ()
    ) -> Tensor:
        """(B, 1+k, d): the adapted PTM's feature, repeated for stage 1's subspace when k (``stages``,
        default all) counts it; then the layout rows of the adapted pass (g > 0) and the probe
        blocks' class tokens, as ``IPANetwork.forward`` orders them."""
        tokens, probed = self._pass(images, probes)
        feature = self.ptm.fc_norm(tokens[:, 0])
        kept = self.num_stages if stages is None else min(stages, self.num_stages)
        rows = [feature[:, None].expand(-1, 1 + kept, -1)]
        if layout:
            rows.append(backbone.layout_cells(self.ptm, tokens, layout))
        if probes:
            missing = sorted(set(probes) - set(probed))
            if missing:
                raise ValueError(f"PTM block {missing[0]} is not a block before the last of {self.depth}")
            rows.append(torch.stack([probed[b] for b in probes], dim=1))
        return torch.cat(rows, dim=1)

    def forward_train(self, images: Tensor) -> tuple[Tensor | None, ...]:
        """(None, the adapted feature) with gradients for the adapters (no PTM feature to distil to);
        in a reopened set (``new_stage``) with ``hold_weight`` w > 0, also w · ``hold_loss`` of the
        read tokens (f_0 and the layout cells) against the set's as the stage began (no dropout), of the
        batch's leading ``held(B)`` images: an unbiased estimate of the whole batch's term (the batches
        are shuffled) for that share of the starting set's forward."""
        kept = self._kept(images)
        tokens, _ = self._pass(images, (), kept=kept)
        feature = self.ptm.fc_norm(tokens[:, 0])
        if self.start is None or not self.hold_weight:
            return None, feature
        mine, weight = self.held_rows(len(images))
        if not mine:
            return None, feature, feature.new_zeros(())
        with torch.no_grad():
            part = None if kept is None else kept[:mine]
            target = self._read(self._pass(images[:mine], (), stage=self.start, kept=part)[0], cells=kept is not None)
        moved = hold_loss(self._read(tokens[:mine], feature[:mine], cells=kept is not None), target)
        return None, feature, self.hold_weight * weight * moved

    def held(self, batch: int) -> int:
        """How many of a batch's images the hold term reads: ``hold_share`` of them, at least one."""
        return max(1, min(batch, math.ceil(self.hold_share * batch - 1e-9)))

    def held_rows(self, batch: int) -> tuple[int, float]:
        """This process's share of the hold: how many of its ``batch`` leading images it reads, and the
        weight of their mean. The hold reads the global batch's leading ``held`` positions; under torchrun
        process r of K holds positions r, r+K, ... of each global batch (``batches.GlobalBatchShard``), so
        the mean of the K processes' terms, as their gradients are averaged, is the one process's term."""
        world, rank = distributed.world_size(), distributed.rank()
        k = self.held(batch * world)
        mine = max(0, -(-(k - rank) // world))
        return mine, mine * world / k

    def _read(self, tokens: Tensor, feature: Tensor | None = None, *, cells: bool = False) -> Tensor:
        """(B, 1 + g², d): f_0 and the layout cells the head reads (``cells``: the patch tokens kept by
        ``_kept``, cell by cell, each cell the mean of its kept tokens)."""
        feature = self.ptm.fc_norm(tokens[:, 0]) if feature is None else feature
        if not self.read_grid:
            return feature[:, None]
        if cells:
            patches = tokens[:, self.ptm.num_prefix_tokens :]
            b, _, d = patches.shape
            layout = patches.reshape(b, self.read_grid**2, -1, d).mean(2)
        else:
            layout = backbone.layout_cells(self.ptm, tokens, self.read_grid)
        return torch.cat([feature[:, None], layout], 1)

    def _kept(self, images: Tensor) -> Tensor | None:
        """(B, K) the patch tokens a training step reads: ``keep_tokens`` of each layout cell's, drawn
        afresh for each image, grouped cell by cell in row-major order (so that a cell's mean is the mean
        of its kept tokens, ``_read``); None: all of them."""
        if self.keep_tokens >= 1:
            return None
        side, grid = token_cells(self.ptm, self.read_grid, self.keep_tokens)
        cell = side // grid
        at = torch.arange(side, device=images.device) // cell
        order = torch.argsort((at[:, None] * grid + at[None, :]).flatten(), stable=True)  # the patches, cell by cell
        keep = max(1, round(self.keep_tokens * cell * cell))
        draw = torch.rand(len(images), grid * grid, cell * cell, device=images.device).argsort(-1)[..., :keep]
        return order.view(1, grid * grid, cell * cell).expand(len(images), -1, -1).gather(2, draw).flatten(1)

    def _pass(
        self,
        images: Tensor,
        probes: tuple[int, ...],
        stage: EaseAdapters | None = None,
        kept: Tensor | None = None,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Every block with stage 1's adapters, or ``stage``'s (the bare PTM before it has them; the
        blocks past ``adapted_blocks`` as the PTM's), then the final norm."""
        if stage is None:
            stage = self.stages[0] if self.stages else None
        drop = self.cfg.dropout if stage is not None and stage.training else 0.0
        x = _keep(backbone.embed_tokens(self.ptm, images), kept, self.ptm.num_prefix_tokens)
        probed: dict[int, Tensor] = {}
        for l, block in enumerate(self.ptm.blocks):
            if stage is None or l >= len(stage.down):
                x = block(x)
            else:
                x = x + block.ls1(block.attn(block.norm1(x)))
                hidden = F.dropout(F.relu(x @ stage.down[l] + stage.down_bias[l]), p=drop, training=drop > 0)
                x = (
                    x
                    + block.ls2(block.mlp(block.norm2(x)))
                    + self.cfg.scale * (hidden @ stage.up[l] + stage.up_bias[l])
                )
            if l in probes and l < self.depth - 1:
                probed[l] = backbone.ptm_probe(self.ptm, x)
        return self.ptm.norm(x), probed
