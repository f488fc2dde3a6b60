"""The prototype bank: real class means, semantic-guided synthesis for old classes, and scoring.

Shapes: a bank is (C, S, d) for C classes and S subspaces (subspace 0 is the PTM, subspace k is
stage k's stream). ``class_stage[c]`` is the 1-based stage that learned class c. A class learned
in stage i has real prototypes in subspaces 0..i; the others are synthesised (SPEC §2.3, after
EASE): P_j(o) = Σ_{r∈R_j} softmax_r(cos(P_i(o), P_i(r)) / τ) · P_j(r), R_j = classes of stages
j..t. Synthesis is derived state: it is recomputed from the real prototypes whenever needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def synthesize(real: Tensor, class_stage: Tensor, *, tau: float = 1.0) -> Tensor:
    """Fill the subspaces a class never saw. ``real`` (C, S, d) holds valid rows for j ≤ stage."""
    bank = real.clone()
    num_subspaces = real.shape[1]
    for i in range(1, num_subspaces):
        old = (class_stage == i).nonzero().squeeze(1)  # classes learned in stage i
        if old.numel() == 0:
            continue
        for j in range(i + 1, num_subspaces):
            donors = (class_stage >= j).nonzero().squeeze(1)  # R_j: real in both i and j
            sim = F.normalize(real[old, i], dim=-1) @ F.normalize(real[donors, i], dim=-1).T
            weights = torch.softmax(sim / tau, dim=1)  # (|old|, |R_j|)
            bank[old, j] = weights @ real[donors, j]
    return bank


def score_weights(class_stage: Tensor, num_subspaces: int, *, rho: float, beta: float) -> Tensor:
    """(C, S) weights of each subspace's cosine in a class's score (EASE's reweighting).

    score_c = cos(f_k, P_k(c)) + ρ·mean_{1≤j≤t, j≠k} cos(f_j, P_j(c)) + β·cos(f_0, P_0(c)),
    with k = class_stage[c] and t = S - 1. With no trained subspaces (t = 0: SimpleCIL) the
    score is the PTM cosine alone.
    """
    num_classes = class_stage.shape[0]
    weights = torch.zeros(num_classes, num_subspaces)
    if num_subspaces == 1:
        weights[:, 0] = 1.0
        return weights
    t = num_subspaces - 1
    weights[:, 0] = beta
    if t > 1:
        weights[:, 1:] = rho / (t - 1)
    weights[torch.arange(num_classes), class_stage] = 1.0
    return weights


def score(
    features: Tensor,
    bank: Tensor,
    class_stage: Tensor,
    *,
    rule: str = "reweight",
    rho: float = 0.1,
    beta: float = 1.0,
) -> Tensor:
    """Class scores (B, C) for features (B, S, d) against a full bank (C, S, d)."""
    if rule == "concat":
        flat_f = F.normalize(features.flatten(1), dim=-1)  # (B, S·d)
        flat_p = F.normalize(bank.flatten(1), dim=-1)  # (C, S·d)
        return flat_f @ flat_p.T
    cos = torch.einsum("bsd,csd->bcs", F.normalize(features, dim=-1), F.normalize(bank, dim=-1))  # (B, C, S)
    weights = score_weights(class_stage, bank.shape[1], rho=rho, beta=beta).to(cos)
    return (cos * weights).sum(-1)
