"""Accuracy metrics as pure functions over predictions (SPEC §4).

A_t is top-1 on the test images of every class seen after stage t; Ā is the mean of A_1..A_T.
Group accuracy is accuracy restricted to the classes one stage learned; the accuracy matrix holds
them all (row t: after stage t, column g: the classes of stage g). Forgetting of a group is its
best accuracy before the last stage minus its accuracy after the last stage.
"""

from __future__ import annotations

from collections import Counter
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
    top5: float | None = None  # target among the 5 best-scored classes (all of them when fewer)

    def to_dict(self) -> dict:
        return asdict(self)


def _pct(correct: Tensor) -> float:
    return round(100.0 * correct.float().mean().item(), 4)


def accuracy_report(
    predictions: Tensor, targets: Tensor, class_stage: Tensor, *, num_stages: int, ranked: Tensor | None = None
) -> AccuracyReport:
    """Top-1 overall, per stage group and old/new; top-5 when ``ranked`` (N, k) holds each image's
    best-scored classes, best first. ``class_stage`` maps class index → stage."""
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
        top5=_pct((ranked[:, :5] == targets[:, None]).any(1)) if ranked is not None else None,
    )


def most_confused(
    predictions: Tensor, targets: Tensor, class_names: list[str], *, top: int = 5
) -> list[dict[str, object]]:
    """The ``top`` most frequent (true → predicted) mistakes, most frequent first (ties: by name)."""
    wrong = predictions != targets
    pairs = Counter(zip(targets[wrong].tolist(), predictions[wrong].tolist()))
    ranked = sorted(pairs.items(), key=lambda item: (-item[1], class_names[item[0][0]], class_names[item[0][1]]))
    return [{"true": class_names[t], "predicted": class_names[p], "count": count} for (t, p), count in ranked[:top]]


@dataclass(frozen=True)
class HistorySummary:
    """A_t per stage (None where a stage had no evaluation data), Ā, last, forgetting, and the
    accuracy matrix: ``matrix[t-1][g-1]`` is the accuracy on stage g's classes after stage t
    (None for g > t or without data)."""

    accuracy: list[float | None]
    average: float | None
    last: float | None
    forgetting: dict[str, float]
    mean_forgetting: float | None = None
    matrix: list[list[float | None]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize_history(reports: list[AccuracyReport | None]) -> HistorySummary:
    """Summarise the reports taken after each stage (index t-1 holds the one after stage t)."""
    accuracy = [r.top1 if r is not None else None for r in reports]
    known = [a for a in accuracy if a is not None]
    forgetting = _forgetting(reports)
    num_stages = len(reports)
    matrix = [[r.groups.get(str(g)) if r is not None else None for g in range(1, num_stages + 1)] for r in reports]
    return HistorySummary(
        accuracy=accuracy,
        average=_mean(known),
        last=accuracy[-1] if accuracy else None,
        forgetting=forgetting,
        mean_forgetting=_mean(list(forgetting.values())),
        matrix=matrix,
    )


def _forgetting(reports: list[AccuracyReport | None]) -> dict[str, float]:
    """Per stage group, its best earlier accuracy minus its final one (groups the last report has)."""
    final = reports[-1] if reports else None
    if final is None:
        return {}
    out = {}
    for group, last_acc in sorted(final.groups.items(), key=lambda item: int(item[0])):  # stage order
        past = [r.groups[group] for r in reports[:-1] if r is not None and group in r.groups]
        if past:
            out[group] = round(max(past) - last_acc, 4)
    return out


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None
