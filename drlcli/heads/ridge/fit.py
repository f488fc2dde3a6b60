"""One stage's fit of the ridge head (see the folder's docstring), the head rebuilt from a run's
stages or an export's state, and the column of a class restored after later stages were learned."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ... import distributed
from ...errors import IntegrityError
from ..base import TOTALS_MARK, EarlierStages
from . import (
    CARRY_COV,
    CARRY_Q,
    COV_COUNTS,
    COV_COVARIANCE,
    COV_FACTOR,
    COV_MEAN,
    COV_PARAMS,
    COV_SCATTER,
    COV_SHARED,
    COV_TRACE,
    LAMBDA,
    LAYOUT,
    PROJECTION,
    WEIGHT,
)
from .carry.stage import carry_stage as _carry_stage
from .carry.stage import check_carried as _check_carried
from .covariance import ClassFactors, ClassMoments, covariance_input, pooled_covariance
from .head import RidgeHead, expand, head_input, joined_rows, random_projection
from .head import check_stages as _check_stages
from .solution import Solution, sums_digest
from .statistics import (
    STAT_DTYPE,
    Statistics,
    choose_lambda,
    kernel_errors,
    lambda_grid,
    sampled,
    solve,
    validation_mask,
)

if TYPE_CHECKING:
    from ...config import RunConfig
    from .options import RidgeConfig

from_state = RidgeHead.from_state
from_stages = RidgeHead.from_stages
carry_stage = _carry_stage  # a carried run's stage (``carry/stage.py``)
check_carried = _check_carried  # forget --restore and load: the carried classes, as a learn-stage reads them
check_stages = _check_stages  # load and verify: R and W together


@dataclass(frozen=True)
class StageFit:
    head: RidgeHead
    tensors: dict[str, Tensor]  # into the stage's weights file
    statistics: dict[str, Tensor]  # the stage's statistics file
    meta: dict[str, Any]  # λ, validation errors, image counts, seconds
    num_params: int  # entries of W solved in this stage
    solution: Solution | None = None  # offered to a second fit of the same sums (``fit_stage``'s ``offer``)


def fit_stage(
    earlier: EarlierStages,
    features: Tensor,
    labels: Tensor,
    *,
    image_labels: list[int],
    indices: list[int] | None,
    num_classes: int,
    config: RunConfig,
    stage_index: int,
    carries: bool = False,
    keeps: bool = False,
    offer: bool = False,
    given: Solution | None = None,
) -> StageFit:
    """Add a stage's images to the statistics and solve W for every class seen.

    ``features`` (N, S, d) and local ``labels`` (N,) are this process's shard (``indices`` of the
    stage's ``image_labels``; None: all); ``earlier`` gives the stages before it. A run that
    ``carries`` its network (stage 1 too) keeps λ and every class's covariance rows in its totals,
    and none of the sums a later stage draws again (the Grams, Q, the scatter), unless it ``keeps``
    them: a run whose later stages may leave the network as it is (a paused switched run) and read
    them instead of drawing (``carried.Carried``).

    ``offer``: the fit also returns its ``Solution`` (a switched run's frozen track); ``given``: a
    solution another fit offered, taken instead of searching λ and solving where it was solved from
    the very same sums (``solution.py``: a switched run whose set no stage has trained).
    """
    start = time.perf_counter()
    cfg = config.ridge
    projection, layout = _projection(earlier, features.shape[-1], cfg, seed=config.train.seed)
    val_all = validation_mask(
        torch.tensor(image_labels), fraction=cfg.val_fraction, seed=config.train.seed + stage_index
    )
    val = val_all if indices is None else val_all[torch.tensor(indices, dtype=torch.long)]
    phi = expand(head_input(features, projection.shape[0], layout**2).cpu(), projection)
    stage = Statistics.of(phi, labels.cpu(), num_classes, val).all_reduced()
    carried = earlier.carried
    carries = carries or carried is not None
    total, scatters = _totals(earlier, stage)
    search = (lambda_grid(cfg), cfg.lambda_search, cfg.lambda_classes, config.train.seed + stage_index)
    digest = sums_digest(total, projection, (*search, earlier.head is None)) if offer or given else ""
    if given is not None and given.solves(digest):
        solution, columns = given, "same sums"
    else:
        images = (phi, labels.cpu(), val)
        found, columns = _solved(earlier, total, cfg, search, images=images, counts=(len(image_labels), num_classes))
        solution = Solution(digest, *found)
    lam, weight = solution.lam, solution.weight
    tensors = _weights(earlier, weight, projection, layout)
    statistics = _run_statistics(stage, total, lam, stage_index, carries=carries, keeps=keeps)
    if cfg.covariance_weight > 0:
        _covariances(earlier, features, labels, num_classes, cfg, scatters, tensors, statistics)
    rows = _covariance_rows(earlier, tensors, statistics, carries=carries, keeps=keeps)
    meta = {
        "lambda": lam,
        "validation_errors": {f"{x:g}": e for x, e in solution.errors.items()},  # the λ tried
        # the classes those errors are over (``ranpac.lambda_classes``), and W of the earlier classes (``_moved``;
        # "same sums": λ and W are another fit's of the very same sums, ``given``)
        "validation_classes": solution.validated,
        "earlier_columns": "carried" if carried is not None and columns == "solved" else columns,
        "num_fit": total.num_fit,
        "num_val": total.num_val,
        "proj_dim": projection.shape[1],
        "layout_grid": layout,
    }
    head = _assemble(projection, rows, layout)
    meta["seconds"] = round(time.perf_counter() - start, 3)  # the statistics read, the solve, the head built
    return StageFit(head, tensors, statistics, meta, weight.numel(), solution if offer else None)


def _solved(
    earlier: EarlierStages,
    total: Statistics,
    cfg: RidgeConfig,
    search: tuple[list[float], str, int, int],
    *,
    images: tuple[Tensor, Tensor, Tensor],
    counts: tuple[int, int],
) -> tuple[tuple[float, dict[float, float], int, Tensor], str]:
    """(λ, its validation errors, the classes they are over, W) from ``total``, and how W's earlier
    columns were had: "moved" by this process's share of the stage's ``images`` (φ, labels, held out;
    ``counts``: the stage's images and new classes, ``_moved``) or "solved" again."""
    lam, errors, validated = _choose_lambda(
        total, search[0], cfg, first=earlier.head is None, images=images, seed=search[3]
    )
    # every process goes on with the first's λ: the same statistics everywhere, but an eigensolver or
    # factorisation may round differently on another CPU, and the moved solve below sums over processes
    lam = distributed.broadcast_object(lam)
    # a carried run solves every column again: the earlier W was solved on other features
    moved = (
        {} if earlier.carried is not None else _moved(earlier, total, lam, images[0], images=counts[0], new=counts[1])
    )
    return (lam, errors, validated, solve(total, lam, **moved)), "moved" if moved else "solved"


def _totals(earlier: EarlierStages, stage: Statistics) -> tuple[Statistics, list[dict[str, Tensor]]]:
    """The run's statistics through this ``stage``, and the earlier stages' within-class scatters
    the pooled covariance adds to (each kept while folding: ``_each_stage``). A carried run's earlier
    classes' sums are drawn from their moved Gaussians, or kept (``carry/``): one term, not a
    stage's files each."""
    scatters: list[dict[str, Tensor]] = []  # each earlier stage's within-class scatter (d, d), kept while folding
    carried = earlier.carried
    if carried is None:
        total = Statistics.accumulate(itertools.chain(_each_stage(earlier.statistics(), scatters), [stage]))
    else:  # a carried run: the earlier classes' sums drawn from their moved Gaussians, or kept (carry/)
        total = Statistics.accumulate([carried.statistics, stage])
        if carried.scatter:
            scatters.append(carried.scatter)
    return total, scatters


def _weights(earlier: EarlierStages, weight: Tensor, projection: Tensor, layout: int) -> dict[str, Tensor]:
    """The stage's weights file: W, and at stage 1 R and g too (every later stage reads them there)."""
    tensors = {WEIGHT: weight.float()}
    if earlier.head is None:
        tensors[PROJECTION] = projection.float()
        if layout:
            tensors[LAYOUT] = torch.tensor(layout)
    return tensors


def _run_statistics(
    stage: Statistics, total: Statistics, lam: float, stage_index: int, *, carries: bool, keeps: bool
) -> dict[str, Tensor]:
    """The stage's statistics file: its own Q, and the run's totals through this stage (record.py puts
    them in its totals file); a carried run keeps λ alone (its next stage draws the sums again), or
    when it ``keeps`` its sums, Q of every class beside the Grams."""
    statistics = {TOTALS_MARK: torch.tensor([stage_index]), LAMBDA: torch.tensor([lam], dtype=STAT_DTYPE)}
    if not carries:
        statistics.update({**stage.own(), **total.running()})
    elif keeps:
        statistics.update({**total.running(), **{CARRY_Q[name]: q for name, q in total.own().items()}})
    return statistics


@dataclass(frozen=True)
class _HeadRows:
    """What the head is assembled from: the stages whose weights give the class covariance rows (μ_c
    and S_c of every class so far), and the newest stage's tensors (R, W and the shared covariance;
    a carried run's rows from its totals)."""

    stages: list[dict[str, Tensor]]
    newest: dict[str, Tensor]


def _covariance_rows(
    earlier: EarlierStages,
    tensors: dict[str, Tensor],
    statistics: dict[str, Tensor],
    *,
    carries: bool,
    keeps: bool,
) -> _HeadRows:
    """μ_c and S_c of earlier stages' classes: their weights files as the run was loaded (forget edits
    them there), or in a carried run as drawn now, every class's then kept in the run's totals (moved
    out of ``tensors`` into ``statistics``, which also drop the scatter unless the run ``keeps`` its sums)."""
    stages = [*earlier.tensors, tensors] if COV_PARAMS in tensors else [tensors]
    newest = tensors
    if carries and not keeps:
        for name in (COV_SCATTER, COV_COUNTS):  # summed for the pooled covariance only
            statistics.pop(name, None)
    if carries and COV_PARAMS in tensors:
        own = {name: tensors.pop(name) for name in CARRY_COV if name in tensors}
        stages = [earlier.carried.rows, own] if earlier.carried is not None else [own]
        statistics.update({CARRY_COV[name]: joined_rows(stages, name) for name in own})
        newest = {**tensors, **statistics}
    return _HeadRows(stages, newest)


def _assemble(projection: Tensor, rows: _HeadRows, layout: int) -> RidgeHead:
    """The head, the earlier stages' class covariances checked here (learn-stage loads the run without
    them): IntegrityError when they do not fit."""
    try:
        return RidgeHead.assemble(projection, rows.newest, rows.stages, layout=layout)
    except (RuntimeError, KeyError, ValueError) as exc:
        raise IntegrityError(
            f"the run's class covariances do not fit ({str(exc).splitlines()[0]}); restore it from a backup"
        ) from exc


def _choose_lambda(
    total: Statistics,
    lambdas: list[float],
    cfg: RidgeConfig,
    *,
    first: bool,
    images: tuple[Tensor, Tensor, Tensor],
    seed: int,
) -> tuple[float, dict[float, float], int]:
    """λ, the validation errors of the λ tried and how many classes they are over: stage 1 every λ,
    in the kernel form (every class) while it has fewer fitted images than M and one process holds
    them all; otherwise, and at later stages from the λ before (``lambda_search`` local) or every λ
    again (grid, and runs that recorded no λ), over at most ``lambda_classes`` of the classes
    (``statistics.sampled``)."""
    phi, labels, val = images
    classes = total.q_fit.shape[1]
    if first and distributed.world_size() == 1 and int((~val).sum()) <= phi.shape[1] and total.num_val:
        return (*choose_lambda(total, lambdas, errors=kernel_errors(phi, labels, classes, val, lambdas)), classes)
    start = total.lam if cfg.lambda_search == "local" and not first else None
    part = sampled(total, cfg.lambda_classes, seed=seed)
    return (*choose_lambda(part, lambdas, start=start), part.q_fit.shape[1])


def _moved(
    earlier: EarlierStages, total: Statistics, lam: float, phi: Tensor, *, images: int, new: int
) -> dict[str, Tensor]:
    """``solve``'s arguments that move the earlier classes' W instead of solving it again: where the
    newest stage's W covers the ``new`` classes' predecessors, was solved at this λ (the run's totals
    record it), and this stage has fewer images than there are earlier classes (else solving is as
    cheap); none otherwise."""
    previous = earlier.tensors[-1].get(WEIGHT) if earlier.head is not None and earlier.tensors else None
    if previous is None or total.lam is None or total.lam != lam:
        return {}
    size, seen = total.q_fit.shape
    if tuple(previous.shape) != (size, seen - new) or not 0 < images < seen - new:
        return {}
    return {"previous": previous, "phi": phi}


def _projection(earlier: EarlierStages, width: int, cfg: RidgeConfig, *, seed: int) -> tuple[Tensor, int]:
    """(R in float64, g): new for stage 1, else as stage 1 stored them (the head was built from them),
    R on the CPU where the statistics are summed (the head itself may live on a GPU)."""
    if earlier.head is not None:
        return earlier.tensors[0][PROJECTION].to(STAT_DTYPE), earlier.head.layout_grid
    layout_rows = width * cfg.layout_grid**2
    rows = width * cfg.subspaces + layout_rows
    projection = random_projection(
        rows, cfg.resolved_proj_dim(width), seed=seed, layout_rows=layout_rows, layout_scale=cfg.layout_scale
    )
    return projection.to(STAT_DTYPE), cfg.layout_grid


def _each_stage(raw: Iterable[dict[str, Tensor]], scatters: list[dict[str, Tensor]]) -> Iterator[Statistics]:
    """Each earlier stage's statistics, one at a time (``Statistics.accumulate`` folds them as they
    come: one stage's Grams in memory, not every stage's), its covariance scatter set aside (the
    scatters since the last running totals: ``heads.since_totals``)."""
    for tensors in raw:
        if TOTALS_MARK in tensors:
            scatters.clear()
        if COV_SCATTER in tensors:
            scatters.append({COV_SCATTER: tensors[COV_SCATTER], COV_COUNTS: tensors[COV_COUNTS]})
        yield Statistics.from_tensors(tensors)


def _covariances(
    earlier: EarlierStages,
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    cfg: RidgeConfig,
    previous: list[dict[str, Tensor]],  # the earlier stages' scatters and counts
    tensors: dict[str, Tensor],
    statistics: dict[str, Tensor],
) -> None:
    """The stage's class covariances into ``tensors``, and the within-class scatter summed over every
    stage so far into ``statistics`` (the run's totals)."""
    if earlier.head is not None and COV_PARAMS not in earlier.tensors[-1]:
        raise IntegrityError(
            "the run asks for class covariances (ranpac.covariance_weight) that its earlier stages lack; "
            "restore it from a backup"
        )
    x = covariance_input(features).cpu()
    if cfg.covariance_rank:  # each class's r leading eigenpairs and its trace
        low = ClassFactors.of(x, labels.cpu(), num_classes, cfg.covariance_rank)
        counts, scatter = low.counts, low.scatter
        tensors.update({COV_MEAN: low.means.float(), COV_FACTOR: low.factors.float(), COV_TRACE: low.traces.float()})
    else:
        moments = ClassMoments.of(x, labels.cpu(), num_classes).all_reduced()
        scatters = moments.scatters()
        counts, scatter = moments.counts, scatters.sum(0)
        scatters /= (moments.counts - 1).clamp_min(1)[:, None, None]  # the class covariances, in place
        tensors.update({COV_MEAN: moments.means().float(), COV_COVARIANCE: scatters.float()})
    own = {COV_SCATTER: scatter, COV_COUNTS: torch.tensor([float(counts.sum()), float(num_classes)], dtype=STAT_DTYPE)}
    for name in (COV_SCATTER, COV_COUNTS):
        statistics[name] = sum((s[name].to(STAT_DTYPE) for s in previous), own[name]).float()
    shared = pooled_covariance([statistics])
    tensors.update(
        {
            COV_SHARED: shared.float(),
            COV_PARAMS: torch.tensor([cfg.covariance_weight, cfg.covariance_shrink, cfg.covariance_blend]),
        }
    )


def restored_slice(
    name: str, *, meta: dict[str, Any], statistics: list[dict[str, Tensor]], kept: dict[str, Tensor]
) -> Tensor:
    """``drl forget --restore``: a restored class's slice of ``name`` in a stage learned after it was
    forgotten, from that stage's stage.json (``meta``: its λ), the statistics of stages 1 to it and
    the class's kept columns of Q (``kept``). Only W is solved again; ValueError otherwise. A carried
    run keeps no stage statistics: its newest totals hold the sums (Q as ``CARRY_Q``), and the
    class's kept Q is its carried column, the same at a later stage that moved nothing."""
    if name != WEIGHT:
        raise ValueError(f"{name} is not solved again")
    ridge = meta.get("ridge")
    lam = ridge.get("lambda") if isinstance(ridge, dict) else None
    if not isinstance(lam, (int, float)) or isinstance(lam, bool) or not 0 < lam < float("inf"):
        raise ValueError("the stage records no valid ridge λ")
    own = [_own_q(s) for s in statistics if s]
    q_fit, q_val = (kept[q] if q in kept else kept[CARRY_Q[q]] for q in ("q_fit", "q_val"))
    return restored_column(own, q_fit, q_val, lam)


def _own_q(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """A stage's statistics with Q under its own name (a carried run's totals hold it as ``CARRY_Q``)."""
    if "q_fit" in tensors or CARRY_Q["q_fit"] not in tensors:
        return tensors
    return {**tensors, "q_fit": tensors[CARRY_Q["q_fit"]], "q_val": tensors[CARRY_Q["q_val"]]}


def restored_column(statistics: list[dict[str, Tensor]], q_fit: Tensor, q_val: Tensor, lam: float) -> Tensor:
    """A restored class's column of W in a stage learned after it was forgotten: (G + λI)⁻¹ q, G
    summed over ``statistics`` (stages 1 to that stage), λ that stage's, q the class's kept columns
    of Q (exactly what that stage's fit gives the class at its λ: the ridge's columns are independent)."""
    total = Statistics.accumulate(Statistics.from_tensors(s) for s in statistics)
    return solve(replace(total, q_fit=q_fit.to(STAT_DTYPE), q_val=q_val.to(STAT_DTYPE)), lam).float()
