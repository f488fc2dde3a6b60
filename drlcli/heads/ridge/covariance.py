"""The class covariances of the ridge head (see the folder's docstring): each class's moments of
x = f_0/‖f_0‖, the pooled within-class covariance, the blended and shrunk precisions, and their
low-rank form (each class's covariance as a rank-r factor, the precisions by Woodbury)."""

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


def class_factors(scatters: Tensor, counts: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Each class covariance S_c = scatter_c / (n_c − 1) as a factor Y_c (d, r), Y_c Y_cᵀ its best
    rank-r approximation (its r largest eigenpairs: exact when n_c − 1 ≤ r, since a class of n_c
    images has a scatter of rank n_c − 1 at most), and its whole trace: (n, d, r), (n,) float64.
    One class at a time: a few d × d in memory."""
    num, width = scatters.shape[0], scatters.shape[-1]
    rank = min(rank, width)
    factors = torch.zeros(num, width, rank, dtype=STAT_DTYPE)
    traces = torch.zeros(num, dtype=STAT_DTYPE)
    for c in range(num):
        cov = scatters[c].to(STAT_DTYPE) / max(float(counts[c]) - 1, 1.0)
        traces[c] = torch.trace(cov)
        values, vectors = torch.linalg.eigh(cov)  # ascending
        top = values[width - rank :].clamp_min(0)
        factors[c] = canonical(vectors[:, width - rank :] * top.sqrt())
    return factors, traces


def canonical(factor: Tensor) -> Tensor:
    """A factor's columns (eigenvectors times √eigenvalue) in one form whichever way they were found:
    by decreasing length, each signed so that its largest entry is positive (Y Yᵀ is unchanged)."""
    lengths = factor.norm(dim=0)
    factor = factor[:, torch.argsort(lengths, descending=True, stable=True)]
    peak = factor.gather(0, factor.abs().argmax(0, keepdim=True))
    return factor * torch.where(peak < 0, -1.0, 1.0).to(factor)


@dataclass(frozen=True)
class ClassFactors:
    """A stage's classes in low-rank form: means, counts, factors Y_c (``class_factors``), traces,
    and their within-class scatter summed (for the pooled covariance)."""

    means: Tensor  # (n, d)
    counts: Tensor  # (n,)
    factors: Tensor  # (n, d, r)
    traces: Tensor  # (n,)
    scatter: Tensor  # (d, d)

    @classmethod
    def of(cls, x: Tensor, labels: Tensor, num_classes: int, rank: int) -> ClassFactors:
        """From a stage's x (N, d) and local labels, one class at a time (a few d × d in memory, never
        (n, d, d)). A class of n_c ≤ d images on one process is factored from its n_c × n_c Gram
        (n_c²·d, not d³: the leading eigenvectors of the scatter are Xᵀu for those of X Xᵀ); under
        torchrun each class's scatter is summed over the processes first."""
        x = x.to(STAT_DTYPE)
        width = x.shape[1]
        rank = min(rank, width)
        y = F.one_hot(labels, num_classes).to(STAT_DTYPE)
        sums, counts = distributed.all_reduce_sum(y.T @ x), distributed.all_reduce_sum(y.sum(0))
        means = sums / counts.clamp_min(1)[:, None]
        out = cls(means, counts, torch.zeros(num_classes, width, rank, dtype=STAT_DTYPE),
                  torch.zeros(num_classes, dtype=STAT_DTYPE), torch.zeros(width, width, dtype=STAT_DTYPE))  # fmt: skip
        for c in range(num_classes):
            centred = x[labels == c] - means[c]
            scale = 1 / max(float(counts[c]) - 1, 1.0)  # the scatter's share of the covariance
            if distributed.world_size() == 1 and len(centred) <= width:
                values, vectors = torch.linalg.eigh(centred @ centred.T)  # ascending
                keep = min(rank, len(centred))
                out.factors[c] = canonical(
                    torch.cat([centred.T @ vectors[:, len(centred) - keep :] * scale**0.5, out.factors[c, :, keep:]], 1)
                )
                out.traces[c] = values.clamp_min(0).sum() * scale
                out.scatter.add_(centred.T @ centred)
            else:
                scatter = distributed.all_reduce_sum(centred.T @ centred)
                factors, traces = class_factors(scatter[None], counts[c : c + 1], rank)
                out.factors[c], out.traces[c] = factors[0], traces[0]
                out.scatter.add_(scatter)
        return out


@dataclass(frozen=True)
class LowRankPrecisions:
    """m_c(x) = (x − μ_c)ᵀ P_c (x − μ_c) for every class at once, with P_c the precision of the
    blended, shrunk covariance Σ_c = (1 − a)((1 − b) Y_c Y_cᵀ + b S) + α_c I, α_c = a tr((1 − b) S_c + b S)/d:

    in the eigenbasis V of K = (1 − a) b S (shared by every class), the part K + α_c I is diagonal,
    D_c = diag(1 / (λ + α_c)); the class's rank-r part enters by Woodbury,
    Σ_c⁻¹ = D_c − D_c Ỹ_c (I + Ỹ_cᵀ D_c Ỹ_c)⁻¹ Ỹ_cᵀ D_c with Ỹ_c = √((1 − a)(1 − b)) Vᵀ Y_c, so that with
    z = Vᵀ x, ν_c = Vᵀ μ_c and F_c = D_c Ỹ_c L_c⁻ᵀ (L_c L_cᵀ = I + Ỹ_cᵀ D_c Ỹ_c):

        m_c(x) = Σ_i (z_i − ν_ci)² D_c,ii − ‖F_cᵀ (z − ν_c)‖²

    d² + C·d·(r + 2) multiply-adds per image, against C·d² for the dense precisions; the same
    numbers up to round-off when every class's rank fits in r. F_c, the bulk of the head at
    many classes (d·r a class), is kept in float16 times one float32 scale s (its largest entry at
    2¹⁴: no overflow, a relative rounding of 2⁻¹¹), and ν_c's offsets are taken from that rounded F_c,
    so a run and its exports score with the same numbers."""

    rotation: Tensor  # (d, d) V
    scale: Tensor  # (C, d) diagonal of D_c
    center: Tensor  # (C, d) ν_c ∘ D_c
    const: Tensor  # (C,) Σ_i ν_ci² D_c,ii
    factor: Tensor  # (d, C·r) F_c / s side by side, float16 (float32 in exports of releases before)
    offset: Tensor  # (C·r,) F_cᵀ ν_c
    factor_scale: Tensor  # () s

    @classmethod
    def of(
        cls, means: Tensor, factors: Tensor, traces: Tensor, shared: Tensor, *, shrink: float, blend: float
    ) -> LowRankPrecisions:
        """From μ (C, d), Y (C, d, r), tr S_c (C,) and the pooled S (d, d); float32 out. What is d x d or
        C x d is taken in float64; what is C x d x r (every class's factor: the work that grows with the
        classes, done for every class at every stage as S changes) in float32, its r x r Cholesky
        factors in float64: F_c is stored in float16, 2⁻¹¹ of relative rounding against float32's 2⁻²⁴.
        ValueError for tensors no fit writes (non-finite, a negative trace, S not symmetric PSD)."""
        if not all(bool(torch.isfinite(t).all()) for t in (means, factors, traces, shared)):
            raise ValueError("the class covariances hold non-finite values")
        means, traces, shared = (t.to(STAT_DTYPE) for t in (means, traces, shared))
        if bool((traces < 0).any()) or float(torch.trace(shared)) < 0:
            raise ValueError("a class covariance has a negative trace")
        width = shared.shape[0]
        values, rotation = torch.linalg.eigh((1 - shrink) * blend * shared)
        if float(values.min()) < -1e-6 * max(float(values.abs().max()), 1e-12):
            raise ValueError("the pooled covariance is not positive semi-definite")
        alpha = shrink * ((1 - blend) * traces + blend * torch.trace(shared)) / width + 1e-8  # (C,)
        scale = 1 / (values.clamp_min(0)[None, :] + alpha[:, None])  # (C, d)
        turn = (((1 - shrink) * (1 - blend)) ** 0.5 * rotation).float()
        rotated = torch.einsum("de,cdr->cer", turn, factors.float())  # Ỹ_c (C, d, r), float32
        scaled = scale.float()[:, :, None] * rotated  # D_c Ỹ_c (C, d, r)
        inner = torch.eye(factors.shape[-1], dtype=STAT_DTYPE) + (rotated.transpose(1, 2) @ scaled).to(STAT_DTYPE)
        lower = torch.linalg.cholesky(inner)  # (C, r, r)
        factor = torch.linalg.solve_triangular(lower.float(), scaled.transpose(1, 2), upper=False)  # F_cᵀ (C, r, d)
        factor_scale = float(factor.abs().amax()) / 2**14 or 1.0
        half = (factor / factor_scale).half()
        center = means @ rotation  # ν (C, d)
        offset = (half.float() @ center.float()[:, :, None]).squeeze(-1) * factor_scale  # (C, r), of the rounded F_c
        return cls(
            rotation.float(),
            scale.float(),
            (center * scale).float(),
            (center * center * scale).sum(1).float(),
            half.permute(2, 0, 1).reshape(width, -1).contiguous(),
            offset.reshape(-1).float(),
            torch.tensor(factor_scale, dtype=torch.float32),
        )

    def full_factor(self) -> Tensor:
        """F_c side by side (d, C·r) in float32: what ``lowrank_distance`` reads."""
        return self.factor.float() * self.factor_scale


def lowrank_distance(
    x: Tensor, rotation: Tensor, scale: Tensor, center: Tensor, const: Tensor, factor: Tensor, offset: Tensor
) -> Tensor:
    """(B, C) m_c(x) for x (B, d) from ``LowRankPrecisions``' tensors."""
    z = x @ rotation
    near = (z * z) @ scale.T - 2 * z @ center.T + const
    part = (z @ factor - offset).unflatten(1, (scale.shape[0], -1))  # (B, C, r); no traced batch size
    return near - (part * part).sum(-1)


def standardise(scores: Tensor) -> Tensor:
    """Each row over the classes to mean 0, std 1 (a row of equal scores to 0)."""
    centred = scores - scores.mean(1, keepdim=True)
    return centred / centred.pow(2).mean(1, keepdim=True).sqrt().clamp_min(1e-12)
