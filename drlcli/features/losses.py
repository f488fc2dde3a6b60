"""Decoupled Anchor Supervision (DAS), its ablations' losses (cross-entropy, CosFace) and
distillation, as pure functions.

DAS (paper §III-C, Eqs. 7-11): instead of a softmax over the stage's classes, the positive logit
is compared with a fixed virtual anchor k (it must exceed k) and the negatives with the same (or
a separate) anchor (they must stay below it). The anchor is the same in every stage, so logits of
different stages live on one absolute scale. It also trains a stage with a single class, where
softmax cross-entropy is identically zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def das_loss(
    logits: Tensor,
    targets: Tensor,
    *,
    anchor_pos: float = 1.0,
    anchor_neg: float = 1.0,
    lambda_pos: float = 3.0,
    lambda_neg: float = 1.0,
) -> Tensor:
    """Mean DAS loss over a batch. ``logits`` (B, C) are σ·cos, ``targets`` (B,) class indices."""
    z_pos = logits.gather(1, targets[:, None]).squeeze(1)  # (B,)
    # Eq. 9: L_pos = -log(e^{z_y} / (e^{z_y} + e^{k+})) = softplus(k+ - z_y)
    loss_pos = F.softplus(anchor_pos - z_pos)
    # Eq. 10: L_neg = -log(e^{k-} / (Σ_{j≠y} e^{z_j} + e^{k-})) = logsumexp([k-, z_{j≠y}]) - k-
    is_target = F.one_hot(targets, logits.shape[1]).bool()
    negatives = logits.masked_fill(is_target, float("-inf"))
    anchor = logits.new_full((logits.shape[0], 1), anchor_neg)
    loss_neg = torch.logsumexp(torch.cat([anchor, negatives], dim=1), dim=1) - anchor_neg
    return (lambda_pos * loss_pos + lambda_neg * loss_neg).mean()  # Eq. 11


def ce_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Softmax cross-entropy over the stage's classes (the paper's ablation baseline)."""
    return F.cross_entropy(logits, targets)


def cosface_loss(logits: Tensor, targets: Tensor, *, scale: Tensor, margin: float) -> Tensor:
    """CosFace's large-margin cosine loss (Wang et al., CVPR 2018): softmax cross-entropy on
    σ·(cos θ_j - m·[j = y]), the margin ``m`` taken off the target's cosine, so the target must beat
    every other class by m. ``logits`` are σ·cos with the classifier's (learned) σ, ``scale``. The
    softmax margin the paper's reviewers set DAS against: unlike DAS it compares the stage's
    classes with each other, not with a fixed anchor."""
    is_target = F.one_hot(targets, logits.shape[1]).to(logits.dtype)
    return F.cross_entropy(logits - scale * margin * is_target, targets)


def kd_loss(features: Tensor, ptm_features: Tensor) -> Tensor:
    """Cosine distance of the stage feature to the PTM feature, averaged (paper Eq. 12)."""
    return (1.0 - F.cosine_similarity(features, ptm_features, dim=-1)).mean()
