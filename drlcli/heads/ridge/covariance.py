"""The class covariances of the ridge head (see the folder's docstring): each class's moments of
x = f_0/‖f_0‖, the pooled within-class covariance, the blended and shrunk precisions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ... import distributed
from ..linalg import shrunk
from . import COV_COUNTS, COV_SCATTER
from .statistics import STAT_DTYPE


def covariance_input(features: Tensor) -> Tensor:
    """x = f_0 / ‖f_0‖, (B, d), from (B, S, d) features."""
    return F.normalize(features[:, 0], dim=-1)


@dataclass(frozen=True)
class ClassMoments:
    """First and second moments of each class's x (sums over its images)."""

    sums: Tensor  # (n, d)
    outer: Tensor  # (n, d, d)
    counts: Tensor  # (n,)

    @classmethod
    def of(cls, x: Tensor, labels: Tensor, num_classes: int) -> ClassMoments:
        """The sums over a stage's images: (n, d, d) float64 for the outer products, filled one
        class at a time (no (N, n, d) intermediate)."""
        x = x.to(STAT_DTYPE)
        y = F.one_hot(labels, num_classes).to(STAT_DTYPE)  # (N, n)
        outer = torch.zeros(num_classes, x.shape[1], x.shape[1], dtype=STAT_DTYPE)
        for c in range(num_classes):
            xc = x[labels == c]
            outer[c] = xc.T @ xc
        return cls(y.T @ x, outer, y.sum(0))

    def all_reduced(self) -> ClassMoments:
        if distributed.world_size() == 1:
            return self
        return ClassMoments(*(distributed.all_reduce_sum(t) for t in (self.sums, self.outer, self.counts)))

    def means(self) -> Tensor:
        return self.sums / self.counts.clamp_min(1)[:, None]

    def scatters(self) -> Tensor:
        """(n, d, d) Σ (x − μ_c)(x − μ_c)ᵀ over each class's images, float64."""
        mean = self.means()
        out = self.outer.clone()
        for c in range(len(out)):  # in place, class by class: one (n, d, d) copy in all
            out[c] -= self.counts[c] * torch.outer(mean[c], mean[c])
        return out


def pooled_covariance(statistics: list[dict[str, Tensor]]) -> Tensor:
    """S: the within-class scatter of every stage's statistics over (images − classes)."""
    scatter = sum(s[COV_SCATTER].to(STAT_DTYPE) for s in statistics)
    counts = sum(s[COV_COUNTS].to(STAT_DTYPE) for s in statistics)
    return scatter / max(float(counts[0] - counts[1]), 1.0)


def precisions(covariances: Tensor, shared: Tensor, *, shrink: float, blend: float) -> Tensor:
    """P_c = shrink_a((1 − b) S_c + b S)⁻¹ for (C, d, d) class covariances, float32 (C, d, d).

    One class at a time, by Cholesky: memory stays at a few d × d, and batched LU inverses are not
    used (on CPU with several threads MKL's batched getrf fails or hangs, pytorch#141358). A
    matrix that is not positive definite (only a crafted or damaged file gives one) is a
    ValueError."""
    shared = blend * shared.to(STAT_DTYPE)
    out = torch.empty(covariances.shape, dtype=torch.float32)
    for c in range(covariances.shape[0]):
        cov = shrunk((1 - blend) * covariances[c].to(STAT_DTYPE) + shared, shrink)
        factor, info = torch.linalg.cholesky_ex(cov)
        if int(info) != 0:
            raise ValueError(f"class {c}'s blended covariance is not positive definite")
        out[c] = torch.cholesky_inverse(factor).float()
    return out


def standardise(scores: Tensor) -> Tensor:
    """Each row over the classes to mean 0, std 1 (a row of equal scores to 0)."""
    centred = scores - scores.mean(1, keepdim=True)
    return centred / centred.pow(2).mean(1, keepdim=True).sqrt().clamp_min(1e-12)
