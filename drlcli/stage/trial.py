"""The trial of stage 1 (``schedule.trial transfer``, the default's): whether adapting is worth its
cost on this data, measured before stage 1 spends its training. A copy of the adapter set trains
``trial_epochs`` on half of stage 1's classes (at most ``trial_images`` images of each, its
classifier started at their class means); then the other half's images (at most ``MEASURED_IMAGES``
of each), classes it never trained on, are compared through it and through the frozen PTM: how far
it moves their leave-one-out margins (``metrics.margin_gain``, in which every image counts). Where
the PTM's features already fit the data (photos close to ImageNet), a few epochs of adapting leave
those margins where they were (within 0.2 %); where they are far from it (the sketches), adapting
moves them by percents, widening them on most class orders. Stage 1 trains only where they move by
at least ``FLOOR`` % either way, more than chance (``Tried.trains``; the switch still answers from
the frozen head until adapting transfers): then the trial's set is dropped and stage 1 trains as it
would without the trial, and later stages decide by their forward transfer. Otherwise the set stays
untrained (the frozen PTM: AdaptFormer's Up starts at zero; ``declined``): its rows are the frozen
track's (no pass of its own). Where the trial came near the floor (``RETRY``), the next stage is tried the
same way, up to ``trial_stages`` tried stages; after that, or after a trial far from it, no stage trains
it, and the run learns at about the frozen head's cost. A stage of fewer than ``MIN_CLASSES`` classes
gives a trial nothing to measure, and its own forward transfer later would count only whether two
classes are told apart, which both networks nearly always are (50 drops of two classes: 0 better, 1
worse of 1,000 photos): it defers (``deferred``), keeping the set untrained at the frozen head's cost,
and the next stage is tried (not counted in ``trial_stages``). One under torchrun is not tried:
stage 1 then trains, as without the trial; a later one keeps the set as it stands."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import distributed
from ..data import LabelledImages
from ..evaluation import EVAL_BATCH_SIZE
from ..metrics import MarginGain, margin_gain
from ..model import embed_images
from ..progress import Progress
from ..run.records import trial_declined, trial_record
from .context import StageContext
from .cost import STEP
from .train import TrainProgress, train_stage

MIN_CLASSES = 4  # two to train on, two to tell apart
MEASURED_IMAGES = 100  # of each class the margins are measured on: bounds the trial's pass on a large drop
# the least mean move of the measured images' margins, in % of their frozen mean margin, either way,
# for stage 1 to train (with |z| above 1.645). Chosen with ``trial_epochs`` 10, ``trial_images`` 32 and
# the classifier started at the class means, on stage 1 of Caltech-101 and its sketches, B0 Inc10
# (validation splits of orders 1993 to 1995, and order 2024's training images): the photos moved
# -0.02 to +0.10 %, the sketches +1.08 to +7.57 % (docs/benchmarks.md)
FLOOR = 0.5
# a later stage is tried again only where the last trial came within this of the floor (its move, either
# way, at least ``RETRY`` %): a near miss, such as another split of a sketch order's stage 1 (+0.44 %),
# is tried again, while photos, whose stage-1 trials moved at most 0.13 % (-0.02 to +0.10 on the
# orders above), learn at about the frozen head's cost after one trial
RETRY = FLOOR / 2


def trying(stage: StageContext) -> bool:
    """A stage of a run that tries adapting first (``Schedule.tries``), while its set has never trained:
    stage 1, and each later one after declining trials, up to ``trial_stages`` tried stages in all."""
    if not stage.schedule.tries:
        return False
    metas = stage.loaded.stage_metas
    if not metas:
        return True
    records = [trial_record(meta) for meta in metas]
    last = records[-1]
    if last is None or not trial_declined(metas):
        return False
    tried = sum(1 for r in records if r is not None and not r["deferred"])
    near = last["deferred"] or abs(last["margins"]["percent"]) >= RETRY
    return near and tried < stage.config.schedule.trial_stages


def declined(stage: StageContext) -> bool:
    """A later stage of a run whose trials said adapting changes little: its set is untrained (the
    frozen PTM); it is tried again (``trying``) or stays so."""
    return stage.schedule.pauses and trial_declined(stage.loaded.stage_metas)


@dataclass(frozen=True)
class Tried:
    """What the trial measured and, for stage.json's ``carry.trial``, what it did."""

    gain: MarginGain
    meta: dict[str, Any]
    passes: float  # forward-pass equivalents it spent (stage.json metrics.passes units), for the stage's cost

    @property
    def trains(self) -> bool:
        """The trial moved the other classes' margins by at least ``FLOOR`` % (either way), more than chance."""
        return self.gain.moves(FLOOR)


@dataclass(frozen=True, eq=False)
class ClassSample(LabelledImages):
    """Some classes of another source, at most ``cap`` images each (seeded), labelled 0..k-1."""

    source: LabelledImages
    keep: tuple[int, ...]  # the source's labels kept, in this order
    cap: int
    seed: int
    indices: tuple[int, ...] = field(init=False)
    class_names: tuple[str, ...] = field(init=False)
    labels: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        labels = torch.tensor(self.source.labels, dtype=torch.long)
        generator = torch.Generator().manual_seed(self.seed)
        chosen = []
        for local, label in enumerate(self.keep):
            own = (labels == label).nonzero().squeeze(1)
            own = own[torch.randperm(len(own), generator=generator)[: self.cap]].sort().values
            chosen += [(int(i), local) for i in own]
        object.__setattr__(self, "indices", tuple(i for i, _ in chosen))
        object.__setattr__(self, "labels", tuple(local for _, local in chosen))
        object.__setattr__(self, "class_names", tuple(self.source.class_names[c] for c in self.keep))

    @property
    def origin(self) -> str:
        return f"{self.source.origin} ({len(self.indices)} of its images)"

    def load(self, index: int) -> Any:
        return self.source.load(self.indices[index])

    def fingerprint(self) -> str:
        return f"{self.source.fingerprint()}:{','.join(map(str, self.indices))}"


def trial(stage: StageContext, frozen_f0: torch.Tensor | None) -> Tried | None:
    """The trial of stage 1 (``trying``); None where it is not run. ``frozen_f0``: every image's f_0
    through the frozen PTM, in image order (a switched run's frozen track's), else passed here."""
    n = len(stage.images.class_names)
    if distributed.world_size() > 1:
        return None
    if n < MIN_CLASSES:
        return _deferred(stage, n)
    tick = time.perf_counter()
    options, train = stage.config.schedule, stage.config.train
    seed = train.seed + stage.index
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    trained = ClassSample(stage.images, tuple(sorted(order[: n // 2])), options.trial_images, seed)
    measured = ClassSample(stage.images, tuple(sorted(order[n // 2 :])), MEASURED_IMAGES, seed)
    network = stage.model.network
    kept = [copy.deepcopy(own.state_dict()) for own in network.stages]  # a later stage's untrained set
    network.new_stage(seed=seed)
    network.drop_start()  # no hold: every trial trains as stage 1's does
    try:
        train_stage(
            network,
            trained,
            # its classifier starts at the class means: the few steps then refine the features instead
            # of chasing random class directions, which narrowed every margin on a sketch order
            replace(train, epochs=options.trial_epochs, head_init="prototypes", epoch_images_per_class=None),
            stage.model.data_config,
            precision=stage.train_precision,
            progress=_progress(stage),
        )
        adapted = _f0(stage, measured)
    finally:  # the set as the stage began: it trains from there, as it would without the trial
        _restore(network, kept)
    if frozen_f0 is not None and len(frozen_f0) == len(stage.images):
        frozen = frozen_f0[torch.tensor(measured.indices, dtype=torch.long)]
    else:
        frozen = _f0(stage, measured)  # the set dropped: the frozen PTM
    gain = margin_gain(adapted, frozen, torch.tensor(measured.labels, dtype=torch.long))
    tried = Tried(gain, {}, 0.0)
    if not tried.trains:
        _keep_untrained(network, seed)
    meta = {
        "classes_trained": len(trained.class_names),
        "images_trained": len(trained),
        "epochs": options.trial_epochs,
        "classes_measured": len(measured.class_names),
        "images_measured": len(measured),
        "margins": {**gain.to_dict(), "floor": FLOOR},
        "trains": tried.trains,
        "deferred": False,
        "seconds": round(time.perf_counter() - tick, 3),
    }
    # a training step of an image counts 3 passes (forward and backward) on its share of the tokens, the
    # classifier's start one
    step = STEP * stage.config.train.keep_tokens
    passes = (step * options.trial_epochs + 1) * len(trained) + len(measured) * (1 if frozen_f0 is not None else 2)
    return Tried(gain, meta, passes / len(stage.images))


def _deferred(stage: StageContext, n: int) -> Tried:
    """A stage too small to try: nothing trained or measured; the set stays untrained."""
    _keep_untrained(stage.model.network, stage.config.train.seed + stage.index)
    none = MarginGain(0.0, 0.0, 0)
    meta = {
        **dict.fromkeys(("classes_trained", "images_trained", "epochs", "images_measured"), 0),
        "classes_measured": n,
        "margins": {**none.to_dict(), "floor": FLOOR},
        "trains": False,
        "deferred": True,
        "seconds": 0.0,
    }
    return Tried(none, meta, 0.0)


def _keep_untrained(network: Any, seed: int) -> None:
    """Stage 1's set, untrained: the frozen PTM (AdaptFormer's Up starts at zero); a later stage's stands."""
    if not network.stages:
        network.new_stage(seed=seed).requires_grad_(False).eval()


def _restore(network: Any, kept: list[dict[str, torch.Tensor]]) -> None:
    """The network's set as before the trial: none at stage 1, else the untrained set it held."""
    if not kept:
        network.drop_adapters()
        return
    network.stages[0].load_state_dict(kept[0])
    network.stages[0].requires_grad_(False).eval()
    network.drop_start()


def _f0(stage: StageContext, images: LabelledImages) -> torch.Tensor:
    feats, _ = embed_images(
        stage.model.network,
        images,
        stage.model.data_config,
        batch_size=EVAL_BATCH_SIZE,
        num_workers=stage.config.train.num_workers,
        precision=stage.precision,
        progress=(lambda s, t: stage.say("trial", s, t, "the other classes, through it")) if stage.progress else None,
    )
    return feats[:, 0]


def _progress(stage: StageContext) -> Any:
    if stage.progress is None:
        return None

    def report(p: TrainProgress) -> None:
        detail = f"{p.epochs} epochs on half the classes"
        stage.progress(Progress("trial", (p.epoch - 1) * p.steps + p.step, p.epochs * p.steps, detail, loss=p.loss))

    return report
