"""Calibration of the "unknown" answer, per stage at commit time, from its own training images
only (see the folder's docstring): held-out images, a quantile of their best score."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...options import OpenSetConfig
from .rmd import Moments, RmdKnown


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


def balanced_quantile(scores: Tensor, labels: Tensor, rate: float) -> float:
    """The lower ``rate`` quantile of ``scores`` with each class's images weighing 1 / their count:
    every class counts the same, however many images it held out. The lowest score at which the
    classes' mean share of scores at or below it reaches ``rate``, so ``balanced_rate`` of the
    scores strictly below it never exceeds ``rate``."""
    counts = torch.bincount(labels)
    weights = 1.0 / counts[labels].double()
    order = scores.argsort(stable=True)
    cumulative = weights[order].cumsum(0)
    target = rate * float(cumulative[-1]) * (1 - 1e-9)  # sums of 1 / count round off either way
    i = int(torch.searchsorted(cumulative, torch.tensor(target, dtype=cumulative.dtype)).clamp_max(scores.numel() - 1))
    return float(scores[order][i])


def balanced_rate(mask: Tensor, labels: Tensor) -> float:
    """The mean over classes of the share of their images in ``mask``."""
    counts = torch.bincount(labels)
    hits = torch.bincount(labels, weights=mask.double(), minlength=counts.numel())
    present = counts > 0
    return float((hits[present] / counts[present]).mean())


@dataclass(frozen=True)
class Calibration:
    threshold: float  # the cosine rule's
    rejection: float  # the target rate
    held_out: int  # images the threshold was set on
    rejected: float  # the rate reached on them (quantiles of few images are coarse)
    rmd_threshold: float | None = None  # the rmd rule's, when the earlier stages' moments were given
    rmd_rejected: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def calibrate(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    cfg: OpenSetConfig,
    *,
    seed: int,
    earlier: Moments | None = None,
    rmd_features: Tensor | None = None,
) -> Calibration:
    """The stage's thresholds from its images' subspace-0 features (N, d) and local labels (N,); the
    rmd rule's too when ``earlier`` holds the moments of the classes learned before the stage
    (``Moments.empty`` for the first), on ``rmd_features`` (``rmd_input``; default ``features``)."""
    features = features.double()
    rmd_features = features if rmd_features is None else rmd_features.double()
    held = holdout_mask(labels, fraction=cfg.holdout, seed=seed)
    kept = ~held
    sums = torch.zeros(num_classes, features.shape[1], dtype=features.dtype).index_add_(0, labels[kept], features[kept])
    counts = torch.bincount(labels[kept], minlength=num_classes)
    lone = counts == 0  # a class with a single image: its prototype is that image (held out and kept)
    lone_classes = lone.nonzero().flatten().tolist()
    if lone_classes:
        sums[lone] = torch.stack([features[labels == c].mean(0) for c in lone_classes])
        counts = counts.clamp_min(1)
    prototypes = sums / counts[:, None]
    cos = F.normalize(features[held], dim=-1) @ F.normalize(prototypes, dim=-1).T
    best = cos.max(dim=1).values
    threshold = float(torch.quantile(best, cfg.rejection, interpolation="lower"))
    rmd_threshold = rmd_rejected = None
    if earlier is not None:
        own = Moments.of(rmd_features[kept], labels[kept], num_classes)
        if lone_classes:  # as for the prototypes: a lone image is its class's mean, and no scatter
            means = own.means.clone()
            means[lone] = torch.stack([F.normalize(rmd_features[labels == c], dim=-1).mean(0) for c in lone_classes])
            own = replace(own, means=means, counts=own.counts.clamp_min(1))
        scorer = RmdKnown(earlier.joined(own), torch.zeros(len(earlier.counts) + num_classes))
        rmd_best = scorer.scores(rmd_features[held]).max(dim=1).values  # over every class learned so far
        rmd_threshold = balanced_quantile(rmd_best, labels[held], cfg.rejection)
        rmd_rejected = balanced_rate(rmd_best < rmd_threshold, labels[held])
    return Calibration(
        threshold,
        cfg.rejection,
        int(held.sum()),
        float((best < threshold).double().mean()),
        rmd_threshold,
        rmd_rejected,
    )
