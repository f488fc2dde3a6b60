"""Open-set answers: "unknown" for an image unlike every class the model has learned.

Two rules, both from class-level statistics of the subspace-0 feature f_0 (the PTM's; stage 1's for
``ease``), chosen by ``open_set.score`` (``docs/benchmarks.md``, "Issue 19"):

- ``rmd`` (the default): the relative Mahalanobis distance (Ren et al. 2021) on x, the unit vector
  along [f_0/‖f_0‖, w t/‖t‖] (``rmd_input``), t the class token after an earlier PTM block, through
  the final norm (``open_set.probe_depth``: block 7 of DeiT's 12; w ``open_set.probe_weight`` 2),
  taken from the same single pass. The earlier block knows what the image is made of before the
  last blocks turn it into a class: with it, over three class orders, test AUROC rose from 0.906
  to 0.924 (Caltech-101) and 0.753 to 0.771 (Caltech-101-Sketch). Without a probe block (``ease``,
  ``probe_depth: null``, runs learned before it), x = f_0/‖f_0‖.
  With μ_c the mean of class c's x, Σ_w their pooled within-class covariance and (μ_0, Σ_t) the
  Gaussian of all known images, each covariance shrunk by ``SHRINK`` towards its mean variance
  (``shrunk``),

      rmd_c(x) = (x - μ_0)ᵀ Σ_t⁻¹ (x - μ_0) - (x - μ_c)ᵀ Σ_w⁻¹ (x - μ_c),

  high when x is nearer class c than the bulk of known images. It separated unknown images better
  than the cosine on both datasets and all three class orders of the validation splits (Sketch
  +0.047 AUROC on average). Each stage stores its classes' means and image counts and its summed
  within-class scatter (``Moments``); the model sums them.
- ``cosine``: the cosine of f_0 to class c's prototype in subspace 0 (the earlier default).
  A run whose stages lack the ``rmd`` statistics (learned before they existed) answers by it.

Class c claims an image when its score reaches c's bias b_c; an image no class claims is unknown:

    known(x) = max_c [score_c(x) - b_c],     unknown  <=>  known(x) < 0

with b_c the mean of the learned classes' stage thresholds (``open_set_bias``): one threshold for
the model, set from every stage's own calibration (per-stage thresholds separated less well).

Calibration, per stage at commit time, from its own training images only: a share of each class's
images (``open_set.holdout``, at least one) is held out, the stage's statistics are recomputed
without them (the cosine's prototypes; for ``rmd`` the earlier stages' moments joined with the
kept images'), and the stage's threshold t is the ``open_set.rejection`` quantile of the held-out
images' best score; each class of the stage stores t (``unknown_bias``, ``unknown_rmd_bias``).
No image or per-image feature is kept: only these numbers and the moments go into the stage.

- cosine: the best score over the stage's classes, a plain quantile. A cosine threshold holds for
  the life of the run (prototypes never change).
- rmd: the best score over every class learned so far, as the model will score them, and a
  class-balanced quantile (``balanced_quantile``: each class weighs the same, as on a balanced
  test). An rmd threshold is set against the statistics of its commit, which later classes move.
  Over three class orders the share of known test images rejected for a 5 % target was 5.1 %
  (Caltech-101) and 4.9 % (Caltech-101-Sketch); scoring the stage's classes alone with a plain
  quantile, as before, gave 5.3 % and 2.1 % on f_0 (``docs/benchmarks.md``, "calibration").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import OpenSetConfig
from .ranpac import shrunk  # the class-covariance head's shrinkage

BIAS = "unknown_bias"  # the per-class tensor name, in a stage's weights and among restore.py's tensors
# the rmd rule's tensors, under the same names in a stage's weights (its classes, its scatter) and
# among restore.py's tensors (every class; the scatters and their counts summed over the stages)
RMD_MEAN = "unknown_mean"  # (n, w) per class: the mean of x (``rmd_input`` normalised; w = d or 2d)
RMD_COUNT = "unknown_count"  # (n,) per class: its images
RMD_BIAS = "unknown_rmd_bias"  # (n,) per class: its stage's rmd threshold
RMD_SCATTER = "unknown_scatter"  # (w, w) the summed within-class scatter of x
RMD_SCATTER_COUNTS = "unknown_scatter_counts"  # (2,) the images and classes that scatter sums over
RMD_ROWS = (RMD_MEAN, RMD_COUNT, RMD_BIAS)  # one row per class (``forget`` takes a class's out)
RMD_TENSORS = (*RMD_ROWS, RMD_SCATTER, RMD_SCATTER_COUNTS)
_MOMENT_NAMES = (RMD_MEAN, RMD_COUNT, RMD_SCATTER, RMD_SCATTER_COUNTS)  # Moments' fields, in order
RULES = ("rmd", "cosine")
SHRINK = 0.5  # of both covariances towards their mean variance (0.3 / 0.5 / 0.7 tied on validation)


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
    rule: str = "cosine"  # the rule that answered (``RULES``)
    probe_block: int | None = None  # the PTM block whose class token the rmd rule read beside f_0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def open_set_report(
    known_known: Tensor,
    known_correct: Tensor,
    unknown_known: Tensor,
    *,
    rule: str = "cosine",
    probe_block: int | None = None,
) -> OpenSetReport:
    """From known(x) of the known images, whether each was classified correctly, and known(x) of the
    unknown images, under ``rule``."""
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
        rule=rule,
        probe_block=probe_block,
    )


def check_bias(bias: Tensor, num_classes: int) -> str | None:
    """What is wrong with a loaded bias tensor, or None."""
    if bias.dim() != 1 or bias.numel() != num_classes:
        return f"{BIAS} has shape {tuple(bias.shape)}, expected ({num_classes},)"
    if not bool(torch.isfinite(bias).all()) or not bool((bias.abs() <= 2).all()):
        return f"{BIAS} holds values outside [-2, 2] (cosine thresholds)"
    return None


__all__ = [
    "BIAS",
    "RMD_TENSORS",
    "RULES",
    "Calibration",
    "CosineKnown",
    "Moments",
    "OpenSetReport",
    "RmdKnown",
    "auroc",
    "calibrate",
    "check_bias",
    "check_rmd",
    "known_scores",
    "open_set_bias",
]
