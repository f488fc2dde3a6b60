"""The RanPAC baseline (McDonnell et al., "RanPAC: Random Projections and Pre-trained Models for
Continual Learning", NeurIPS 2023), its analytic phase: nothing is trained.

The frozen PTM's feature h (d) is expanded by a fixed random matrix R (d, M) and a ReLU,
φ(h) = ReLU(h R) (RanPAC Eq. 3; R ~ N(0, 1), seeded, stored in stage 1's weights so it never
depends on RNG reproducibility). A class's score is the ridge regression output φ(h) W, with

    W = (G + λI)⁻¹ Q,    G = Σ φ φᵀ (M, M),    Q = Σ φ yᵀ (M, C)        (RanPAC Eq. 4-5)

over every image seen so far (y one-hot). G and Q are sums, so stages accumulate them exactly:
no image or per-image feature is kept, and the result equals the ridge on all data at once.

λ is chosen from statistics alone. Each stage's images are split per class, 80/20 (seeded); the
two parts are accumulated apart (fit: G_f, Q_f; validation: G_v, Q_v, n_v). For each λ of the
log grid, W_λ = (G_f + λI)⁻¹ Q_f and its validation squared error is

    ‖Φ_v W_λ − Y_v‖² = tr(W_λᵀ G_v W_λ) − 2 tr(W_λᵀ Q_v) + n_v        (one-hot rows: ‖Y_v‖² = n_v)

The best λ then solves on the sum: W = (G_f + G_v + λI)⁻¹ (Q_f + Q_v).

Storage per stage: ``weights.safetensors`` holds W for every class seen so far (M, C) (scoring
uses the newest stage's) and, in stage 1, R (d, M). ``statistics.safetensors`` holds the stage's
increments: G_f and G_v as packed upper triangles (M(M+1)/2 fp32 each: 18 MB at M 3000), and Q_f,
Q_v for the stage's own classes only (an old class's columns of Q never change: its y is 0 in
later stages). It is read only to learn a later stage. The optional first-stage adaptation of
the PTM (RanPAC's phase 1) is not implemented.

Class covariances (``ranpac.covariance_weight`` w > 0; drl's default, not RanPAC's): a second,
FeCAM-style score on x = f_0 / ‖f_0‖, the negative Mahalanobis distance to each class's mean,

    m_c(x) = −(x − μ_c)ᵀ P_c (x − μ_c),    P_c = shrink_a((1 − b) S_c + b S)⁻¹,
    shrink_a(S) = (1 − a) S + a (tr S / d) I,

S_c the class's covariance, S the within-class covariance pooled over every class seen (a
``covariance_shrink``, b ``covariance_blend``). The two scores are put on one scale per image by
standardising each over the classes (z(s) = (s − mean) / std) and added: z(ridge) + w z(m). Each
stage stores its classes' μ_c and S_c (weights file, one row per class) and its summed
within-class scatter with its image and class counts (statistics file); the newest stage's
weights hold the pooled S and (w, a, b). The precisions are computed when the head is built, so
every class's P_c uses the newest S (``docs/benchmarks.md``: freezing them at their own stage lost
the gain on Caltech-101).

The PTM's layout (``ranpac.layout_grid`` g > 0; drl's default g 2, not RanPAC's): the ridge's input
is h = [f_0, l_1, ..., l_g²], l_k the mean of the PTM's final patch tokens over cell k of a g x g
grid of the image (``backbone.ptm_layout``, from the same PTM pass: its last block runs for every
token instead of the class token alone). The class token is trained to ignore where things are;
the cells keep it, which separates classes such as Caltech-101's Faces and Faces_easy (the same
faces, framed wide or tight). ``ranpac.layout_scale`` s weighs the cells against f_0; it is folded
into R (the cells' rows times s), so scoring costs nothing for it. g is stored in stage 1's weights
beside R. The class covariances stay on f_0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import distributed
from .config import MAX_LAYOUT_GRID, RanpacConfig, RunConfig
from .errors import IntegrityError
from .methods.ranpac import TENSOR_PREFIX as PREFIX  # tensor names in a stage's weights file

if TYPE_CHECKING:
    from .api import LoadedRun

STAT_DTYPE = torch.float64  # statistics are summed and solved in float64, stored as float32


LAYOUT = f"{PREFIX}layout"  # () int64 in stage 1's weights: g, the PTM layout grid of the head's input


def random_projection(
    width: int, proj_dim: int, *, seed: int, layout_rows: int = 0, layout_scale: float = 1.0
) -> Tensor:
    """R (width, M), N(0, 1) entries (RanPAC's W_rand), from its own generator; its last
    ``layout_rows`` rows (those the PTM layout meets) times ``layout_scale``: ReLU([f_0, s·l] R)
    with l the layout is ReLU([f_0, l] R'), so the scale lives in R and costs nothing to score."""
    projection = torch.randn(width, proj_dim, generator=torch.Generator().manual_seed(seed))
    if layout_rows:
        projection[width - layout_rows :] *= layout_scale
    return projection


def head_input(features: Tensor, input_dim: int, layout_cells: int = 0) -> Tensor:
    """The head's input h, (B, input_dim): the leading subspaces of (B, S, d) features (f_0, RanPAC's;
    ``ranpac.subspaces`` 2: [f_0, f_1]) and, with ``layout_cells`` > 0, the last that many rows
    (the PTM's layout, ``backbone.ptm_layout``), concatenated."""
    subspaces = input_dim // features.shape[-1] - layout_cells
    rows = features[:, :subspaces]
    if layout_cells:
        rows = torch.cat([rows, features[:, features.shape[1] - layout_cells :]], dim=1)
    return rows.flatten(1)


def check_layout(value: Tensor | None) -> int:
    """g from a stored layout tensor (None: 0, no layout); ``ValueError`` for anything but a small
    non-negative integer."""
    if value is None:
        return 0
    if value.numel() != 1 or value.dtype != torch.int64 or not 0 <= int(value) <= MAX_LAYOUT_GRID:
        raise ValueError(f"{LAYOUT} must be one int64 in [0, {MAX_LAYOUT_GRID}], got {value.dtype} {value.tolist()}")
    return int(value)


def expand(features: Tensor, projection: Tensor) -> Tensor:
    """φ = ReLU(h R): (N, d) -> (N, M), in the projection's dtype."""
    return F.relu(features.to(projection) @ projection)


def lambda_grid(cfg: RanpacConfig) -> list[float]:
    return [10.0**e for e in range(cfg.lambda_min_exp, cfg.lambda_max_exp + 1)]


def validation_mask(labels: Tensor, *, fraction: float, seed: int) -> Tensor:
    """(N,) bool: ``fraction`` of each class's images (rounded, at least 1 of 2+) held out for λ."""
    rng = np.random.RandomState(seed)
    mask = torch.zeros(len(labels), dtype=torch.bool)
    for c in torch.unique(labels).tolist():
        idx = (labels == c).nonzero().squeeze(1)
        n_val = min(max(1, round(fraction * len(idx))), len(idx) - 1)
        if n_val > 0:
            mask[idx[torch.from_numpy(rng.permutation(len(idx))[:n_val])]] = True
    return mask


# ------------------------------------------------------------------------- class covariances

COV_MEAN = f"{PREFIX}cov_mean"  # (n, d) per class of the stage
COV_COVARIANCE = f"{PREFIX}cov_covariance"  # (n, d, d) per class of the stage
COV_SHARED = f"{PREFIX}cov_shared"  # (d, d) pooled within-class covariance, newest stage
COV_PARAMS = f"{PREFIX}cov_params"  # (3,) w, a, b, newest stage
COV_SCATTER, COV_COUNTS = "cov_scatter", "cov_counts"  # statistics: (d, d) summed scatter, (2,) images, classes


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


def shrunk(covariance: Tensor, amount: float) -> Tensor:
    """(1 − a) Σ + a (tr Σ / d) I, plus 1e-8 I so that Σ of equal images still inverts (d, d)."""
    d = covariance.shape[-1]
    eye = torch.eye(d, dtype=covariance.dtype)
    return (1 - amount) * covariance + (amount * torch.trace(covariance) / d + 1e-8) * eye


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


# ---------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Statistics:
    """Sums over images: fit and validation parts. Q's columns are the classes these images cover."""

    gram_fit: Tensor  # (M, M)
    gram_val: Tensor  # (M, M)
    q_fit: Tensor  # (M, C)
    q_val: Tensor  # (M, C)
    num_fit: float
    num_val: float  # = ‖Y_v‖² for one-hot targets

    @classmethod
    def of(cls, phi: Tensor, labels: Tensor, num_classes: int, val: Tensor) -> Statistics:
        """A stage's statistics from φ (N, M), local labels (N,) in [0, num_classes), val mask (N,)."""
        phi = phi.to(STAT_DTYPE)
        y = F.one_hot(labels, num_classes).to(STAT_DTYPE)  # (N, C)
        fit = ~val
        return cls(
            phi[fit].T @ phi[fit],
            phi[val].T @ phi[val],
            phi[fit].T @ y[fit],
            phi[val].T @ y[val],
            float(fit.sum()),
            float(val.sum()),
        )

    def all_reduced(self) -> Statistics:
        """Summed over processes (each holding a shard of the images)."""
        if distributed.world_size() == 1:
            return self
        counts = distributed.all_reduce_sum(torch.tensor([self.num_fit, self.num_val], dtype=STAT_DTYPE))
        return Statistics(
            *(distributed.all_reduce_sum(t) for t in (self.gram_fit, self.gram_val, self.q_fit, self.q_val)),
            float(counts[0]),
            float(counts[1]),
        )

    @staticmethod
    def accumulate(parts: list[Statistics]) -> Statistics:
        """The statistics of all parts' images; parts cover disjoint classes (stages), in class order."""
        return Statistics(
            sum(p.gram_fit for p in parts[1:]) + parts[0].gram_fit,
            sum(p.gram_val for p in parts[1:]) + parts[0].gram_val,
            torch.cat([p.q_fit for p in parts], dim=1),
            torch.cat([p.q_val for p in parts], dim=1),
            sum(p.num_fit for p in parts),
            sum(p.num_val for p in parts),
        )

    def to_tensors(self) -> dict[str, Tensor]:
        return {
            "gram_fit": pack(self.gram_fit),
            "gram_val": pack(self.gram_val),
            "q_fit": self.q_fit.float(),
            "q_val": self.q_val.float(),
            "counts": torch.tensor([self.num_fit, self.num_val], dtype=STAT_DTYPE),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> Statistics:
        m = tensors["q_fit"].shape[0]
        counts = tensors["counts"].tolist()
        return cls(
            unpack(tensors["gram_fit"], m),
            unpack(tensors["gram_val"], m),
            tensors["q_fit"].to(STAT_DTYPE),
            tensors["q_val"].to(STAT_DTYPE),
            counts[0],
            counts[1],
        )


def pack(gram: Tensor) -> Tensor:
    """Upper triangle of a symmetric (M, M) matrix, row by row, float32: (M(M+1)/2,)."""
    return gram[torch.ones_like(gram, dtype=torch.bool).triu()].float()


def unpack(packed: Tensor, size: int) -> Tensor:
    upper = torch.ones(size, size, dtype=torch.bool).triu()
    out = torch.zeros(size, size, dtype=STAT_DTYPE)
    out[upper] = packed.to(STAT_DTYPE)
    return out + out.triu(1).T


# -------------------------------------------------------------------------------- ridge


def validation_errors(stats: Statistics, lambdas: list[float]) -> list[float]:
    """Validation squared error of W_λ = (G_f + λI)⁻¹ Q_f for each λ, from the statistics alone.

    One eigendecomposition G_f = U diag(s) Uᵀ serves every λ: Uᵀ W_λ = (Uᵀ Q_f) / (s + λ).
    """
    s, u = torch.linalg.eigh(stats.gram_fit)
    s = s.clamp_min(0)  # G_f is PSD; round-off may make its null eigenvalues slightly negative
    a = u.T @ stats.q_fit  # (M, C)
    b = u.T @ stats.gram_val @ u  # (M, M)
    c = u.T @ stats.q_val  # (M, C)
    errors = []
    for lam in lambdas:
        w = a / (s + lam)[:, None]  # Uᵀ W_λ
        errors.append(float((w * (b @ w)).sum() - 2 * (w * c).sum() + stats.num_val))
    return errors


def choose_lambda(stats: Statistics, lambdas: list[float]) -> tuple[float, list[float]]:
    """The λ of smallest validation error (the first on ties); λ 1 when nothing is held out."""
    if stats.num_val == 0:
        return 1.0, []
    errors = validation_errors(stats, lambdas)
    return lambdas[int(np.argmin(errors))], errors


def solve(stats: Statistics, lam: float) -> Tensor:
    """W = (G_f + G_v + λI)⁻¹ (Q_f + Q_v): (M, C), float64."""
    gram = stats.gram_fit + stats.gram_val
    eye = torch.eye(gram.shape[0], dtype=gram.dtype)
    return torch.linalg.solve(gram + lam * eye, stats.q_fit + stats.q_val)


# --------------------------------------------------------------------------------- head


class RanpacHead(nn.Module):
    """Scores from the PTM subspace, (B, S, d) -> (B, C): ReLU(f_0 R) W, or with class covariances
    z(ReLU(f_0 R) W) + w z(m(x)) (module docstring)."""

    def __init__(
        self,
        projection: Tensor,
        weight: Tensor,
        cov_mean: Tensor | None = None,
        cov_precision: Tensor | None = None,
        cov_weight: Tensor | None = None,
        layout: int = 0,
    ):
        super().__init__()
        self.layout_grid = layout  # g: the input ends with the PTM's g² layout rows (0: none)
        self.register_buffer("layout", torch.tensor(layout) if layout else None)
        self.register_buffer("projection", projection.float().contiguous())  # (d, M)
        self.register_buffer("weight", weight.float().contiguous())  # (M, C)
        parts = (cov_mean, cov_precision, cov_weight)
        if any(p is not None for p in parts):
            if any(p is None for p in parts):
                raise ValueError("the class-covariance head needs cov_mean, cov_precision and cov_weight")
            num_classes, width = weight.shape[1], cov_mean.shape[-1]
            if (
                tuple(cov_mean.shape) != (num_classes, width)
                or tuple(cov_precision.shape) != (num_classes, width, width)
                or cov_weight.numel() != 1
            ):
                raise ValueError(
                    f"class-covariance tensors of shapes {tuple(cov_mean.shape)}, {tuple(cov_precision.shape)}, "
                    f"{tuple(cov_weight.shape)} do not fit {num_classes} classes"
                )
            parts = tuple(p.float().contiguous() for p in (cov_mean, cov_precision, cov_weight.reshape(())))
        self.register_buffer("cov_mean", parts[0])  # (C, d); None: plain ridge (RanPAC's)
        self.register_buffer("cov_precision", parts[1])  # (C, d, d)
        self.register_buffer("cov_weight", parts[2])  # () w

    def forward(self, features: Tensor) -> Tensor:
        # the head lives on the model's device and scores in fp32 (``IncrementalModel.scores``): no
        # per-batch copy, and no `.to(features)` that a traced graph would record with its device
        cells = self.layout_grid**2
        phi = F.relu(head_input(features, self.projection.shape[0], cells) @ self.projection)  # (B, M)
        scores = phi @ self.weight
        if self.cov_mean is None:
            return scores
        diff = covariance_input(features)[:, None, :] - self.cov_mean  # (B, C, d)
        distance = (torch.einsum("bcd,cde->bce", diff, self.cov_precision) * diff).sum(-1)  # (B, C)
        return standardise(scores) - self.cov_weight * standardise(distance)

    def check_width(self, width: int) -> None:
        """ValueError unless the head reads one or two subspaces of the network's ``width`` (and its
        layout rows) and its class covariances have that width."""
        cells = self.layout_grid**2
        rows = self.projection.shape[0] if self.projection.dim() == 2 else -1
        allowed = [width * (subspaces + cells) for subspaces in (1, 2)]
        if rows not in allowed:
            raise ValueError(f"the head's projection has {rows} input rows, not {' or '.join(map(str, allowed))}")
        if self.cov_mean is not None and self.cov_mean.shape[-1] != width:
            raise ValueError(f"the class covariances have width {self.cov_mean.shape[-1]}, not the network's {width}")

    def stages_read(self, width: int) -> int:
        """How many stage subspaces after f_0 the head reads (0: f_0 alone, RanPAC's)."""
        return self.projection.shape[0] // width - self.layout_grid**2 - 1

    @classmethod
    def from_state(cls, state: dict[str, Tensor]) -> RanpacHead:
        return cls(
            state["projection"],
            state["weight"],
            state.get("cov_mean"),
            state.get("cov_precision"),
            state.get("cov_weight"),
            layout=check_layout(state.get("layout")),
        )

    @classmethod
    def from_stages(cls, stage_tensors: list[dict[str, Tensor]]) -> RanpacHead:
        """R from stage 1's weights, W (and, with class covariances, S and w, a, b) from the newest
        stage's, μ_c and S_c from each class's own stage."""
        first = stage_tensors[0]
        layout = check_layout(first.get(LAYOUT))
        return cls.assemble(first[f"{PREFIX}projection"], stage_tensors[-1], stage_tensors, layout=layout)

    @classmethod
    def assemble(
        cls, projection: Tensor, newest: dict[str, Tensor], stages: list[dict[str, Tensor]], *, layout: int = 0
    ) -> RanpacHead:
        """The head from R, the newest stage's tensors and every stage's (for μ_c and S_c); ``layout``
        g as stage 1 stored it."""
        weight = newest[f"{PREFIX}weight"]
        if COV_PARAMS not in newest:
            return cls(projection, weight, layout=layout)
        if any(COV_MEAN not in t or COV_COVARIANCE not in t for t in stages) or COV_SHARED not in newest:
            raise ValueError("a stage lacks the class-covariance tensors its newest stage uses")
        params = newest[COV_PARAMS]
        if tuple(params.shape) != (3,):
            raise ValueError(f"{COV_PARAMS} has shape {tuple(params.shape)}, expected (3,)")
        cov_weight, shrink, blend = params.tolist()
        if not (0 <= cov_weight <= 100 and 0 <= shrink <= 1 and 0 <= blend <= 1):
            raise ValueError(f"{COV_PARAMS} {params.tolist()} is outside w [0, 100], a and b [0, 1]")
        covariances = torch.cat([t[COV_COVARIANCE] for t in stages])
        shared = newest[COV_SHARED]
        if covariances.dim() != 3 or tuple(shared.shape) != tuple(covariances.shape[1:]):
            raise ValueError(f"{COV_SHARED} has shape {tuple(shared.shape)}, not one class covariance's")
        return cls(
            projection,
            weight,
            torch.cat([t[COV_MEAN] for t in stages]),
            precisions(covariances, shared, shrink=shrink, blend=blend),
            torch.tensor(cov_weight),
            layout=layout,
        )


from_state = RanpacHead.from_state
from_stages = RanpacHead.from_stages


@dataclass(frozen=True)
class StageFit:
    head: RanpacHead
    tensors: dict[str, Tensor]  # into the stage's weights file
    statistics: dict[str, Tensor]  # the stage's statistics file
    meta: dict[str, Any]  # λ, validation errors, image counts, seconds
    num_params: int  # entries of W solved in this stage


def fit_stage(
    loaded: LoadedRun,
    features: Tensor,
    labels: Tensor,
    *,
    image_labels: list[int],
    indices: list[int] | None,
    num_classes: int,
    config: RunConfig,
    stage_index: int,
) -> StageFit:
    """Add a stage's images to the statistics and solve W for every class seen.

    ``features`` (N, S, d) and local ``labels`` (N,) are this process's shard (``indices`` of the
    stage's ``image_labels``; None: all); earlier stages' statistics are read from the run.
    """
    start = time.perf_counter()
    cfg = config.ranpac
    head = loaded.model.head
    if head is None:
        layout = cfg.layout_grid
        layout_rows = features.shape[-1] * layout**2
        width = features.shape[-1] * cfg.subspaces + layout_rows
        proj_dim = cfg.resolved_proj_dim(features.shape[-1])
        projection = random_projection(
            width, proj_dim, seed=config.train.seed, layout_rows=layout_rows, layout_scale=cfg.layout_scale
        ).to(STAT_DTYPE)
    else:  # R and g as stage 1 stored them (the head was built from them), R on the CPU where the
        # statistics are summed: the head itself lives on the model's device, possibly a GPU
        layout = head.layout_grid
        projection = loaded.stage_tensors[0][f"{PREFIX}projection"].to(STAT_DTYPE)
    val_all = validation_mask(
        torch.tensor(image_labels), fraction=cfg.val_fraction, seed=config.train.seed + stage_index
    )
    val = val_all if indices is None else val_all[torch.tensor(indices, dtype=torch.long)]
    phi = expand(head_input(features, projection.shape[0], layout**2).cpu(), projection)
    stage = Statistics.of(phi, labels.cpu(), num_classes, val).all_reduced()
    run, manifest = loaded.run, loaded.manifest
    previous_files = [run.stage_statistics(i, manifest) for i in run.stage_indices(manifest)]
    total = Statistics.accumulate([*map(Statistics.from_tensors, previous_files), stage])
    lambdas = lambda_grid(cfg)
    lam, errors = choose_lambda(total, lambdas)
    weight = solve(total, lam)
    tensors = {f"{PREFIX}weight": weight.float()}
    if head is None:
        tensors[f"{PREFIX}projection"] = projection.float()
        if layout:
            tensors[LAYOUT] = torch.tensor(layout)
    statistics = stage.to_tensors()
    if cfg.covariance_weight > 0:
        if head is not None and head.cov_mean is None:
            raise IntegrityError(
                f"run {run.path} asks for class covariances (ranpac.covariance_weight) that its stages lack; "
                "restore it from a backup"
            )
        moments = ClassMoments.of(covariance_input(features).cpu(), labels.cpu(), num_classes).all_reduced()
        scatters = moments.scatters()
        statistics[COV_SCATTER] = scatters.sum(0).float()
        statistics[COV_COUNTS] = torch.tensor([float(moments.counts.sum()), float(num_classes)], dtype=STAT_DTYPE)
        shared = pooled_covariance([*previous_files, statistics])
        scatters /= (moments.counts - 1).clamp_min(1)[:, None, None]  # the class covariances, in place
        tensors.update(
            {
                COV_MEAN: moments.means().float(),
                COV_COVARIANCE: scatters.float(),
                COV_SHARED: shared.float(),
                COV_PARAMS: torch.tensor([cfg.covariance_weight, cfg.covariance_shrink, cfg.covariance_blend]),
            }
        )
    # μ_c and S_c of earlier stages' classes: their weights files as the run was loaded (forget edits them there)
    earlier = loaded.stage_tensors if COV_PARAMS in tensors else []
    new_head = RanpacHead.assemble(projection, tensors, [*earlier, tensors], layout=layout)
    meta = {
        "lambda": lam,
        "validation_errors": dict(zip([f"{x:g}" for x in lambdas], errors)),
        "num_fit": total.num_fit,
        "num_val": total.num_val,
        "proj_dim": projection.shape[1],
        "layout_grid": layout,
        "seconds": round(time.perf_counter() - start, 3),
    }
    return StageFit(new_head, tensors, statistics, meta, weight.numel())
