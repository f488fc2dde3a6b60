"""learn-stage's first-session decision (``Schedule.decides_first``, set by
``schedule.decide``): stage 1's adapters are trained on the fit part of its images only; the
head is then fitted on the fit part twice, on the adapted and on the frozen PTM's features, and
scored on the held-out part. The adapters are kept only when they score higher there: a first drop
of 2 classes, or of photos the PTM already knows, ends no lower than the frozen PTM would."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import distributed
from ..data import ImageSubset, LabelledImages
from ..errors import UsageError
from ..heads import EarlierStages, Head
from ..heads.ridge.statistics import validation_mask
from .context import StageContext

log = logging.getLogger(__name__)

HELD_OUT = 0.2  # of each class's images of stage 1 (at least 1 of 2+), seeded by train.seed + 1


@dataclass(frozen=True)
class Decision:
    """What the held-out part said: top-1 (%) of the head fitted on the fit part, each way."""

    adapted: float
    frozen: float
    held_out: int  # images

    @property
    def keeps_adapters(self) -> bool:
        return self.adapted > self.frozen  # a tie keeps the frozen PTM: nothing to store

    def to_dict(self) -> dict[str, float | int | bool]:
        return {
            "adapted_top1": self.adapted,
            "frozen_top1": self.frozen,
            "held_out": self.held_out,
            "kept": "adapted" if self.keeps_adapters else "frozen",
        }


def deciding(stage: StageContext) -> bool:
    return stage.index == 1 and stage.schedule.decides_first


def held_out_mask(stage: StageContext) -> torch.Tensor:
    labels = torch.tensor(stage.images.labels, dtype=torch.long)
    return validation_mask(labels, fraction=HELD_OUT, seed=stage.config.train.seed + stage.index)


def training_images(stage: StageContext) -> LabelledImages:
    """The images stage 1's adapters train on: the fit part when deciding, else all of them."""
    if not deciding(stage):
        return stage.images
    if distributed.world_size() > 1:
        raise UsageError("schedule.decide runs in one process: learn stage 1 without torchrun")
    mask = held_out_mask(stage)
    return ImageSubset(stage.images, tuple((~mask).nonzero().squeeze(1).tolist()))


def decide(
    stage: StageContext, head: Head, adapted: torch.Tensor, frozen: torch.Tensor, labels: torch.Tensor
) -> Decision:
    """Both feature sets (N, S', d; the head's rows) of the stage's images, in image order."""
    mask = held_out_mask(stage)
    n = len(stage.images.class_names)
    scores = {}
    for name, feats in (("adapted", adapted), ("frozen", frozen)):
        earlier = EarlierStages(head=None, tensors=[], statistics=list)
        fit = head.load().fit_stage(
            earlier,
            feats[~mask],
            labels[~mask],
            image_labels=labels[~mask].tolist(),
            indices=None,
            num_classes=n,
            config=stage.config,
            stage_index=stage.index,
        )
        with torch.no_grad():
            predicted = fit.head(feats[mask].to(torch.float32)).argmax(1)
        scores[name] = 100.0 * float((predicted == labels[mask]).float().mean())
    decision = Decision(scores["adapted"], scores["frozen"], int(mask.sum()))
    log.debug("first session: %s", decision.to_dict())
    return decision
