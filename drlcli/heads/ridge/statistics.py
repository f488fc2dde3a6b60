"""The ridge's statistics and solve (see the folder's docstring): G and Q summed over images, fit
and validation parts apart, λ chosen from them alone, W = (G + λI)⁻¹ Q. No image is kept."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ... import distributed
from ..base import TOTALS_MARK
from . import LAMBDA
from .options import RidgeConfig

STAT_DTYPE = torch.float64  # statistics are summed and solved in float64, stored as float32


def lambda_grid(cfg: RidgeConfig) -> list[float]:
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


@dataclass(frozen=True)
class Statistics:
    """Sums over images: fit and validation parts. Q's columns are the classes these images cover.
    A stage of a run holds its Q alone (``grams`` None) or, for the newest, also the running totals
    of G and the counts (``totals``); a stage of an earlier release holds its own increments of G."""

    gram_fit: Tensor | None  # (M, M)
    gram_val: Tensor | None  # (M, M)
    q_fit: Tensor  # (M, C)
    q_val: Tensor  # (M, C)
    num_fit: float
    num_val: float  # = ‖Y_v‖² for one-hot targets
    totals: bool = False  # G and the counts sum every stage up to this one
    lam: float | None = None  # the λ chosen by the stage whose totals these are (None: not recorded)

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
    def accumulate(parts: Iterable[Statistics]) -> Statistics:
        """The statistics of all parts' images; parts cover disjoint classes (stages), in class order.
        Folded one part at a time, in place: an iterator that makes each part when asked keeps one
        part's (M, M) Grams in memory beside the sums, however many stages there are. A part holding
        running totals replaces the Grams and counts summed so far (they are in it); a part without
        Grams adds its Q alone."""
        gram_fit: Tensor | None = None
        gram_val: Tensor | None = None
        num_fit = num_val = 0.0
        lam: float | None = None
        q_fit: list[Tensor] = []
        q_val: list[Tensor] = []
        for part in parts:
            q_fit.append(part.q_fit)
            q_val.append(part.q_val)
            if part.gram_fit is None or part.gram_val is None:
                continue
            if gram_fit is None or gram_val is None or part.totals:
                gram_fit, gram_val = part.gram_fit.clone(), part.gram_val.clone()
                num_fit, num_val, lam = part.num_fit, part.num_val, part.lam
            else:
                gram_fit.add_(part.gram_fit)
                gram_val.add_(part.gram_val)
                num_fit, num_val = num_fit + part.num_fit, num_val + part.num_val
        if gram_fit is None or gram_val is None:
            raise ValueError("no statistics to accumulate")
        q = torch.cat(q_fit, dim=1), torch.cat(q_val, dim=1)
        return Statistics(gram_fit, gram_val, *q, num_fit, num_val, True, lam)

    def own(self) -> dict[str, Tensor]:
        """A stage's statistics file: Q of its own classes."""
        return {"q_fit": self.q_fit.float(), "q_val": self.q_val.float()}

    def running(self) -> dict[str, Tensor]:
        """The Grams and counts, into the newest stage's totals."""
        if self.gram_fit is None or self.gram_val is None:
            raise ValueError("statistics without Grams have no totals")
        return {
            "gram_fit": pack(self.gram_fit),
            "gram_val": pack(self.gram_val),
            "counts": torch.tensor([self.num_fit, self.num_val], dtype=STAT_DTYPE),
        }

    def to_tensors(self) -> dict[str, Tensor]:
        return {**self.own(), **self.running()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> Statistics:
        """A stage's statistics (its file, and its totals when it is the newest); ``KeyError`` or
        ``ValueError`` for a file no stage writes."""
        m = tensors["q_fit"].shape[0]
        q_fit, q_val = tensors["q_fit"].to(STAT_DTYPE), tensors["q_val"].to(STAT_DTYPE)
        if "gram_fit" not in tensors and "gram_val" not in tensors:
            return cls(None, None, q_fit, q_val, 0.0, 0.0)
        counts = tensors["counts"].tolist()
        lam = tensors[LAMBDA].tolist() if LAMBDA in tensors else None
        return cls(
            unpack(tensors["gram_fit"], m),
            unpack(tensors["gram_val"], m),
            q_fit,
            q_val,
            counts[0],
            counts[1],
            TOTALS_MARK in tensors,
            lam[0] if isinstance(lam, list) and len(lam) == 1 else None,
        )


def pack(gram: Tensor) -> Tensor:
    """Upper triangle of a symmetric (M, M) matrix, row by row, float32: (M(M+1)/2,). Row slices, not
    a boolean mask of M² entries: a third of the time at M 3000."""
    return torch.cat([gram[i, i:] for i in range(gram.shape[0])]).float()


def unpack(packed: Tensor, size: int) -> Tensor:
    """``pack``'s inverse: the symmetric (size, size) matrix in float64, each packed row written as its
    row and its column (copies only: every entry exactly the packed one's)."""
    values = packed.to(STAT_DTYPE)
    out = torch.empty(size, size, dtype=STAT_DTYPE)
    for i, row in enumerate(torch.split(values, list(range(size, 0, -1)))):
        out[i, i:] = row
        out[i:, i] = row
    return out


def validation_errors(stats: Statistics, lambdas: list[float]) -> list[float]:
    """Validation squared error of W_λ = (G_f + λI)⁻¹ Q_f for each λ, from the statistics alone.

    One eigendecomposition G_f = U diag(s) Uᵀ serves every λ: Uᵀ W_λ = D_λ A with A = Uᵀ Q_f and
    D_λ = diag(1 / (s + λ)), so with B = Uᵀ G_v U and C = Uᵀ Q_v

        ‖Φ_v W_λ − Y_v‖² = Σ_ij B_ij (A Aᵀ)_ij / ((s_i + λ)(s_j + λ)) − 2 Σ_i (A ∘ C)_i· / (s_i + λ) + n_v

    A Aᵀ and the row sums of A ∘ C are formed once, so each λ costs M² whatever the number of classes.
    With few classes (a small stage), B is never formed: tr(W_λᵀ G_v W_λ) is taken directly per λ,
    3·M²·C a λ against the 2·M³ that forming B costs.
    """
    s, u = torch.linalg.eigh(stats.gram_fit)
    s = s.clamp_min(0)  # G_f is PSD; round-off may make its null eigenvalues slightly negative
    a = u.T @ stats.q_fit  # (M, C)
    cross = (a * (u.T @ stats.q_val)).sum(1)  # (M,)
    size, classes = a.shape
    if 3 * classes * len(lambdas) < 2 * size:
        fitted = []
        for lam in lambdas:
            w = u @ (a / (s + lam)[:, None])  # W_λ (M, C)
            fitted.append(float((w * (stats.gram_val @ w)).sum()))
    else:
        b_outer = (u.T @ stats.gram_val @ u) * (a @ a.T)  # B ∘ A Aᵀ (M, M)
        fitted = [float((1 / (s + lam)) @ b_outer @ (1 / (s + lam))) for lam in lambdas]
    return [f - 2 * float((cross / (s + lam)).sum()) + stats.num_val for f, lam in zip(fitted, lambdas)]


def kernel_errors(phi: Tensor, labels: Tensor, num_classes: int, val: Tensor, lambdas: list[float]) -> list[float]:
    """``validation_errors`` when G_f is the Gram of images at hand (Φ_f, n_f rows: stage 1), in the
    kernel form W_λ = Φ_fᵀ (K + λI)⁻¹ Y_f with K = Φ_f Φ_fᵀ = V diag(e) Vᵀ, so

        Φ_v W_λ = (Φ_v Φ_fᵀ V) diag(1 / (e + λ)) (Vᵀ Y_f)

    one n_f x n_f eigendecomposition for every λ (the same errors as the (M, M) one, in exact
    arithmetic; far cheaper while n_f < M)."""
    phi = phi.to(STAT_DTYPE)
    y = F.one_hot(labels, num_classes).to(STAT_DTYPE)
    fit = ~val
    e, v = torch.linalg.eigh(phi[fit] @ phi[fit].T)
    e = e.clamp_min(0)
    left = (phi[val] @ phi[fit].T) @ v  # (n_v, n_f)
    right = v.T @ y[fit]  # (n_f, C)
    return [float(((left / (e + lam)) @ right - y[val]).square().sum()) for lam in lambdas]


def ridge_error(stats: Statistics, lam: float) -> float:
    """The validation squared error of W_λ = (G_f + λI)⁻¹ Q_f by one Cholesky factorisation
    (inf where G_f + λI is not numerically positive definite)."""
    chol, info = torch.linalg.cholesky_ex(_shifted(stats.gram_fit, lam))
    if int(info):
        return float("inf")
    w = torch.cholesky_solve(stats.q_fit, chol)
    return float((w * (stats.gram_val @ w)).sum()) - 2 * float((w * stats.q_val).sum()) + stats.num_val


def local_search(stats: Statistics, lambdas: list[float], start: int) -> dict[float, float]:
    """The validation errors of the grid's λ from index ``start`` outwards, one step at a time while
    the smallest error so far lies at an end of the λ tried (ties: the smaller λ, as the grid's
    search), and upwards while no λ tried has factorised: the grid's choice wherever the error has
    one minimum over the grid."""
    errors = {start: ridge_error(stats, lambdas[start])}
    low = high = start
    while True:
        best = min(errors, key=lambda i: (errors[i], i))
        factorised = errors[best] < float("inf")
        if factorised and best == low and low > 0:
            low = step = low - 1
        elif (best == high or not factorised) and high < len(lambdas) - 1:
            high = step = high + 1
        else:
            return {lambdas[i]: errors[i] for i in sorted(errors)}
        errors[step] = ridge_error(stats, lambdas[step])


def choose_lambda(
    stats: Statistics, lambdas: list[float], *, start: float | None = None, errors: list[float] | None = None
) -> tuple[float, dict[float, float]]:
    """The λ of smallest validation error (the smaller on ties) and the errors of the λ tried; λ 1
    when nothing is held out. ``start``: a λ of the grid to search from (``local_search``); else
    every λ, by ``errors`` when given (``kernel_errors``), else by ``validation_errors``."""
    if stats.num_val == 0:
        return 1.0, {}
    if start is not None and start in lambdas:
        tried = local_search(stats, lambdas, lambdas.index(start))
    else:
        tried = dict(zip(lambdas, errors if errors is not None else validation_errors(stats, lambdas)))
    return min(tried, key=lambda lam: (tried[lam], lam)), tried


def sampled(stats: Statistics, classes: int, *, seed: int) -> Statistics:
    """``stats`` with at most ``classes`` of its C columns of Q, drawn at random (``seed``) and scaled by
    √(C / k): the validation error over k classes, times C / k (both its λ-dependent terms are
    quadratic in Q), estimates the error over every class at k/C of the work (``ranpac.lambda_classes``).
    ``stats`` itself when it has no more than ``classes`` classes, or ``classes`` is 0."""
    total = stats.q_fit.shape[1]
    if classes <= 0 or total <= classes:
        return stats
    keep = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:classes].sort().values
    scale = (total / classes) ** 0.5
    return replace(stats, q_fit=stats.q_fit[:, keep] * scale, q_val=stats.q_val[:, keep] * scale)


def solve(stats: Statistics, lam: float, *, previous: Tensor | None = None, phi: Tensor | None = None) -> Tensor:
    """W = (G_f + G_v + λI)⁻¹ (Q_f + Q_v): (M, C), float64 (by Cholesky; LU where it fails).

    ``previous`` (M, C_old), W of the first C_old classes solved at this λ before the images φ
    (N, M; this process's, under torchrun) were added to the Grams: those columns are moved rather
    than solved again, W_old = W_prev − (G + λI)⁻¹ Φᵀ (Φ W_prev), since (G + λI) W_old =
    (G − ΦᵀΦ + λI) W_prev = Q_old. Exact up to round-off, and 2·M²·N + 2·N·M·C_old multiply-adds
    instead of 2·M²·C_old: the work no longer grows with the classes seen."""
    gram = stats.gram_fit + stats.gram_val
    gram.diagonal().add_(lam)
    q = stats.q_fit + stats.q_val
    chol, info = torch.linalg.cholesky_ex(gram)
    failed = int(info)
    if previous is not None and phi is not None:  # every process takes the same branch: the moved one sums over them
        failed = int(distributed.all_reduce_sum(torch.tensor([float(failed)], dtype=STAT_DTYPE)).item())
    if failed:
        return torch.linalg.solve(gram, q)
    if previous is None or phi is None:
        return torch.cholesky_solve(q, chol)
    old = previous.to(STAT_DTYPE)
    moved = distributed.all_reduce_sum(torch.cholesky_solve(phi.T.to(STAT_DTYPE), chol) @ (phi.to(STAT_DTYPE) @ old))
    return torch.cat([old - moved, torch.cholesky_solve(q[:, old.shape[1] :], chol)], dim=1)


def _shifted(gram: Tensor, lam: float) -> Tensor:
    """G + λI, a new tensor."""
    out = gram.clone()
    out.diagonal().add_(lam)
    return out
