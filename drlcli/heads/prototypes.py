"""The prototype bank: real class means, semantic-guided synthesis for old classes, and scoring.

Shapes: a bank is (C, S, d) for C classes and S subspaces. With ``offset`` = 1 (drl, simplecil)
subspace 0 is the PTM and subspace k is stage k's; with ``offset`` = 0 (ease, which has no PTM
subspace) stage k's subspace is k - 1. ``class_stage[c]`` is the 1-based stage that learned class
c. A class learned in stage i has real prototypes in the PTM subspace and stages 1..i; the others
are synthesised (SPEC §2.3, after EASE): P_j(o) = Σ_{r∈R_j} softmax_r(cos(P_i(o), P_i(r)) / τ) · P_j(r), R_j = classes of stages
j..t. Synthesis is derived state: it is recomputed from the real prototypes whenever needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def synthesize(real: Tensor, class_stage: Tensor, *, tau: float = 1.0, offset: int = 1) -> Tensor:
    """Fill the subspaces a class never saw. ``real`` (C, S, d) holds valid rows up to its stage."""
    bank = real.clone()
    num_stages = real.shape[1] - offset
    for i in range(1, num_stages + 1):
        old = (class_stage == i).nonzero().squeeze(1)  # classes learned in stage i
        if old.numel() == 0:
            continue
        si = i - 1 + offset
        for j in range(i + 1, num_stages + 1):
            sj = j - 1 + offset
            donors = (class_stage >= j).nonzero().squeeze(1)  # R_j: real in both i and j
            sim = F.normalize(real[old, si], dim=-1) @ F.normalize(real[donors, si], dim=-1).T
            weights = torch.softmax(sim / tau, dim=1)  # (|old|, |R_j|)
            bank[old, sj] = weights @ real[donors, sj]
    return bank


def score_weights(class_stage: Tensor, num_subspaces: int, *, rho: float, beta: float, offset: int = 1) -> Tensor:
    """(C, S) weights of each subspace's cosine in a class's score (EASE's reweighting).

    score_c = cos(f_k, P_k(c)) + ρ·mean_{1≤j≤t, j≠k} cos(f_j, P_j(c)) + β·cos(f_0, P_0(c)),
    with k = class_stage[c] and t = S - offset stage subspaces (the β term only with a PTM
    subspace). With no trained subspaces (SimpleCIL) the score is the PTM cosine alone.
    """
    num_classes = class_stage.shape[0]
    weights = torch.zeros(num_classes, num_subspaces)
    t = num_subspaces - offset
    if t == 0:
        weights[:, 0] = 1.0
        return weights
    if offset:
        weights[:, 0] = beta
    if t > 1:
        weights[:, offset:] = rho / (t - 1)
    # a class learned in a stage without a network (nothing the run answers reads it: only a run
    # scored by an analytic head, which reads the bank in subspace 0 alone) has no own subspace
    own = (class_stage - 1 + offset).clamp(max=num_subspaces - 1)
    weights[torch.arange(num_classes), own] = 1.0
    return weights


def score(
    features: Tensor,
    bank: Tensor,
    class_stage: Tensor,
    *,
    rule: str = "reweight",
    rho: float = 0.1,
    beta: float = 1.0,
    offset: int = 1,
) -> Tensor:
    """Class scores (B, C) for features (B, S, d) against a full bank (C, S, d)."""
    if rule == "concat":
        return concat_scores(features, bank)
    weights = score_weights(class_stage, bank.shape[1], rho=rho, beta=beta, offset=offset)
    return weighted_scores(features, bank, weights)


def weighted_scores(features: Tensor, bank: Tensor, weights: Tensor) -> Tensor:
    """Σ_s weights[c, s]·cos(f_s, P_s(c)): (B, S, d) features, (C, S, d) bank, (C, S) weights -> (B, C)."""
    cos = torch.einsum("bsd,csd->bcs", F.normalize(features, dim=-1), F.normalize(bank, dim=-1))  # (B, C, S)
    # dtype only: `.to(cos)` would record cos's device as a constant in a traced graph (issue 18)
    return (cos * weights.to(dtype=cos.dtype)).sum(-1)


def concat_scores(features: Tensor, bank: Tensor) -> Tensor:
    """Plain cosine over the concatenated subspaces (the paper's rule): (B, S, d), (C, S, d) -> (B, C)."""
    flat_f = F.normalize(features.flatten(1), dim=-1)  # (B, S·d)
    flat_p = F.normalize(bank.flatten(1), dim=-1)  # (C, S·d)
    return flat_f @ flat_p.T
