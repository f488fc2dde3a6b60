"""How well the "unknown" answer separates known images from images of classes not learned
(``drl eval --unknown-data``): AUROC and acceptance rates."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor


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
