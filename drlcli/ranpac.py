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
from .config import RanpacConfig, RunConfig
from .methods.ranpac import TENSOR_PREFIX as PREFIX  # tensor names in a stage's weights file

if TYPE_CHECKING:
    from .api import LoadedRun

STAT_DTYPE = torch.float64  # statistics are summed and solved in float64, stored as float32


def random_projection(width: int, proj_dim: int, *, seed: int) -> Tensor:
    """R (d, M), N(0, 1) entries (RanPAC's W_rand), from its own generator."""
    return torch.randn(width, proj_dim, generator=torch.Generator().manual_seed(seed))


def head_input(features: Tensor, input_dim: int) -> Tensor:
    """The head's input h: the leading subspaces of (B, S, d) features, concatenated, (B, input_dim);
    one subspace (f_0, RanPAC's) or more (``ranpac.subspaces``: [f_0, f_1] adds stage 1's)."""
    return features[:, : input_dim // features.shape[-1]].flatten(1)


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
    """Scores from the PTM subspace: ReLU(f_0 R) W, (B, S, d) -> (B, C)."""

    def __init__(self, projection: Tensor, weight: Tensor):
        super().__init__()
        self.register_buffer("projection", projection.float().contiguous())  # (d, M)
        self.register_buffer("weight", weight.float().contiguous())  # (M, C)

    def forward(self, features: Tensor) -> Tensor:
        # the head lives on the model's device and scores in fp32 (``IncrementalModel.scores``): no
        # per-batch copy, and no `.to(features)` that a traced graph would record with its device
        phi = F.relu(head_input(features, self.projection.shape[0]) @ self.projection)  # (B, M)
        return phi @ self.weight

    @classmethod
    def from_state(cls, state: dict[str, Tensor]) -> RanpacHead:
        return cls(state["projection"], state["weight"])

    @classmethod
    def from_stages(cls, stage_tensors: list[dict[str, Tensor]]) -> RanpacHead:
        """R from stage 1's weights, W from the newest stage's."""
        return cls(stage_tensors[0][f"{PREFIX}projection"], stage_tensors[-1][f"{PREFIX}weight"])


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
        width = features.shape[-1] * cfg.subspaces
        proj_dim = cfg.resolved_proj_dim(features.shape[-1])
        projection = random_projection(width, proj_dim, seed=config.train.seed).to(STAT_DTYPE)
    else:
        projection = head.projection.to(STAT_DTYPE)
    val_all = validation_mask(
        torch.tensor(image_labels), fraction=cfg.val_fraction, seed=config.train.seed + stage_index
    )
    val = val_all if indices is None else val_all[torch.tensor(indices, dtype=torch.long)]
    phi = expand(head_input(features, projection.shape[0]).cpu(), projection)
    stage = Statistics.of(phi, labels.cpu(), num_classes, val).all_reduced()
    run, manifest = loaded.run, loaded.manifest
    previous = [Statistics.from_tensors(run.stage_statistics(i, manifest)) for i in run.stage_indices(manifest)]
    total = Statistics.accumulate([*previous, stage])
    lambdas = lambda_grid(cfg)
    lam, errors = choose_lambda(total, lambdas)
    weight = solve(total, lam)
    new_head = RanpacHead(projection, weight)
    tensors = {f"{PREFIX}weight": new_head.weight}
    if head is None:
        tensors[f"{PREFIX}projection"] = new_head.projection
    meta = {
        "lambda": lam,
        "validation_errors": dict(zip([f"{x:g}" for x in lambdas], errors)),
        "num_fit": total.num_fit,
        "num_val": total.num_val,
        "proj_dim": projection.shape[1],
        "seconds": round(time.perf_counter() - start, 3),
    }
    return StageFit(new_head, tensors, stage.to_tensors(), meta, weight.numel())
