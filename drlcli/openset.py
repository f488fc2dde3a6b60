"""Open-set answers: "unknown" for an image unlike every class the model has learned.

The rule (chosen on validation splits, ``docs/benchmarks.md`` "Issue 19"): class c claims an
image when the cosine of its PTM feature f_0 to c's prototype in the PTM subspace reaches c's
bias b_c; an image no class claims is unknown. The model's known-ness score is

    known(x) = max_c [cos(f_0(x), p_c) - b_c],     unknown  <=>  known(x) < 0

with b_c the mean of the learned classes' stage thresholds (``open_set_bias``): one threshold for
the model, set from every stage's own calibration (per-stage thresholds separated less well).
The score reads only the prototypes, which no later stage changes, so a stage's calibration holds
for the life of the run. (The ridge head's outputs, the other candidate, shift as classes are
added: a threshold set at a stage's commit no longer holds a few stages later.)

Calibration, per stage at commit time, from its own training images only: a share of each class's
images (``open_set.holdout``, at least one) is held out, the stage's prototypes are recomputed
without them, and the stage's threshold t is the ``open_set.rejection`` quantile of the held-out
images' best cosine to the stage's classes; each class of the stage stores t (``unknown_bias``),
and the model answers with their mean over the classes it holds. No image or per-image feature
is kept: only these numbers go into the stage. Methods without
a PTM subspace (``ease``) use their first subspace, stage 1's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import OpenSetConfig

BIAS = "unknown_bias"  # the per-class tensor name, in a stage's weights and among restore.py's tensors


def open_set_bias(thresholds: Tensor) -> Tensor:
    """The biases the model answers with (C,), from each class's stage threshold (C,): their mean,
    the same for every class. One threshold separates better than each stage's own (on the
    validation and test sets of ``docs/benchmarks.md``, "Issue 19", per-stage thresholds lowered the
    AUROC from 0.883 to 0.872 on Caltech-101 and from 0.731 to 0.706 on its sketches)."""
    return thresholds.float().mean().expand(thresholds.shape).clone()


def known_scores(features: Tensor, prototypes: Tensor, bias: Tensor) -> Tensor:
    """known(x) (B,) from subspace-0 features (B, d), prototypes (C, d) and biases (C,)."""
    cos = F.normalize(features.float(), dim=-1) @ F.normalize(prototypes.float(), dim=-1).T  # (B, C)
    return (cos - bias.float()).max(dim=1).values


def holdout_mask(labels: Tensor, *, fraction: float, seed: int) -> Tensor:
    """(N,) bool: ``fraction`` of each class's images (rounded, at least one, never all of a class
    with two or more images), chosen by a seeded permutation of the class's images."""
    generator = torch.Generator().manual_seed(seed)
    held = torch.zeros(labels.numel(), dtype=torch.bool)
    for c in labels.unique().tolist():
        idx = (labels == c).nonzero().flatten()
        k = max(1, round(fraction * idx.numel()))
        if idx.numel() > 1:
            k = min(k, idx.numel() - 1)
        held[idx[torch.randperm(idx.numel(), generator=generator)[:k]]] = True
    return held


@dataclass(frozen=True)
class Calibration:
    threshold: float
    rejection: float  # the target rate
    held_out: int  # images the threshold was set on
    rejected: float  # the rate reached on them (quantiles of few images are coarse)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def calibrate(features: Tensor, labels: Tensor, num_classes: int, cfg: OpenSetConfig, *, seed: int) -> Calibration:
    """The stage's threshold from its images' subspace-0 features (N, d) and local labels (N,)."""
    features = features.double()
    held = holdout_mask(labels, fraction=cfg.holdout, seed=seed)
    kept = ~held
    sums = torch.zeros(num_classes, features.shape[1], dtype=features.dtype).index_add_(0, labels[kept], features[kept])
    counts = torch.bincount(labels[kept], minlength=num_classes)
    lone = counts == 0  # a class with a single image: its prototype is that image (held out and kept)
    if lone.any():
        sums[lone] = torch.stack([features[labels == c].mean(0) for c in lone.nonzero().flatten().tolist()])
        counts = counts.clamp_min(1)
    prototypes = sums / counts[:, None]
    cos = F.normalize(features[held], dim=-1) @ F.normalize(prototypes, dim=-1).T
    best = cos.max(dim=1).values
    threshold = float(torch.quantile(best, cfg.rejection, interpolation="lower"))
    return Calibration(threshold, cfg.rejection, int(held.sum()), float((best < threshold).double().mean()))


# ------------------------------------------------------------------------------ evaluation


def auroc(known: Tensor, unknown: Tensor) -> float:
    """P(score of a known image > score of an unknown image), ties counted half."""
    scores = torch.cat([known, unknown]).double()
    order = scores.argsort()
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=scores.dtype)
    values, inverse, counts = scores.unique(return_inverse=True, return_counts=True)
    sums = torch.zeros_like(values).index_add_(0, inverse, ranks)
    ranks = (sums / counts)[inverse]  # average rank of tied scores
    n_k, n_u = known.numel(), unknown.numel()
    return float((ranks[:n_k].sum() - n_k * (n_k + 1) / 2) / (n_k * n_u))


@dataclass(frozen=True)
class OpenSetReport:
    """Known images (the evaluation's labelled sets) against images of classes not learned."""

    auroc: float  # of known(x): 1 is a perfect separation, 0.5 chance
    unknown_accepted: float  # % of unknown images given a class (known(x) >= 0)
    known_rejected: float  # % of known images called unknown
    top1_accepted: float  # % of known images accepted and correctly classified
    top1_closed: float  # % of known images correctly classified, ignoring the unknown answer
    num_known: int
    num_unknown: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def open_set_report(known_known: Tensor, known_correct: Tensor, unknown_known: Tensor) -> OpenSetReport:
    """From known(x) of the known images, whether each was classified correctly, and known(x) of the
    unknown images."""
    if unknown_known.numel() == 0:
        raise ValueError("no unknown images")
    accepted = known_known >= 0

    def pct(mask: Tensor) -> float:
        return round(100.0 * float(mask.double().mean()), 4)

    return OpenSetReport(
        auroc=round(auroc(known_known, unknown_known), 6),
        unknown_accepted=pct(unknown_known >= 0),
        known_rejected=pct(~accepted),
        top1_accepted=pct(accepted & known_correct),
        top1_closed=pct(known_correct),
        num_known=known_known.numel(),
        num_unknown=unknown_known.numel(),
    )


def check_bias(bias: Tensor, num_classes: int) -> str | None:
    """What is wrong with a loaded bias tensor, or None."""
    if bias.dim() != 1 or bias.numel() != num_classes:
        return f"{BIAS} has shape {tuple(bias.shape)}, expected ({num_classes},)"
    if not bool(torch.isfinite(bias).all()) or not bool((bias.abs() <= 2).all()):
        return f"{BIAS} holds values outside [-2, 2] (cosine thresholds)"
    return None


__all__ = ["BIAS", "Calibration", "OpenSetReport", "auroc", "calibrate", "check_bias", "known_scores", "open_set_bias"]
