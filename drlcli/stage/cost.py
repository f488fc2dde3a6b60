"""What a stage's learning cost, in DeiT forward passes per image of the stage (stage.json's
``metrics.passes``, learn-stage's cost line, ``drl info``'s per-stage sum): a no-grad forward of an
image counts 1, a training step of an image 3 (its forward and a backward about twice as long), and
the hold target's no-grad forward of the stage's starting set 1 more for each image it reads
(``schedule.hold_share`` of them); an epoch reads at most ``train.epoch_images_per_class`` images of
each class, and a step of an adapter set ``train.keep_tokens`` of each image's patch tokens (counted at
that share: at 0.5 the sketches' stages learned in 0.50 of the time, docs/performance.md).
Evaluation is not counted: it is per evaluation image, the same for every recipe."""

from __future__ import annotations

from typing import Any

from .batches import epoch_size
from .context import Began, Fitted, StageContext, Trained
from .decide import training_images

STEP = 3  # a training step of one image, in forward passes


def holds(stage: StageContext) -> bool:
    """A carried run's stage after the first trains against its starting set's tokens (the hold)."""
    return stage.schedule.hold and stage.index > 1


def stage_passes(
    stage: StageContext, began: Began | None, trained: Trained, fitted: Fitted, *, frozen: bool
) -> dict[str, Any]:
    """stage.json's ``metrics.passes``: per image of the stage, what its training (every epoch, those
    of an interrupted call resumed included), its feature passes (a switched run's frozen track's
    with them, ``frozen``) and stage 1's trial spent, and their sum."""
    n = max(1, len(stage.images))
    training = 0.0
    result = trained.result
    if result is not None:
        trained_on = training_images(stage)
        read = epoch_size(trained_on.labels, stage.config.train.epoch_images_per_class)  # an epoch's images
        tokens = stage.config.train.keep_tokens
        per_epoch = (STEP + (stage.config.schedule.hold_share if holds(stage) else 0)) * read * tokens
        start = len(trained_on) if stage.config.train.head_init == "prototypes" else 0  # the classifier's class means
        training = (len(result.epoch_losses) * per_epoch + start) / n
    paused = began is not None and began.paused
    features = (1.0 if frozen else 0.0) + (0.0 if paused else 1.0)  # the track's pass; the fit's own
    trial = 0.0
    if began is not None:  # the rows as the stage began (and f_0 through the frozen PTM), the trial
        features += began.passes
        trial = began.trial_passes
    if fitted.decision is not None:
        features += 1.0  # stage 1's pass without the adapters (schedule.decide)
    total = training + features + trial
    return {
        "per_image": round(total, 2),
        "training": round(training, 2),
        "features": round(features, 2),
        "trial": round(trial, 2),
    }
