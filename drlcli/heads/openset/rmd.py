"""The "unknown" answer's scores (see the folder's docstring): the rmd rule's statistics of a
stage's classes (``Moments``), known(x) of both rules as traceable modules (``RmdKnown``,
``CosineKnown``), the probe block's place in a pass's output (``split_probe``), and the checks of
the tensors a run or an export holds for them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..linalg import ridge_map, shrunk  # the class-covariance head's shrinkage too
from . import BIAS, RMD_BIAS, RMD_COUNT, RMD_MEAN, RMD_SCATTER, RMD_SCATTER_COUNTS

_MOMENT_NAMES = (RMD_MEAN, RMD_COUNT, RMD_SCATTER, RMD_SCATTER_COUNTS)  # Moments' fields, in order
SHRINK = 0.5  # of both covariances towards their mean variance (0.3 / 0.5 / 0.7 tied on validation)


def open_set_bias(thresholds: Tensor) -> Tensor:
    """The biases the model answers with (C,), from each class's stage threshold (C,): their mean,
    the same for every class. One threshold separates better than each stage's own (on the
    validation and test sets of ``docs/research/unknown-answer.md`` at b4fbb16, per-stage thresholds lowered the
    AUROC from 0.883 to 0.872 on Caltech-101 and from 0.731 to 0.706 on its sketches)."""
    return thresholds.float().mean().expand(thresholds.shape).clone()


def known_scores(features: Tensor, prototypes: Tensor, bias: Tensor) -> Tensor:
    """known(x) (B,) from subspace-0 features (B, d), prototypes (C, d) and biases (C,)."""
    cos = F.normalize(features.float(), dim=-1) @ F.normalize(prototypes.float(), dim=-1).T  # (B, C)
    return (cos - bias.float()).max(dim=1).values


# ------------------------------------------------------------------------------- rmd


@dataclass(frozen=True)
class Moments:
    """Class-level statistics of x, the unit vector along the rmd rule's input (``rmd_input``: f_0,
    or f_0 and the probe block's token; float64): per class its mean and image count, and the
    summed within-class scatter with the images and classes it sums over."""

    means: Tensor  # (C, w)
    counts: Tensor  # (C,)
    scatter: Tensor  # (w, w)
    scatter_counts: Tensor  # (2,) images, classes

    @classmethod
    def empty(cls, width: int) -> Moments:
        z = torch.zeros
        return cls(
            z(0, width, dtype=torch.float64),
            z(0, dtype=torch.float64),
            z(width, width, dtype=torch.float64),
            z(2, dtype=torch.float64),
        )

    @classmethod
    def of(cls, features: Tensor, labels: Tensor, num_classes: int) -> Moments:
        """The moments of a stage's classes from their rmd inputs (N, w) (``rmd_input``) and local
        labels (N,); every class must have an image."""
        x = F.normalize(features.double(), dim=-1)
        counts = torch.bincount(labels, minlength=num_classes).double()
        means = (
            torch.zeros(num_classes, x.shape[1], dtype=x.dtype).index_add_(0, labels, x) / counts.clamp_min(1)[:, None]
        )
        centred = x - means[labels]
        scatter = centred.T @ centred
        return cls(means, counts, scatter, torch.tensor([float(len(x)), float(num_classes)], dtype=torch.float64))

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> Moments:
        return cls(*(tensors[name].double() for name in _MOMENT_NAMES))

    def joined(self, later: Moments) -> Moments:
        """Self's classes then ``later``'s, the scatters summed."""
        return Moments(
            torch.cat([self.means, later.means]),
            torch.cat([self.counts, later.counts]),
            self.scatter + later.scatter,
            self.scatter_counts + later.scatter_counts,
        )

    def moved(self, linear: Tensor, shift: Tensor) -> Moments:
        """The moments of the images after x -> x + x B + b (``linalg.ridge_map``'s (B, b): a carried
        run's stage moving the earlier classes with the network): each mean mapped, the scatter of
        the centred images (I + B)ᵀ S (I + B), the counts kept."""
        if tuple(linear.shape) != tuple(self.scatter.shape) or tuple(shift.shape) != (self.scatter.shape[0],):
            raise ValueError(f"a map of shape {tuple(linear.shape)} cannot move moments {self.scatter.shape[0]} wide")
        step = torch.eye(len(linear), dtype=torch.float64) + linear.double()
        return Moments(
            self.means + self.means @ linear.double() + shift.double(),
            self.counts,
            step.T @ self.scatter @ step,
            self.scatter_counts,
        )

    def tensors(self) -> dict[str, Tensor]:
        """A stage's rmd tensors (its threshold aside), in fp32."""
        values = (self.means, self.counts, self.scatter, self.scatter_counts)
        return {name: t.float() for name, t in zip(_MOMENT_NAMES, values)}

    def gaussians(self) -> tuple[Tensor, Tensor, Tensor, float]:
        """(μ_0 (d,), Σ_w⁻¹ (d, d), Σ_t⁻¹ (d, d), tr Σ_t / d), shrunk; ValueError when a covariance
        is not one.

        Σ_w = scatter / (images - classes) of the scatter; Σ_t = ((N - C) Σ_w + Σ_c n_c (μ_c - μ_0)
        (μ_c - μ_0)ᵀ) / (N - 1) over the classes held, the exact covariance of all their images
        (until a class is forgotten: the scatter still sums its images).
        """
        n, total = self.counts, self.counts.sum()
        images, classes = (float(v) for v in self.scatter_counts)
        within = self.scatter / max(images - classes, 1.0)
        mu0 = (n[:, None] * self.means).sum(0) / total.clamp_min(1)
        between = self.means - mu0
        full = ((total - len(n)).clamp_min(0) * within + (between.T * n) @ between) / (total - 1).clamp_min(1)
        if images - classes < 1:  # one image per class: no within-class spread seen, use the total
            within = full
        variance = float(torch.trace(full)) / full.shape[0]
        return mu0, _inverse(shrunk(within, SHRINK)), _inverse(shrunk(full, SHRINK)), variance


def carried_moments(earlier: Moments, f0: Tensor, before: Tensor, after: Tensor, lam: float) -> tuple[Moments, float]:
    """A carried run's stage (``Schedule.carries``): ``earlier`` moved by one ridge map of x,
    the unit rmd input, from the stage's images before its training to after it (``before``,
    ``after``: (N, w) rmd inputs, in image order), with the images' relative squared move of x. λ is
    the head's class-token map's (``lam``, fitted on raw f_0) scaled to unit rows: divided by the
    mean squared norm of f_0 (N, d) as the stage began, x being f_0's direction (and the probe's)."""
    x, y = (F.normalize(rows.double(), dim=-1) for rows in (before, after))
    linear, shift = ridge_map(x, y, lam / float(f0.double().pow(2).sum(1).mean().clamp_min(1e-30)))
    move = float((y - x).pow(2).sum() / x.pow(2).sum())
    return earlier.moved(linear, shift), move


def probe_block(depth_fraction: float | None, depth: int) -> int | None:
    """The PTM block whose class token joins f_0 in the rmd score (``open_set.probe_depth``): block
    round(f (depth - 1)), 0-based, when it is a block before the last (the last gives f_0 itself)."""
    if depth_fraction is None:
        return None
    block = round(depth_fraction * (depth - 1))
    return block if block < depth - 1 else None


def rmd_input(f0: Tensor, probe: Tensor | None, weight: float) -> Tensor:
    """What the rmd rule reads: f_0 (B, d) alone, or [f_0/|f_0|, w t/|t|] (B, 2d) with the probe
    block's class token t: each part normalised, so w sets their relative say."""
    if probe is None:
        return f0
    return torch.cat([F.normalize(f0.double(), dim=-1), weight * F.normalize(probe.double(), dim=-1)], dim=-1)


def split_probe(features: Tensor, probes: int, weight: float) -> tuple[Tensor, Tensor]:
    """(the rows class scoring reads, known(x)'s input) of network features (B, S', d) whose last
    ``probes`` rows (0 or 1) are the probe block's class token: f_0 alone, or ``rmd_input`` of f_0
    and that token. The one place a pass's output is split between the two answers."""
    probe = features[:, -1] if probes else None
    return features[:, : features.shape[1] - probes], rmd_input(features[:, 0], probe, weight)


def _inverse(covariance: Tensor) -> Tensor:
    chol, info = torch.linalg.cholesky_ex(covariance)
    if int(info) != 0 or not bool(torch.isfinite(covariance).all()):
        raise ValueError(f"{RMD_SCATTER} does not give a covariance (not positive semi-definite)")
    return torch.cholesky_inverse(chol)


class RmdKnown(nn.Module):
    """known(x) (B,) of the rmd rule from its input (B, w) (``rmd_input``): only constants, traceable
    into every format.

    known(x) = v (max_c rmd_c(x) - b) with v = tr Σ_t / d, the known images' mean variance: the
    distances of unit vectors in units of 1/v are hundreds, so this brings known(x) to a few units
    (as the cosine rule's) and its round-off with it, and changes neither its sign nor its ranking.

    In float64: the distances are differences of terms hundreds of times larger (Σ⁻¹ of unit
    vectors' small variances), which fp32 resolves only to about 1e-3. The (B, d) x (d, d) and
    (B, d) x (d, C) products cost next to nothing beside the ViT, on any device."""

    def __init__(self, moments: Moments, bias: Tensor):
        super().__init__()
        mu0, within, full, variance = moments.gaussians()
        mean_p = moments.means @ within  # (C, d): (x - μ_c)ᵀ P (x - μ_c) = xᵀPx - 2 xᵀPμ_c + μ_cᵀPμ_c
        self.register_buffer("within", within)
        self.register_buffer("full", full)
        self.register_buffer("mu0", mu0)
        self.register_buffer("mean_p", mean_p)
        self.register_buffer("const", (mean_p * moments.means).sum(1))
        self.register_buffer("bias", bias.double())
        self.register_buffer("scale", torch.tensor(max(variance, 1e-12), dtype=torch.float64))

    def scores(self, features: Tensor) -> Tensor:
        """rmd_c(x) (B, C), float64."""
        x = F.normalize(features.double(), dim=-1)
        own = (x @ self.within * x).sum(1, keepdim=True) - 2 * x @ self.mean_p.T + self.const  # (B, C)
        z = x - self.mu0
        return (z @ self.full * z).sum(1, keepdim=True) - own

    def forward(self, features: Tensor) -> Tensor:
        return ((self.scores(features) - self.bias).max(dim=1).values * self.scale).float()


class CosineKnown(nn.Module):
    """known(x) (B,) of the cosine rule from f_0 (B, d) (``known_scores``), as a module."""

    def __init__(self, prototypes: Tensor, bias: Tensor):
        super().__init__()
        self.register_buffer("prototypes", prototypes.float().clone())
        self.register_buffer("bias", bias.float().clone())

    def forward(self, features: Tensor) -> Tensor:
        return known_scores(features, self.prototypes, self.bias)


def check_rmd(tensors: dict[str, Tensor], num_classes: int, width: int) -> str | None:
    """What is wrong with a model's rmd tensors (``RMD_TENSORS``, every class), or None."""
    shapes = {RMD_MEAN: (num_classes, width), RMD_COUNT: (num_classes,), RMD_BIAS: (num_classes,),
              RMD_SCATTER: (width, width), RMD_SCATTER_COUNTS: (2,)}  # fmt: skip
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            return f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}"
        if not bool(torch.isfinite(tensors[name]).all()):
            return f"{name} holds NaN or infinite values"
    counts, (images, classes) = tensors[RMD_COUNT], tensors[RMD_SCATTER_COUNTS].tolist()
    if bool((counts < 1).any()) or not 1 <= classes <= images:
        return f"{RMD_COUNT} / {RMD_SCATTER_COUNTS} hold counts no stage writes"
    try:
        Moments.from_tensors(tensors).gaussians()
    except ValueError as exc:
        return str(exc)
    return None


# ------------------------------------------------------------------------------ evaluation


def check_bias(bias: Tensor, num_classes: int) -> str | None:
    """What is wrong with a loaded bias tensor, or None."""
    if bias.dim() != 1 or bias.numel() != num_classes:
        return f"{BIAS} has shape {tuple(bias.shape)}, expected ({num_classes},)"
    if not bool(torch.isfinite(bias).all()) or not bool((bias.abs() <= 2).all()):
        return f"{BIAS} holds values outside [-2, 2] (cosine thresholds)"
    return None
