"""Accuracy metrics as pure functions over predictions (SPEC §4).

A_t is top-1 on the test images of every class seen after stage t; Ā is the mean of A_1..A_T.
Group accuracy is accuracy restricted to the classes one stage learned; the accuracy matrix holds
them all (row t: after stage t, column g: the classes of stage g). Forgetting of a group is its
best accuracy before the last stage minus its accuracy after the last stage.

Forward transfer (``Transfer``, ``measure``): a carried run's per-stage answer to "does adapting pay
here?" (issue 32), below.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import shown


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


def confusion_matrix(predictions: Tensor, targets: Tensor, num_classes: int) -> Tensor:
    """(C, C) int64 counts: row = true class, column = predicted class."""
    flat = targets.long().cpu() * num_classes + predictions.long().cpu()
    return torch.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


@dataclass(frozen=True)
class ClassScores:
    """Per class precision, recall and F1 (fractions; None where the class was neither a target nor
    predicted) and support; the macro and support-weighted averages over the classes that were
    (scikit-learn's ``classification_report``: an undefined ratio counts 0)."""

    precision: list[float | None]
    recall: list[float | None]
    f1: list[float | None]
    support: list[int]
    macro: tuple[float, float, float]
    weighted: tuple[float, float, float]


def class_scores(confusion: Tensor) -> ClassScores:
    """Precision, recall and F1 of every class from a confusion matrix (rows true, columns predicted)."""
    c = confusion.double()
    hits, support, predicted = c.diagonal(), c.sum(1), c.sum(0)
    precision = torch.where(predicted > 0, hits / predicted.clamp(min=1), torch.zeros_like(hits))
    recall = torch.where(support > 0, hits / support.clamp(min=1), torch.zeros_like(hits))
    both = precision + recall
    f1 = torch.where(both > 0, 2 * precision * recall / both.clamp(min=1e-300), torch.zeros_like(hits))
    seen = (support > 0) | (predicted > 0)
    weights = support / support.sum().clamp(min=1)

    def column(values: Tensor) -> list[float | None]:
        return [round(float(v), 6) if s else None for v, s in zip(values, seen.tolist())]

    def averages(weight: Tensor) -> tuple[float, float, float]:
        return tuple(round(float((v * weight).sum()), 6) for v in (precision, recall, f1))

    return ClassScores(
        column(precision),
        column(recall),
        column(f1),
        [int(s) for s in support.tolist()],
        averages(seen.double() / max(int(seen.sum()), 1)),
        averages(weights),
    )


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


# ------------------------------------------------------------------------ forward transfer

# A carried run's forward transfer (issue 32's per-run question: does adapting pay here?). At each
# stage after the first, the network as the stage began (trained on the earlier stages only) and the
# frozen PTM each answer the stage's images, whose classes neither has been trained on, by leave-one-out
# nearest class mean (cosine, on f_0) among the stage's own classes. ``better`` counts the images only
# the adapted network answers right, ``worse`` those only the frozen PTM does.
#
# The run's counts so far say that adapting transfers when better - worse is above chance (McNemar's
# one-sided test at 5 %) and at least ``GAIN`` % of the images compared. On the research replays the
# sketches gain 3 to 5 % from stage 2 or 3 on, the photos of Caltech-101 0.2 % (where carrying cost
# 0.7 to 1 A_T); docs/research/adaptation-bounds.md at b4fbb16, fourteenth round. They say that adapting stalls
# when even the gain's one-sided upper bound is under ``GAIN`` (a paused switched run,
# ``schedule.pause``, then trains no further stage while they say so).

Z = 1.645  # one-sided 5 %
GAIN = 1.0  # % of the images compared


@dataclass(frozen=True)
class Transfer:
    better: int  # images only the adapted network answers right
    worse: int  # images only the frozen PTM answers right
    images: int  # images compared

    def __add__(self, other: Transfer) -> Transfer:
        return Transfer(self.better + other.better, self.worse + other.worse, self.images + other.images)

    @property
    def gain(self) -> float:
        """better - worse, in % of the images compared."""
        return 100.0 * (self.better - self.worse) / self.images if self.images else 0.0

    @property
    def transfers(self) -> bool:
        lead = self.better - self.worse
        return self.images > 0 and lead > Z * (self.better + self.worse) ** 0.5 and self.gain >= GAIN

    @property
    def loses(self) -> bool:
        """More images only the frozen PTM answers right than only the adapted network does, by more
        than chance (at 5 %, one-sided): adapting tells new classes apart worse."""
        lead = self.worse - self.better
        return self.images > 0 and lead > Z * (self.better + self.worse) ** 0.5

    @property
    def ceiling(self) -> float:
        """The gain's one-sided upper bound at 5 %, in % of the images compared (one more image that
        differs in the spread, so that a few images of which none differs do not bound it at 0)."""
        if not self.images:
            return 100.0
        lead = self.better - self.worse
        return 100.0 * (lead + Z * (self.better + self.worse + 1) ** 0.5) / self.images

    @property
    def stalls(self) -> bool:
        """Adapting cannot reach the floor here: even the gain's upper bound is under ``GAIN``."""
        return self.ceiling < GAIN

    def to_dict(self) -> dict[str, int]:
        return {"better": self.better, "worse": self.worse, "images": self.images}

    def record(self, run: Transfer) -> dict[str, Any]:
        """stage.json's ``carry.transfer``: this stage's counts, the run's so far and what those say."""
        return {
            **self.to_dict(),
            "run": run.to_dict(),
            "gain": round(run.gain, 3),
            "ceiling": round(run.ceiling, 3),
            "floor": GAIN,
            "transfers": run.transfers,
            "stalls": run.stalls,
        }

    @classmethod
    def from_dict(cls, d: Any) -> Transfer:
        """A stage record's counts; ValueError unless three counts that fit together."""
        if not isinstance(d, dict):
            raise ValueError("transfer must be a mapping")
        values = [d.get(k) for k in ("better", "worse", "images")]
        # at most 2^63 - 1 each: a crafted 10^400 is an int no float holds (the gain's bound takes its root)
        if not all(type(v) is int and 0 <= v < 2**63 for v in values) or values[0] + values[1] > values[2]:
            raise ValueError(f"transfer counts {shown(values)} are not better + worse <= images, each in [0, 2^63)")
        return cls(*values)


def _leave_one_out_scores(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N, C) each row of ``x`` (N, d)'s cosine to every class mean, its own class's taken without it."""
    x = F.normalize(x.double(), dim=1)
    sums = torch.zeros(int(labels.max()) + 1, x.shape[1], dtype=x.dtype).index_add_(0, labels, x)
    scores = x @ F.normalize(sums, dim=1).T
    own = F.normalize(sums[labels] - x, dim=1)  # a class of one image: a zero mean, scored 0
    scores[torch.arange(len(labels)), labels] = (x * own).sum(1)
    return scores


def leave_one_out_right(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N,) whether nearest class mean (cosine) answers each row of ``x`` (N, d) right, each row's
    own class mean taken without it."""
    return _leave_one_out_scores(x, labels).argmax(1) == labels


def leave_one_out_margin(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N,) each row's cosine to its own class mean (taken without it) less its best other class mean's."""
    scores = _leave_one_out_scores(x, labels)
    rows = torch.arange(len(labels))
    own = scores[rows, labels].clone()
    scores[rows, labels] = -torch.inf
    return own - scores.max(1).values


@dataclass(frozen=True)
class MarginGain:
    """How far adapted features move the leave-one-out margins (``leave_one_out_margin``) of
    images against the frozen ones: the mean change in % of the frozen mean margin, and its z
    (the mean paired change over its standard error)."""

    percent: float
    z: float
    images: int

    def moves(self, floor: float) -> bool:
        """By at least ``floor`` % either way, and more than chance (at 5 % each way)."""
        return self.images > 1 and abs(self.percent) >= floor and abs(self.z) > Z

    def to_dict(self) -> dict[str, Any]:
        return {"percent": round(self.percent, 3), "z": round(self.z, 3), "images": self.images}


def margin_gain(adapted: torch.Tensor, frozen: torch.Tensor, labels: torch.Tensor) -> MarginGain:
    """``MarginGain`` of ``adapted`` over ``frozen`` f_0 (N, d) of the same images, ``labels`` local;
    every image counts, where ``measure`` counts only those whose answer changes (stage 1's trial,
    whose few classes both feature sets mostly tell apart)."""
    labels = labels.cpu().long()
    if len(labels) < 2 or int(labels.max()) < 1:
        return MarginGain(0.0, 0.0, 0)
    before = leave_one_out_margin(frozen.cpu(), labels)
    change = leave_one_out_margin(adapted.cpu(), labels) - before
    spread = float(change.std()) / len(change) ** 0.5
    z = float(change.mean()) / spread if spread > 0 else 0.0
    scale = abs(float(before.mean()))
    return MarginGain(100.0 * float(change.mean()) / scale if scale > 0 else 0.0, z, len(labels))


def measure(adapted: torch.Tensor, frozen: torch.Tensor, labels: torch.Tensor) -> Transfer:
    """The stage's counts from its images' f_0 (N, d) through each, ``labels`` local, in one order."""
    labels = labels.cpu().long()
    if len(labels) == 0 or int(labels.max()) < 1:  # one class: nothing to tell apart
        return Transfer(0, 0, 0)
    a = leave_one_out_right(adapted.cpu(), labels)
    f = leave_one_out_right(frozen.cpu(), labels)
    return Transfer(int((a & ~f).sum()), int((f & ~a).sum()), len(labels))
