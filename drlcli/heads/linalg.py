"""Covariance shrinkage shared by the ridge head's class covariances and the open-set rmd score."""

from __future__ import annotations

import torch
from torch import Tensor


def shrunk(covariance: Tensor, amount: float) -> Tensor:
    """(1 − a) Σ + a (tr Σ / d) I, plus 1e-8 I so that Σ of equal images still inverts (d, d)."""
    d = covariance.shape[-1]
    eye = torch.eye(d, dtype=covariance.dtype)
    return (1 - amount) * covariance + (amount * torch.trace(covariance) / d + 1e-8) * eye
