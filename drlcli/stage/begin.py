"""learn-stage as a carried run's stage begins, before it trains (``carried_start``): the images'
rows through the network as it stands and the stage's forward transfer, or, while no stage has
trained the set, the stage's trial (``trial.py``) and the rows the frozen track's pass handed over;
and the passes over the stage's images that this and the feature phase (``fit.py``) share."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .. import distributed
from ..evaluation import EVAL_BATCH_SIZE
from ..heads import Head
from ..heads.openset.rmd import split_probe
from ..methods import head_of
from ..metrics import Transfer, measure
from ..model import embed_images
from .context import Began, StageContext
from .trial import Tried, declined, trial, trying


def carried_start(
    stage: StageContext,
    frozen_f0: torch.Tensor | None = None,
    frozen_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Began | None:
    """A carried run's stage, before it trains (None for a stage 1 that trains as it would without a
    trial, and any other run's stages): after the first, the head's rows and the rmd inputs of the
    stage's images through the network as the stage begins, and their f_0 through the frozen PTM,
    which give the stage's forward transfer (``metrics.Transfer``) and, in a run that pauses
    (``Schedule.pauses``), whether the stage trains the network at all; while the set has never
    trained, a trial decides that instead (``trial.py``). Every process ends with every image's rows, in
    the stage's image order. ``frozen_f0``: this process's share of that f_0 as a switched run's
    frozen track computed it for the same images (its ``Fitted.f0``); None: a pass through the
    network with its adapters off. ``frozen_rows``: that track's head rows and rmd inputs of them
    (``Fitted.rows``), which are the untrained set's too: a run whose set no stage trained reads them
    instead of passing the images again."""
    head = head_of(stage.config)
    if head is None or not stage.schedule.carries:
        return None
    first = not stage.loaded.stage_metas
    tried = trial(stage, frozen_f0) if trying(stage) else None
    if not (first or declined(stage)):
        return _began(stage, head, frozen_f0)
    if first and tried is None:
        return None
    return _untrained_start(stage, head, tried, frozen_f0, _handed(stage, head, frozen_rows))


def _untrained_start(
    stage: StageContext,
    head: Head,
    tried: Tried | None,
    frozen_f0: torch.Tensor | None,
    handed: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None,
) -> Began:
    """A stage of a set no stage has trained: the frozen PTM, its transfer nil by construction (no
    images counted). The trial decides; a stage it cannot try keeps the set as it stands."""
    tick = time.perf_counter()
    first = not stage.loaded.stage_metas
    paused = tried is None or not tried.trains
    rows = rmd_rows = None
    passes = 0.0
    if paused or not first:  # the fit reads them, or a later stage carries its earlier classes from them
        rows, rmd_rows, passes = _untrained_rows(stage, head, frozen_f0, handed)
    return Began(
        rows,
        rmd_rows,
        None if first else Transfer(0, 0, 0).record(stage.earlier_transfer()),
        paused,
        time.perf_counter() - tick + (tried.meta["seconds"] if tried else 0.0),
        tried.meta if tried else None,
        passes,
        tried.passes if tried else 0.0,
        untrained=paused,
    )


def _untrained_rows(
    stage: StageContext,
    head: Head,
    frozen_f0: torch.Tensor | None,
    handed: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The untrained set's rows and rmd inputs of every image, and the passes they cost: the frozen
    track's (``handed``), else the set's own pass as any carried stage begins (``_began``)."""
    if handed is not None:
        return (*handed(), 0.0)
    began = _began(stage, head, frozen_f0)
    return began.rows, began.rmd_rows, began.passes


def _handed(
    stage: StageContext, head: Head, frozen_rows: tuple[torch.Tensor, torch.Tensor] | None
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]] | None:
    """The untrained set's rows as the frozen track's pass gave them (every image's, one process),
    its f_0 repeated for the set's subspace as the set's network gives it; None where they are not
    that (another layout, torchrun)."""
    if frozen_rows is None or distributed.world_size() > 1 or len(frozen_rows[0]) != len(stage.images):
        return None
    rows, rmd_rows = frozen_rows
    if rows.shape[1] != 1 + layout_of(stage, head) ** 2:
        return None

    def as_the_sets() -> tuple[torch.Tensor, torch.Tensor]:
        kept = stage.model.network.num_stages  # the set's subspace: f_0 again (its Up is zero)
        return torch.cat([rows[:, :1].expand(-1, 1 + kept, -1), rows[:, 1:]], dim=1), rmd_rows

    return as_the_sets


def _began(stage: StageContext, head: Head, frozen_f0: torch.Tensor | None) -> Began:
    """A carried stage after the first as it begins: its rows, and its forward transfer."""
    tick = time.perf_counter()
    shard, network, probes = distributed.shard(len(stage.images)), stage.model.network, probes_of(stage)
    rows, labels = embed_stage(stage, shard, None, layout_of(stage, head), probes, phase="carry")
    bare = frozen_f0
    if bare is None:
        with network.bare():  # progress: "transfer", the stage's images through the frozen PTM
            bare = embed_stage(stage, shard, None, 0, (), phase="transfer")[0][:, 0]
    if len(bare) != len(rows):
        raise RuntimeError(f"the frozen track passed {len(bare)} images, the run {len(rows)}")
    rows, rmd_rows = split_probe(rows, len(probes), stage.model.probe_weight)
    if distributed.world_size() > 1:
        rows, rmd_rows, bare, labels = in_image_order(shard, rows, rmd_rows, bare, labels)
    own = measure(rows[:, 0], bare, labels)
    run = own + stage.earlier_transfer()
    few = len(stage.images.class_names) < stage.config.schedule.train_min_classes
    paused = stage.schedule.pauses and (run.stalls or few)
    passes = 1.0 if frozen_f0 is not None else 2.0  # the rows; f_0 through the frozen PTM unless handed over
    return Began(rows.cpu(), rmd_rows.cpu(), own.record(run), paused, time.perf_counter() - tick, passes=passes)


def in_image_order(shard: list[int] | None, *parts: torch.Tensor) -> list[torch.Tensor]:
    """Every process's rows of ``parts`` (this process's: ``shard`` of the stage's images), on the
    CPU in the stage's image order, so that what is computed from them does not depend on the sharding."""
    index = torch.tensor(shard if shard is not None else range(len(parts[0])), dtype=torch.long)
    gathered = distributed.all_gather_objects((index, *(p.cpu() for p in parts)))
    order = torch.cat([g[0] for g in gathered]).argsort()
    return [torch.cat([g[i] for g in gathered])[order] for i in range(1, len(parts) + 1)]


def embed_stage(
    stage: StageContext,
    shard: list[int] | None,
    computed: int | None,
    layout: int,
    probes: tuple[int, ...],
    phase: str = "prototypes",
) -> tuple[torch.Tensor, torch.Tensor]:
    return embed_images(
        stage.model.network,
        stage.images,
        stage.model.data_config,
        batch_size=EVAL_BATCH_SIZE,
        num_workers=stage.config.train.num_workers,
        precision=stage.precision,
        indices=shard,
        progress=(lambda s, t: stage.say(phase, s, t)) if stage.progress else None,
        stages=computed,
        layout=layout,
        probes=probes,
    )


def probes_of(stage: StageContext) -> tuple[int, ...]:
    """The probe block's class token, while the run's rmd statistics are calibrated with it."""
    model = stage.model
    calibrated = model.unknown_rmd is not None or stage.index == 1
    return (model.open_set_probe,) if calibrated and model.open_set_probe is not None else ()


def layout_of(stage: StageContext, head: Head | None) -> int:
    """g of the PTM layout rows the head's input ends with: as stage 1 stored it, or as configured."""
    if head is None:
        return 0
    return stage.model.layout_scored if stage.model.head is not None else head.layout_grid(stage.config)
