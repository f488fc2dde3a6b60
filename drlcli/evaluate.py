"""Accuracy metrics as pure functions over predictions (SPEC §4).

A_t is top-1 on the test images of every class seen after stage t; Ā is the mean of A_1..A_T.
Group accuracy is accuracy restricted to the classes one stage learned; forgetting of a group is
its best accuracy before the last stage minus its accuracy after the last stage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import Tensor


@dataclass(frozen=True)
class AccuracyReport:
    """Accuracy of one evaluation, in percent. Group keys are 1-based stage numbers as strings."""

    top1: float
    num_images: int
    groups: dict[str, float] = field(default_factory=dict)
    old: float | None = None  # classes of stages before the newest one
    new: float | None = None  # classes of the newest stage

    def to_dict(self) -> dict:
        return asdict(self)


def _pct(correct: Tensor) -> float:
    return round(100.0 * correct.float().mean().item(), 4)


def accuracy_report(predictions: Tensor, targets: Tensor, class_stage: Tensor, *, num_stages: int) -> AccuracyReport:
    """Top-1 overall, per stage group and old/new. ``class_stage`` maps class index → stage."""
    if targets.numel() == 0:
        raise ValueError("no evaluation images")
    correct = predictions == targets
    target_stage = class_stage[targets]
    groups = {str(s): _pct(correct[target_stage == s]) for s in range(1, num_stages + 1) if (target_stage == s).any()}
    is_new = target_stage == num_stages
    return AccuracyReport(
        top1=_pct(correct),
        num_images=int(targets.numel()),
        groups=groups,
        old=_pct(correct[~is_new]) if (~is_new).any() else None,
        new=_pct(correct[is_new]) if is_new.any() else None,
    )


@dataclass(frozen=True)
class HistorySummary:
    """A_t per stage (None where a stage had no evaluation data), Ā, last, forgetting."""

    accuracy: list[float | None]
    average: float | None
    last: float | None
    forgetting: dict[str, float]

    def to_dict(self) -> dict:
        return asdict(self)


def summarize_history(reports: list[AccuracyReport | None]) -> HistorySummary:
    """Summarise the reports taken after each stage (index t-1 holds the one after stage t)."""
    accuracy = [r.top1 if r is not None else None for r in reports]
    known = [a for a in accuracy if a is not None]
    forgetting: dict[str, float] = {}
    final = reports[-1] if reports else None
    if final is not None:
        for group, last_acc in final.groups.items():
            past = [r.groups[group] for r in reports[:-1] if r is not None and group in r.groups]
            if past:
                forgetting[group] = round(max(past) - last_acc, 4)
    return HistorySummary(
        accuracy=accuracy,
        average=round(sum(known) / len(known), 4) if known else None,
        last=accuracy[-1] if accuracy else None,
        forgetting=forgetting,
    )
