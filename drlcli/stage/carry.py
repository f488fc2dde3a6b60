"""learn-stage's carry, in a carried run (``Method.carries_network``: ``ranpac`` with
``first_session.stages all``; issue 32). The stage retrained the one adapter set, so the earlier
classes' features moved, and the run keeps no image to embed again. It keeps each class as a
Gaussian of the head's tokens instead (``heads/ridge/carry.py``). Here, for a stage after the first:

1. the stage's own images are embedded again through the set as the stage began (``starting``);
2. one ridge map per head token is fitted from those tokens to the trained set's;
3. the earlier classes' Gaussians are moved by the maps, and the head's sums over them drawn;

and for every stage, its own classes' Gaussians are taken from the trained set's tokens and join
the run's totals beside the moved ones."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from .. import distributed
from ..errors import IntegrityError, UsageError
from ..heads.ridge import CARRY, CARRY_PER_CLASS, LAMBDA, PROJECTION
from ..heads.ridge.carry import Carried, ClassGaussians, TokenMaps, expected_sums
from ..heads.ridge.head import head_input
from ..heads.ridge.statistics import STAT_DTYPE, validation_mask
from .context import StageContext

log = logging.getLogger(__name__)

PARTS = CARRY_PER_CLASS[-1]  # (C, 2): each class's fit and held-out image counts


@dataclass(frozen=True)
class CarryStep:
    """What the stage carries: the earlier classes for the head's fit (None at stage 1), every class's
    Gaussian after it (moved, then the stage's own) with its image counts, and stage.json's record."""

    earlier: Carried | None
    gaussians: ClassGaussians
    parts: torch.Tensor  # (C, 2) int64
    meta: dict[str, Any] | None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Into the run's totals (``heads.ridge.RUNNING``)."""
        return {**self.gaussians.to_tensors(CARRY), PARTS: self.parts}


def check_one_process(stage: StageContext) -> None:
    """A carried run learns in one process: its maps and Gaussians need every image of the stage."""
    if stage.method.carries_network(stage.config) and distributed.world_size() > 1:
        raise UsageError("first_session.stages all learns in one process: learn the stage without torchrun")


def carry_stage(stage: StageContext, feats: torch.Tensor, labels: torch.Tensor, layout: int, before) -> CarryStep:
    """``feats`` (N, S', d) the head's rows of the stage's images through the trained set, in image
    order; ``before()`` gives the same through the set as the stage began (called for stages > 1)."""
    tick = time.perf_counter()
    cfg = stage.config.ranpac
    width = feats.shape[-1] * (cfg.subspaces + layout**2)
    tokens = _tokens(feats, width, layout)
    n = len(stage.images.class_names)
    val = validation_mask(labels.cpu(), fraction=cfg.val_fraction, seed=stage.config.train.seed + stage.index)
    own = ClassGaussians.of([tokens[labels == c] for c in range(n)], cfg.carry_rank)
    own_parts = torch.tensor([[int((~val[labels == c]).sum()), int(val[labels == c].sum())] for c in range(n)])
    if stage.index == 1 or not stage.loaded.stage_metas:
        return CarryStep(None, own, own_parts, None)
    totals = stage.loaded.stage_totals[-1]
    try:
        old = ClassGaussians.from_tensors(totals, CARRY)
        parts = totals[PARTS]
        lam = float(totals[LAMBDA]) if LAMBDA in totals else None
        if tuple(parts.shape) != (len(old), 2) or parts.dtype.is_floating_point or bool((parts < 0).any()):
            raise ValueError(f"{PARTS} must be ({len(old)}, 2) image counts")
        if len(old) != len(stage.model.class_names):  # before the stage's classes join the model
            raise ValueError(f"{len(old)} class Gaussians for {len(stage.model.class_names)} earlier classes")
    except (KeyError, ValueError) as exc:
        raise IntegrityError(f"the run's carried classes do not fit ({exc}); restore it from a backup") from exc
    maps = TokenMaps.fit(_tokens(before(), width, layout), tokens, cfg.carry_lambda)
    moved = old.moved(maps)
    generator = torch.Generator().manual_seed(stage.config.train.seed + stage.index)
    projection = stage.loaded.stage_tensors[0][PROJECTION].to(STAT_DTYPE)
    sums = expected_sums(
        moved, parts, projection=projection, layout_cells=layout**2, draws=cfg.carry_draws, generator=generator
    )
    meta = {
        "move": round(maps.move, 6),  # the stage's images' relative squared move: what the maps follow
        "map_lambda": cfg.carry_lambda,
        "draws": cfg.carry_draws,
        "classes": len(old),
        "seconds": round(time.perf_counter() - tick, 3),
    }
    log.debug("carried %d classes: %s", len(old), meta)
    return CarryStep(Carried(sums, lam), moved.joined(own), torch.cat([parts, own_parts]), meta)


def _tokens(feats: torch.Tensor, width: int, layout: int) -> torch.Tensor:
    """(N, S, d) the tokens the head reads (f_0 and the layout cells), in float64."""
    return head_input(feats, width, layout**2).unflatten(1, (-1, feats.shape[-1])).to(STAT_DTYPE).cpu()
