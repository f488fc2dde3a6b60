"""learn-stage's feature phase: one pass over the stage's images gives the new classes' prototypes,
the "unknown" answer's calibration and, for a run scored by an analytic head, the head's fit."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import distributed
from ..heads import EarlierStages, Head, HeadFit
from ..heads.openset.calibrate import Calibration, calibrate
from ..heads.openset.rmd import Moments, carried_moments, split_probe
from ..methods import head_of, stages_read
from ..model import class_means
from .begin import embed_stage, in_image_order, layout_of, probes_of
from .context import Began, Fitted, StageContext
from .decide import Decision, decide, deciding

log = logging.getLogger(__name__)


def fit_features(
    stage: StageContext,
    began: Began | None = None,
    *,
    keep_f0: bool = False,
    solutions: tuple[bool, Any] = (False, None),
) -> Fitted:
    """One pass over the stage's images: the new classes' prototypes in every subspace (their mean
    feature), the "unknown" answer's calibration, and the run's analytic head (if it has one) fitted
    on the same features. A run that trains no stage nothing reads (``train.skip_unread``) computes
    no such subspace either: its prototype rows there are zero, and nothing scores with them. A carried
    run's stage after the first carries the earlier classes from ``began`` (``carried_start``), and a
    paused one, whose network did not move, reads its rows from there instead of passing again.
    ``keep_f0``: the result keeps f_0 of this process's images (``Fitted.f0``; a frozen track's).
    ``solutions``: whether the head's fit offers its solution (``HeadFit.solution``; a frozen track's
    while the run's set has never trained), and one it is given, which it takes where it was solved from
    the very same sums (a run whose set no stage has trained: the frozen PTM)."""
    tick = time.perf_counter()
    model, head = stage.model, head_of(stage.config)
    shard = distributed.shard(len(stage.images))
    computed = stages_read(stage.config) if stage.untrained else None  # stage subspaces computed (None: all)
    old_bias, old_rmd = model.unknown_bias, model.unknown_rmd
    if old_rmd is None and stage.index == 1:
        old_rmd = (Moments.empty(model.rmd_width), torch.zeros(0))
    rows = _stage_rows(stage, head, shard, computed, began)
    feats, rmd_feats, labels = rows.feats, rows.rmd_feats, rows.labels
    carry, old_rmd = _carried(stage, head, rows, shard, began, old_rmd)
    _add_prototypes(stage, feats, labels, computed)
    stage.say("calibrate", 0, 0, "the unknown answer's thresholds")
    calibration, moments = _calibrate(stage, feats, rmd_feats, labels, shard, None if old_rmd is None else old_rmd[0])
    bias, rmd = _calibrated(stage, calibration, moments, old_bias, old_rmd)
    log.debug("prototypes of %d classes in %.1fs", len(stage.images.class_names), time.perf_counter() - tick)
    fit = None
    if head is not None:
        fit = _fit_head(stage, head, feats, labels, shard, carry, solutions=solutions)
    if carry is not None and fit is not None:
        fit.statistics.update(carry.tensors())  # every class's Gaussian, into the run's totals
    seconds = time.perf_counter() - tick + (began.seconds if began is not None else 0.0)  # its passes count too
    kept = (feats[:, 0].clone(), feats, rmd_feats) if keep_f0 else (None, None, None)
    return Fitted(fit, calibration, bias, rmd, seconds, rows.decision, carry.meta if carry else None, *kept)


@dataclass(frozen=True)
class _Rows:
    """The stage's images as its fit reads them (this process's share): the head's rows, the rmd
    inputs and the labels, after stage 1's choice between the adapted and the frozen PTM's features
    (``decision``; None where nothing was decided)."""

    feats: torch.Tensor
    rmd_feats: torch.Tensor
    labels: torch.Tensor
    decision: Decision | None


def _stage_rows(
    stage: StageContext, head: Head | None, shard: list[int] | None, computed: int | None, began: Began | None
) -> _Rows:
    """One pass over this process's ``shard`` of the stage's images (a paused stage's rows are
    ``began``'s, the network did not move), and at stage 1 of a run with a head the pass without the
    adapters that decides whether they stay (``decide.py``)."""
    probes = probes_of(stage)
    if began is not None and began.paused:  # the network did not move: its rows as the stage began
        feats, rmd_feats, labels = _own_share(began, stage, shard)
    else:
        feats, labels = embed_stage(stage, shard, computed, layout_of(stage, head), probes)
        feats, rmd_feats = split_probe(feats, len(probes), stage.model.probe_weight)  # the head's rows, the rmd input
    decision = None
    if deciding(stage) and head is not None:
        feats, rmd_feats, decision = _first_session(stage, head, feats, rmd_feats, labels, shard, probes)
    return _Rows(feats, rmd_feats, labels, decision)


def _carried(
    stage: StageContext,
    head: Head | None,
    rows: _Rows,
    shard: list[int] | None,
    began: Began | None,
    old_rmd: tuple[Moments, torch.Tensor] | None,
) -> tuple[Any, tuple[Moments, torch.Tensor] | None]:
    """A carried run's stage (``_carry``; None for any other run) and the earlier classes' rmd
    statistics ``old_rmd``, their moments moved with the network where the carry moved them."""
    if not (stage.schedule.carries and head is not None):
        return None, old_rmd
    earlier_rmd = old_rmd[0] if old_rmd is not None and len(old_rmd[0].counts) else None
    carry, moved = _carry(stage, head, rows.feats, rows.rmd_feats, rows.labels, shard, began, earlier_rmd)
    if moved is not None:  # the earlier classes' rmd moments, moved with the network
        old_rmd = (moved, old_rmd[1])
    return carry, old_rmd


def _own_share(
    began: Began, stage: StageContext, shard: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A paused stage's head rows, rmd inputs and labels: ``began``'s (every image's, in image order;
    the same pass the fit would make again), this process's ``shard`` of them."""
    labels = torch.tensor(stage.images.labels, dtype=torch.long)
    if shard is None:
        return began.rows, began.rmd_rows, labels
    index = torch.tensor(shard, dtype=torch.long)
    return began.rows[index], began.rmd_rows[index], labels[index]


def _carry(
    stage: StageContext,
    head: Head,
    feats: torch.Tensor,
    rmd_feats: torch.Tensor,
    labels: torch.Tensor,
    shard: list[int] | None,
    began: Began | None,
    earlier_rmd: Moments | None,
) -> tuple[Any, Moments | None]:
    """A carried run's stage (``Schedule.carries``): the head carries the earlier classes
    (``AnalyticHead.carry_stage``) from ``began``'s rows (the network as the stage began) to these, and
    the same images' rmd inputs before and after move ``earlier_rmd``, the earlier classes' moments of
    the "unknown" answer (``openset.rmd.carried_moments``); a paused stage did not train the network, so
    nothing moved. Under torchrun each process passes its shard, and the first carries from every
    image (the maps and the class Gaussians need them all) and hands the others what it carried."""
    loaded, network = stage.loaded, stage.model.network
    earlier = (loaded.stage_tensors, loaded.stage_totals[-1]) if loaded.stage_metas else None
    moves = began is not None and began.moves
    try:
        if distributed.world_size() > 1:
            feats, rmd_feats, labels = in_image_order(shard, feats, rmd_feats, labels)
        result = None
        if distributed.is_main():
            step = head.load().carry_stage(
                stage.config,
                feats,
                labels,
                layout=layout_of(stage, head),
                stage_index=stage.index,
                earlier=earlier,
                earlier_classes=len(stage.model.class_names),  # before the stage's classes join the model
                before=began.rows if moves else None,
                device=stage.model.device,
            )
            moved = None
            if began is not None:  # stage 1's only where the run tried adapting first (``trial.py``)
                if earlier_rmd is not None and moves and step.meta is not None:
                    moved, move = carried_moments(
                        earlier_rmd, began.rows[:, 0], began.rmd_rows, rmd_feats, step.meta["map_lambda"]
                    )
                    step = replace(step, meta={**step.meta, "unknown_move": round(move, 6)})
                step = replace(step, meta={**(step.meta or {}), **began.record()})
            result = (step, moved)
        return distributed.broadcast_object(result)
    finally:
        network.drop_start()


def _first_session(
    stage: StageContext,
    head: Head,
    feats: torch.Tensor,
    rmd_feats: torch.Tensor,
    labels: torch.Tensor,
    shard: list[int] | None,
    probes: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, Decision]:
    """Stage 1's adapted features against the frozen PTM's (``decide.py``): a second pass
    without the adapters, and the adapters dropped unless the held-out part scores higher with them."""
    network = stage.model.network
    stage.say("decide", 0, 0, "the frozen PTM's features, to compare on the held-out images")
    with network.bare():
        frozen, _ = embed_stage(stage, shard, None, layout_of(stage, head), probes)
    frozen, frozen_rmd = split_probe(frozen, len(probes), stage.model.probe_weight)
    decision = decide(stage, head, feats, frozen, labels)
    if decision.keeps_adapters:
        return feats, rmd_feats, decision
    network.drop_adapters()
    return frozen, frozen_rmd, decision


def _add_prototypes(stage: StageContext, feats: torch.Tensor, labels: torch.Tensor, computed: int | None) -> None:
    """The new classes join the model with their mean feature in every subspace (zero where not computed)."""
    total = stage.model.network.num_subspaces
    subspaces = feats[:, : total if computed is None else stage.method.offset + computed]
    means = class_means(subspaces, labels, len(stage.images.class_names))
    if means.shape[1] < total:  # the subspaces not computed
        means = torch.cat([means, means.new_zeros(means.shape[0], total - means.shape[1], means.shape[2])], dim=1)
    stage.model.add_classes(list(stage.images.class_names), stage.index, means)


def _calibrated(
    stage: StageContext,
    calibration: Calibration,
    moments: Moments,
    old_bias: torch.Tensor | None,
    old_rmd: tuple[Moments, torch.Tensor] | None,
) -> tuple[torch.Tensor, tuple[Moments, torch.Tensor] | None]:
    """The stage's biases (n,) and rmd statistics, set on the model with the earlier classes'."""
    n = len(stage.images.class_names)
    bias = torch.full((n,), calibration.threshold)
    # a run from before the rmd statistics stays with the cosine rule (calibrate gave no rmd threshold)
    rmd = None if calibration.rmd_threshold is None else (moments, torch.full((n,), calibration.rmd_threshold))
    if old_bias is not None or stage.index == 1:  # a run from before open-set scoring stays without it
        joined = None
        if rmd is not None and old_rmd is not None:
            joined = (old_rmd[0].joined(rmd[0]), torch.cat([old_rmd[1], rmd[1]]))
        stage.model.calibrated(bias if old_bias is None else torch.cat([old_bias, bias]), joined)
    return bias, rmd


def _fit_head(
    stage: StageContext,
    head: Head,
    feats: torch.Tensor,
    labels: torch.Tensor,
    shard: list[int] | None,
    carry: Any = None,
    solutions: tuple[bool, Any] = (False, None),
) -> HeadFit:
    """The head fitted with the stage's features on top of the earlier stages' statistics (a carried
    run, whose stage ``carry`` is: the earlier classes' carried sums instead); ``solutions``: whether
    the fit offers its solution, and one it is given (``fit_features``)."""
    stage.say("fit", 0, 0, "the head from the run's statistics")
    loaded = stage.loaded
    earlier = EarlierStages(
        head=loaded.model.head if loaded.stage_metas else None,
        tensors=loaded.stage_tensors,
        statistics=lambda: (  # read one stage at a time, as the fit folds them; the newest's totals beside
            {**loaded.run.stage_statistics(i, loaded.manifest), **totals}
            for i, totals in zip(loaded.run.stage_indices(loaded.manifest), loaded.stage_totals)
        ),
        carried=carry.earlier if carry is not None else None,
    )
    fit = head.load().fit_stage(
        earlier,
        feats,
        labels,
        image_labels=stage.images.labels,
        indices=shard,
        num_classes=len(stage.images.class_names),
        config=stage.config,
        stage_index=stage.index,
        carries=carry is not None,
        keeps=carry is not None and stage.schedule.pauses,
        offer=solutions[0],
        given=solutions[1],
    )
    stage.model.head = fit.head.to(stage.model.device)
    log.debug("%s head fitted in %.1fs: %s", stage.config.method, fit.meta["seconds"], fit.meta["lambda"])
    return fit


def _calibrate(
    stage: StageContext,
    feats: torch.Tensor,
    rmd_feats: torch.Tensor,
    labels: torch.Tensor,
    shard: list[int] | None,
    earlier: Moments | None,
) -> tuple[Calibration, Moments]:
    """The stage's open-set thresholds (``openset.calibrate``; the rmd rule's against ``earlier``,
    the moments of the classes before it) and its classes' moments, from every process's subspace-0
    features and rmd inputs (``openset.rmd_input``), put back in the stage's image order so that
    they do not depend on the sharding."""
    features, rmd_features, targets = in_image_order(shard, feats[:, 0], rmd_feats, labels)
    n = len(stage.images.class_names)
    seed = stage.config.train.seed + stage.index
    cal = calibrate(features, targets, n, stage.config.open_set, seed=seed, earlier=earlier, rmd_features=rmd_features)
    return cal, Moments.of(rmd_features, targets, n)
