"""One stage of a carried run (``recipe carried``, ``Schedule.carries``; issue 32),
from ``gaussians.py``'s maths: learn-stage hands ``carry_stage`` the stage's features and a pass
through the network as the stage began; it reads no file and runs no network itself. ``Carried``
is what the stage's fit reads of the earlier classes: their sums drawn from the moved Gaussians,
or, at a stage that moved nothing, the sums the stage before kept."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ....errors import IntegrityError
from .. import (
    CARRY,
    CARRY_COV,
    CARRY_PER_CLASS,
    CARRY_Q,
    COV_COUNTS,
    COV_COVARIANCE,
    COV_FACTOR,
    COV_MEAN,
    COV_SCATTER,
    COV_TRACE,
    LAMBDA,
    PROJECTION,
)
from ..head import head_input
from ..statistics import STAT_DTYPE, Statistics, validation_mask
from .gaussians import ClassGaussians, TokenMaps
from .sums import DrawnSums, expected_sums

if TYPE_CHECKING:
    from ....config import RunConfig

PARTS = CARRY_PER_CLASS[-1]  # (C, 2): each class's fit and held-out image counts


@dataclass(frozen=True)
class Carried:
    """A carried run's earlier classes as its next stage's fit reads them (``EarlierStages.carried``),
    in the run's class order: their sums (Q's columns the classes; the Grams and counts, marked as
    running totals with the λ the newest stage chose, None: search every λ), each class's covariance
    rows as a stage's weights hold its own (none without class covariances), and the within-class
    scatter over them with its (images, classes) counts (``COV_SCATTER``, ``COV_COUNTS``; none
    without). ``drawn``: from the class Gaussians (``of_draws``, a stage that trained the network);
    False: as the newest stage kept them (``kept``, a stage that did not: nothing moved)."""

    statistics: Statistics
    rows: dict[str, Tensor]
    scatter: dict[str, Tensor]
    drawn: bool = True

    @property
    def lam(self) -> float | None:
        return self.statistics.lam

    @classmethod
    def of_draws(cls, sums: DrawnSums, lam: float | None, rank: int | None) -> Carried:
        """From ``expected_sums``; ``rank`` the covariance rows' (None: the head keeps none)."""
        counts = torch.tensor([float(sums.counts.sum()), float(len(sums.counts))], dtype=STAT_DTYPE)
        return cls(
            replace(sums.statistics, totals=True, lam=lam),
            sums.covariance_rows(rank) if rank is not None else {},
            {COV_SCATTER: sums.scatter, COV_COUNTS: counts},
        )

    @classmethod
    def kept(
        cls,
        totals: dict[str, Tensor],
        *,
        classes: int,
        size: int,
        lam: float | None,
        width: int,
        rank: int | None,
    ) -> Carried | None:
        """The sums a carried run's newest stage kept in its ``totals`` (``ridge.CARRY_Q`` beside the
        Grams), for ``classes`` classes, a projection of ``size`` columns and class covariances of
        x in R^``width`` at ``rank`` (None: the head has none, and none are read); None when it kept
        none (a run made before runs kept them). ValueError when they do not fit."""
        if CARRY_Q["q_fit"] not in totals:
            return None
        statistics = replace(_kept_statistics(totals, classes=classes, size=size), totals=True, lam=lam)
        if rank is None:
            return cls(statistics, {}, {}, drawn=False)
        rows, scatter = _kept_covariances(totals, classes=classes, width=width, rank=rank)
        return cls(statistics, rows, {name: t.to(STAT_DTYPE) for name, t in scatter.items()}, drawn=False)


def _kept_statistics(totals: dict[str, Tensor], *, classes: int, size: int) -> Statistics:
    """The ridge's sums a carried run's newest stage kept (Q as ``ridge.CARRY_Q``, the Grams and
    counts under their own names), each shape checked against ``classes`` and a projection of
    ``size`` columns before they are read (ValueError: a crafted or damaged totals file)."""
    q_fit, q_val = (totals[CARRY_Q[name]] for name in ("q_fit", "q_val"))
    for name, q in (("fit", q_fit), ("val", q_val)):
        if tuple(q.shape) != (size, classes):
            raise ValueError(f"the kept Q ({name}) is {tuple(q.shape)}, not ({size}, {classes})")
    grams = [totals[name] for name in ("gram_fit", "gram_val")]
    if any(tuple(g.shape) != (size * (size + 1) // 2,) for g in grams) or tuple(totals["counts"].shape) != (2,):
        raise ValueError(f"the kept Grams or counts do not fit a projection of {size} columns")
    counts = totals["counts"]
    if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
        raise ValueError("the kept image counts are not counts")
    kept = {"q_fit": q_fit, "q_val": q_val, "gram_fit": grams[0], "gram_val": grams[1], "counts": counts}
    return Statistics.from_tensors(kept)


def _covariance_shapes(classes: int, width: int, rank: int) -> dict[str, tuple[int, ...]]:
    """The shapes of ``classes`` classes' covariance rows of x in R^``width``: μ_c, and S_c
    (``rank`` 0) or its rank-r factor and trace."""
    shapes = {COV_MEAN: (classes, width)}
    if rank:
        shapes.update({COV_FACTOR: (classes, width, rank), COV_TRACE: (classes,)})
    else:
        shapes[COV_COVARIANCE] = (classes, width, width)
    return shapes


def _kept_covariances(
    totals: dict[str, Tensor], *, classes: int, width: int, rank: int
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The class covariance rows (``ridge.CARRY_COV``) and the within-class scatter with its counts
    that a carried run's newest stage kept, every one present and of its shape (ValueError names the
    first that is not): the next stage's fit reads them as its earlier classes'."""
    shapes = _covariance_shapes(classes, width, rank)
    rows = {name: totals.get(CARRY_COV[name]) for name in shapes}
    scatter = {COV_SCATTER: totals.get(COV_SCATTER), COV_COUNTS: totals.get(COV_COUNTS)}
    for name, want in (*shapes.items(), (COV_SCATTER, (width, width)), (COV_COUNTS, (2,))):
        tensor = rows.get(name, scatter.get(name))
        if tensor is None or tuple(tensor.shape) != want:
            shape = "missing" if tensor is None else tuple(tensor.shape)
            raise ValueError(f"the kept class covariances' {name} is {shape}, not {want}")
    return rows, scatter


@dataclass(frozen=True)
class CarryStep:
    """What a carried run's stage carries: the earlier classes for the head's fit (None at stage 1),
    every class's Gaussian after it (moved, then the stage's own) with its image counts, and
    stage.json's record of the move (None at stage 1)."""

    earlier: Carried | None
    gaussians: ClassGaussians
    parts: Tensor  # (C, 2) int64
    meta: dict[str, Any] | None

    def tensors(self) -> dict[str, Tensor]:
        """Into the run's totals (``RUNNING``)."""
        return {**self.gaussians.to_tensors(CARRY), PARTS: self.parts}


def carry_stage(
    config: RunConfig,
    feats: Tensor,
    labels: Tensor,
    *,
    layout: int,
    stage_index: int,
    earlier: tuple[list[dict[str, Tensor]], dict[str, Tensor]] | None,
    earlier_classes: int,
    before: Tensor | None,
    device: torch.device | str = "cpu",
) -> CarryStep:
    """A carried run's stage (``Schedule.carries``): ``feats`` (N, S', d) are the head's rows of
    the stage's images through the trained network, in image order, ``labels`` local. Its own
    classes' Gaussians are taken from them. After stage 1 (``earlier``: the run's stage tensors and
    its newest totals, holding ``earlier_classes`` classes), ``before`` holds the same images'
    rows through the network as the stage began: one ridge map per head token from those to these,
    the earlier Gaussians moved by the maps, and the head's sums over them drawn (the earlier
    classes for ``fit_stage``). ``before`` None: the stage did not train the network (a paused
    switched run), so the Gaussians stay where they are and the fit reads the sums the newest stage
    kept (a run of an earlier release kept none: drawn again). The drawn sums are taken on ``device``
    (the run's). A crafted or damaged carry is an IntegrityError."""
    tick = time.perf_counter()
    cfg = config.ridge
    width = feats.shape[-1] * (cfg.subspaces + layout**2)
    tokens = _tokens(feats, width, layout)
    own, own_parts = _own_classes(config, tokens, labels.cpu(), stage_index)
    if earlier is None:
        return CarryStep(None, own, own_parts, None)
    stage_tensors, totals = earlier
    old, parts = _earlier_classes(totals, earlier_classes, tokens)
    lam = float(totals[LAMBDA]) if LAMBDA in totals else None
    projection = stage_tensors[0][PROJECTION]
    rank = cfg.covariance_rank if cfg.covariance_weight > 0 else None  # of the rows carried (None: none)
    carried = None
    if before is None:  # nothing moved: the sums the newest stage kept, where it kept them
        moved, move = old, 0.0
        carried = _kept(totals, classes=len(old), size=projection.shape[1], lam=lam, width=tokens.shape[-1], rank=rank)
    else:
        maps = TokenMaps.fit(_tokens(before, width, layout), tokens, cfg.carry_lambda)
        moved, move = old.moved(maps), maps.move
    if carried is None:
        carried = Carried.of_draws(_drawn(config, moved, parts, projection, layout, stage_index, device), lam, rank)
    meta = _carry_meta(config, carried, move=move, classes=len(old), tick=tick)
    return CarryStep(carried, moved.joined(own), torch.cat([parts, own_parts]), meta)


def _own_classes(config: RunConfig, tokens: Tensor, labels: Tensor, stage_index: int) -> tuple[ClassGaussians, Tensor]:
    """The stage's own classes' Gaussians, from its images' ``tokens`` and local ``labels`` (on the
    CPU), and their (C, 2) fit and held-out image counts, split as the head's fit splits them
    (``validation_mask``, the same seed)."""
    cfg = config.ridge
    n = int(labels.max()) + 1 if len(labels) else 0
    val = validation_mask(labels, fraction=cfg.val_fraction, seed=config.train.seed + stage_index)
    own = ClassGaussians.of([tokens[labels == c] for c in range(n)], cfg.carry_rank)
    own_parts = torch.tensor([[int((~val[labels == c]).sum()), int(val[labels == c].sum())] for c in range(n)])
    return own, own_parts


def _earlier_classes(totals: dict[str, Tensor], earlier_classes: int, tokens: Tensor) -> tuple[ClassGaussians, Tensor]:
    """The earlier classes' Gaussians and image counts as the newest totals hold them, checked against
    the ``earlier_classes`` the run has and the tokens the head reads: IntegrityError otherwise (a
    crafted or damaged carry)."""
    try:
        old, parts = carried_classes(totals)
        if len(old) != earlier_classes:
            raise ValueError(f"{len(old)} class Gaussians for {earlier_classes} earlier classes")
        if tuple(old.tokens) != tuple(tokens.shape[1:]):
            raise ValueError(f"class Gaussians of tokens {tuple(old.tokens)}, not the head's {tuple(tokens.shape[1:])}")
    except (KeyError, ValueError) as exc:
        raise IntegrityError(f"the run's carried classes do not fit ({exc}); restore it from a backup") from exc
    return old, parts


def _kept(
    totals: dict[str, Tensor], *, classes: int, size: int, lam: float | None, width: int, rank: int | None
) -> Carried | None:
    """``Carried.kept``, a kept sum that does not fit an IntegrityError (None: the run kept none)."""
    try:
        return Carried.kept(totals, classes=classes, size=size, lam=lam, width=width, rank=rank)
    except (KeyError, ValueError) as exc:
        raise IntegrityError(f"the run's kept sums do not fit ({exc}); restore it from a backup") from exc


def _carry_meta(config: RunConfig, carried: Carried, *, move: float, classes: int, tick: float) -> dict[str, Any]:
    """stage.json's record of the carry: how far the images moved, and how the earlier classes' sums
    were had (drawn, with the run's options, or the stage before's kept: no draws)."""
    cfg = config.ridge
    return {
        "move": round(move, 6),  # the stage's images' relative squared move: what the maps follow
        "map_lambda": cfg.carry_lambda,
        "draws": cfg.carry_draws if carried.drawn else 0,  # 0: the sums the stage before kept
        "mean": cfg.carry_mean if carried.drawn else None,
        "gram_draws": cfg.carry_gram_draws if carried.drawn else None,
        "grams": cfg.carry_grams if carried.drawn else None,
        "classes": classes,
        "seconds": round(time.perf_counter() - tick, 3),
    }


def _drawn(
    config: RunConfig,
    gaussians: ClassGaussians,
    parts: Tensor,
    projection: Tensor,
    layout: int,
    stage_index: int,
    device: torch.device | str,
) -> DrawnSums:
    """The earlier classes' sums drawn from their Gaussians (``expected_sums``), as the run's options
    say; IntegrityError when they are not finite (Gaussians of a crafted spread or mean)."""
    cfg = config.ridge
    sums = expected_sums(
        gaussians,
        parts,
        projection=projection.to(STAT_DTYPE),
        layout_cells=layout**2,
        draws=cfg.carry_draws,
        generator=torch.Generator().manual_seed(config.train.seed + stage_index),
        device=device,
        exact_mean=cfg.carry_mean == "exact",
        gram_draws=cfg.carry_gram_draws,
        split_rows=cfg.carry_grams == "split",
    )
    stats = sums.statistics
    if not all(bool(torch.isfinite(t).all()) for t in (stats.gram_fit, stats.gram_val, stats.q_fit, stats.q_val)):
        raise IntegrityError(
            "the run's carried classes do not fit (their drawn sums are not finite); restore it from a backup"
        )
    return sums


def carried_classes(totals: dict[str, Tensor]) -> tuple[ClassGaussians, Tensor]:
    """A carried run's classes as its newest totals hold them: their Gaussians and (C, 2) image
    counts, every shape and value checked (ValueError, or KeyError for a missing tensor)."""
    gaussians = ClassGaussians.from_tensors(totals, CARRY)
    parts = totals[PARTS]
    if tuple(parts.shape) != (len(gaussians), 2) or parts.dtype != torch.int64 or bool((parts < 0).any()):
        raise ValueError(f"{PARTS} must be ({len(gaussians)}, 2) image counts")
    return gaussians, parts


def check_carried(totals: dict[str, Tensor]) -> None:
    """forget --restore: the carried classes of totals about to be committed, checked as the next
    learn-stage reads them (ValueError names what is off); totals without carried classes pass."""
    if any(name.startswith(CARRY) for name in totals):
        try:
            carried_classes(totals)
        except KeyError as missing:
            raise ValueError(f"{missing.args[0]} is missing") from None


def _tokens(feats: Tensor, width: int, layout: int) -> Tensor:
    """(N, S, d) the tokens the head reads (f_0 and the layout cells), in float64 on the CPU."""
    return head_input(feats, width, layout**2).unflatten(1, (-1, feats.shape[-1])).to(STAT_DTYPE).cpu()
