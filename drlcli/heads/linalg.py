"""Linear algebra shared by the ridge head and the open-set rmd score: covariance shrinkage, and the
ridge map that follows features across a stage that moves the network (a carried run)."""

from __future__ import annotations

import torch
from torch import Tensor


def shrunk(covariance: Tensor, amount: float) -> Tensor:
    """(1 − a) Σ + a (tr Σ / d) I, plus 1e-8 I so that Σ of equal images still inverts (d, d)."""
    d = covariance.shape[-1]
    eye = torch.eye(d, dtype=covariance.dtype)
    return (1 - amount) * covariance + (amount * torch.trace(covariance) / d + 1e-8) * eye


def ridge_map(x: Tensor, y: Tensor, lam: float) -> tuple[Tensor, Tensor]:
    """(B, b) with y ≈ x + x B + b, by ridge on the centred residual (x, y: (n, d))."""
    mx, my = x.mean(0), y.mean(0)
    xc, rc = x - mx, (y - x) - (my - mx)
    b_mat = torch.linalg.solve(xc.T @ xc + lam * torch.eye(x.shape[1], dtype=x.dtype), xc.T @ rc)
    return b_mat, (my - mx) - mx @ b_mat
