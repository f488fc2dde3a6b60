"""``load_run``: the model of a run, from one whole generation of its files: the PTM rebuilt and
checked against its sha256, each stage's tensors checked, the classes not forgotten, the head."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..config import RunConfig
from ..device import resolve_device
from ..errors import IntegrityError, PTMError, UsageError
from ..heads import PROTOTYPES, AnalyticHead, since_totals
from ..heads.openset import BIAS, RMD_MEAN, RMD_MEAN_CARRIED, RMD_ROWS, RUNNING
from ..methods import Method, head_of, method_of, schedule_of
from ..model import CLASS_STAGE, HEAD, IncrementalModel, empty_prototypes, restore_model, stage_prefix, with_prefix
from ..ptm import backbone, hub
from ..ptm.backbone import PTMSource
from ..ptm.record import check_input_size
from .directory import RunDir, StageRecord
from .forgotten import ForgetLog, active_classes, read_log
from .layout import PTM_WEIGHTS, RUN_CONFIG
from .records import check_stage_meta, checked_metas, non_finite, read_record
from .track import FROZEN, tied_track

log = logging.getLogger(__name__)


@dataclass
class LoadedRun:
    run: RunDir
    manifest: dict[str, Any]
    record: dict[str, Any]  # run.yaml
    config: RunConfig
    model: IncrementalModel
    stage_metas: list[dict[str, Any]]
    forgotten: ForgetLog = field(default_factory=ForgetLog)  # classes out of the answers
    stage_tensors: list[dict[str, torch.Tensor]] = field(default_factory=list)  # each stage's weights and totals
    stage_totals: list[dict[str, torch.Tensor]] = field(default_factory=list)  # each stage's totals (the newest's)


def load_ptm(run: RunDir, record: dict[str, Any], manifest: dict[str, Any], *, ptm_weights: Path | None):
    """Rebuild the run's PTM and check it is bit-for-bit the one the run was created with."""
    info = record["ptm"]
    # run.yaml may come from anywhere: only the ViT shape arguments init writes reach timm
    kwargs = backbone.check_ptm_kwargs(info.get("kwargs"), origin=f"run {run.path}", error=IntegrityError)
    if run.has_ptm_weights(manifest):
        model = backbone.create_ptm(
            info["name"], source=PTMSource(random_init=True), kwargs=kwargs, unsupported=IntegrityError
        )
        backbone.load_state(model, run.ptm_weights(manifest), origin=str(run.shown(PTM_WEIGHTS)))
    else:
        path = ptm_weights
        if path is None and info["source"] == "hf-hub":  # the recorded commit's, from the Hugging Face cache
            path = hub.cached_weights(info["hub"])
        if path is None and info.get("weights_hint"):
            hinted = run.path / info["weights_hint"]
            path = hinted if hinted.is_file() else None
        if path is None and info["source"] == "file":
            raise PTMError(
                f"run {run.path} was created from a local weights file for {info['name']} (sha256 "
                f"{info['sha256'][:12]}...) that is not at its recorded place; pass --ptm-weights FILE"
            )
        model = backbone.create_ptm(
            info["name"], source=PTMSource(weights_path=path), kwargs=kwargs, unsupported=IntegrityError
        )
    try:  # the preprocessing the run records must give the images this PTM takes
        check_input_size(record["ptm"]["data_config"], model)
    except UsageError as exc:
        raise IntegrityError(
            f"{run.shown(RUN_CONFIG)} is not a valid run config ({exc}); restore it from a backup"
        ) from exc
    found = backbone.fingerprint(model)
    if found != info["sha256"]:
        raise IntegrityError(
            f"PTM weights differ from the run's (sha256 {found[:12]}... vs {info['sha256'][:12]}...); "
            "pass the weights the run was created with"
        )
    return model


# what the head a switched run answers from is, for people
HEAD_NAMES = {FROZEN: "the frozen PTM's head", "carried": "the adapted network's head"}


def answering_head(loaded: LoadedRun) -> str | None:
    """Which head a switched run answers from after its newest stage (``track.FROZEN``: the frozen
    PTM's; ``track.CARRIED``: the adapted network's), None for a run of one head."""
    switch = loaded.stage_metas[-1].get("switch") if loaded.stage_metas else None
    return switch.get("answers") if isinstance(switch, dict) else None


def load_run(
    run_dir: Path | str | RunDir, *, device: str = "auto", ptm_weights: Path | None = None, scoring: bool = True
) -> LoadedRun:
    """The run's model and records, all of one generation (``RunDir.read_generation``: a ``drl
    forget`` committing meanwhile makes it read the newer one). ``scoring`` False: an analytic head
    without what only its scores need (learn-stage fits a new head; ``AnalyticHead.from_stages``).

    A switched run (``track.py``) whose newest stage answers from its frozen track gives that
    track's model, config and PTM record, with this run's directory, manifest and stage records."""
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    return run.read_generation(
        lambda manifest: _load(run, manifest, device=device, ptm_weights=ptm_weights, scoring=scoring)
    )


def _load(run: RunDir, manifest: dict[str, Any], *, device: str, ptm_weights: Path | None, scoring: bool) -> LoadedRun:
    record, config = read_record(run, manifest)
    if scoring and schedule_of(config).switches:
        frozen = _frozen_answers(run, manifest, device=device, ptm_weights=ptm_weights)
        if frozen is not None:
            return frozen
    return _load_own(run, manifest, record, config, device=device, ptm_weights=ptm_weights, scoring=scoring)


def _load_own(
    run: RunDir,
    manifest: dict[str, Any],
    record: dict[str, Any],
    config: RunConfig,
    *,
    device: str,
    ptm_weights: Path | None,
    scoring: bool,
) -> LoadedRun:
    start = time.perf_counter()
    ptm = load_ptm(run, record, manifest, ptm_weights=ptm_weights).to(resolve_device(device))
    stages = run.stages(manifest)
    for stage in stages:
        check_stage_meta(run, stage.index, stage.meta)
    forgotten, classes = active_classes(run, manifest, stages)  # per stage: its classes not forgotten
    head = head_of(config)
    analytic = head.load() if head is not None else None
    method = method_of(config)
    carried = schedule_of(config).carries
    tensors = _run_tensors(
        run, method, analytic, stages, classes, width=backbone.width(ptm), scoring=scoring, carried=carried
    )

    def fit_error(position: int | None, exc: Exception) -> IntegrityError:
        index = stages[position].index if position is not None else stages[-1].index
        return _stage_error(run, index, exc)

    model = restore_model(
        ptm,
        config,
        tensors,
        class_names=[name for names in classes for name in names],
        num_stages=sum(stage_networks(method, stages, carried=carried)),
        data_config=record["ptm"]["data_config"],
        fit_error=fit_error,
    )
    metas = [stage.meta for stage in stages]
    log.debug(
        "loaded run %s: %d stages, %d classes on %s in %.1fs",
        run.path,
        len(metas),
        len(model.class_names),
        model.device,
        time.perf_counter() - start,
    )
    tensors_of = [stage.merged for stage in stages]
    return LoadedRun(run, manifest, record, config, model, metas, forgotten, tensors_of, [s.totals for s in stages])


def _frozen_answers(
    run: RunDir, manifest: dict[str, Any], *, device: str, ptm_weights: Path | None
) -> LoadedRun | None:
    """A switched run's frozen track, loaded, when the run answers from it after its newest stage (None:
    from the carried network), checked to be the run's (``track.tied_track``)."""
    metas = checked_metas(run, manifest)
    if not metas:
        return None
    track, _, answer = tied_track(run, manifest, metas)  # whichever track answers: the run's records hold both
    if answer != FROZEN:
        return None
    loaded = load_run(track, device=device, ptm_weights=ptm_weights)
    forgotten = read_log(run, manifest, {meta["stage"]: meta for meta in metas})
    if loaded.model.class_names != [name for meta in metas for name in forgotten.active(meta)]:
        raise IntegrityError(
            f"the frozen track of run {run.path} answers for other classes than the run; restore the run from a backup"
        )
    return replace(loaded, run=run, manifest=manifest, stage_metas=metas, forgotten=forgotten)


def _stage_error(run: RunDir, index: int, exc: Exception) -> IntegrityError:
    return IntegrityError(
        f"stage {index} of run {run.path} does not fit the run's network "
        f"({str(exc).splitlines()[0]}); restore it from a backup"
    )


def _run_tensors(
    run: RunDir,
    method: Method,
    head: AnalyticHead | None,
    stages: list[StageRecord],
    classes: list[list[str]],
    *,
    width: int,
    scoring: bool,
    carried: bool = False,
) -> dict[str, torch.Tensor]:
    """A run's stages under ``model/restore.py``'s tensor names: each stage's ``<method prefix><param>``
    becomes ``stage.<i>.<param>``, the per-stage prototype rows (n, subspaces then, d) one zero-padded
    bank, the stage files' head tensors the head's state. ``classes`` holds each stage's active classes
    (not forgotten): one prototype row each. Each stage's tensors are checked first. A ``carried``
    run's one stage network is in the newest stage's totals."""
    networks = stage_networks(method, stages, carried=carried)
    num_subspaces = method.offset + sum(networks)
    tensors: dict[str, torch.Tensor] = {}
    rows, class_stage = [], []
    for position, stage in enumerate(stages):
        made = sum(networks[: position + 1])  # the stage networks the run had once this stage was learned
        expected = (len(classes[position]), method.offset + made, width)
        _check_stage_tensors(run, stage, expected)
        padded = torch.zeros(expected[0], num_subspaces, width)  # subspaces added later: synthesised
        padded[:, : expected[1]] = stage.tensors[PROTOTYPES]
        rows.append(padded)
        class_stage += [stage.index] * expected[0]
        if networks[position]:
            state = with_prefix(stages[-1].totals if carried else stage.tensors, method.tensor_prefix)
            tensors.update({stage_prefix(made - 1) + k: v for k, v in state.items()})
    tensors[PROTOTYPES] = torch.cat(rows) if rows else empty_prototypes(width, method.offset)
    tensors[CLASS_STAGE] = torch.tensor(class_stage, dtype=torch.long)
    tensors.update(_open_set_tensors(run, stages))
    if head is not None and stages:  # the analytic head: R from stage 1, W from the newest stage
        tensors.update({HEAD + k: v for k, v in _head_state(run, head, stages, width, scoring).items()})
    return tensors


def stage_networks(method: Method, stages: list[StageRecord], *, carried: bool = False) -> list[bool]:
    """Which stages made a stage network (its parameters under the method's prefix). A stage that
    nothing the run answers reads has none (``train.skip_unread``; stored untrained before issue 32).
    A carried run made one, in stage 1; the newest stage's totals hold it as trained last."""
    if carried:
        return [position == 0 for position in range(len(stages))]
    if not method.trains:
        return [False] * len(stages)
    return [any(name.startswith(method.tensor_prefix) for name in stage.tensors) for stage in stages]


def _check_stage_tensors(run: RunDir, stage: StageRecord, expected: tuple[int, int, int]) -> None:
    """A stage's prototypes have the shape its classes and subspaces give, every tensor is finite, and
    the "unknown" answer's per-class tensors have one row per class (the rest: openset's checks)."""
    prototypes = stage.tensors.get(PROTOTYPES)
    if prototypes is None or tuple(prototypes.shape) != expected:
        found = "none" if prototypes is None else tuple(prototypes.shape)
        raise _stage_error(run, stage.index, ValueError(f"prototypes have shape {found}, expected {expected}"))
    bad = non_finite(stage.merged)
    if bad:
        raise _stage_error(run, stage.index, ValueError(f"tensor {bad} holds NaN or infinite values"))
    for name in (BIAS, *RMD_ROWS):
        rows_of = stage.tensors.get(name)
        if rows_of is not None and (rows_of.dim() == 0 or rows_of.shape[0] != expected[0]):
            problem = f"{name} has shape {tuple(rows_of.shape)}, expected {expected[0]} rows"
            raise _stage_error(run, stage.index, ValueError(problem))


def _head_state(
    run: RunDir, head: AnalyticHead, stages: list[StageRecord], width: int, scoring: bool
) -> dict[str, torch.Tensor]:
    """The analytic head's state from the stages' tensors; a crafted or damaged head tensor is damage."""
    try:
        head.check_carried(stages[-1].totals)  # a carried run's classes, as its next learn-stage reads them
        module = head.from_stages([stage.merged for stage in stages], scoring=scoring)
        module.check_width(width)
        return module.state_dict()
    except (RuntimeError, KeyError, ValueError) as exc:
        raise _stage_error(run, stages[-1].index, exc) from exc


def _open_set_tensors(run: RunDir, stages: list[StageRecord]) -> dict[str, torch.Tensor]:
    """The run's open-set tensors from its stages' (``heads/openset``): the biases when every stage
    has them (runs from before open-set scoring have none), the rmd statistics when every stage has
    them (the rows concatenated, the scatters and their counts summed: since the newest stage's running
    totals, ``heads.since_totals``); a carried run's class means as its newest stage moved them."""
    merged = [stage.merged for stage in stages]
    if not stages or not _all_hold(merged, (BIAS,)):
        return {}
    tensors = {BIAS: torch.cat([t[BIAS].flatten() for t in merged])}
    summed = since_totals(merged)
    if not (_all_hold(merged, RMD_ROWS) and _all_hold(summed, RUNNING)):
        return tensors
    tensors.update(_rmd_tensors(run, stages[-1].index, merged, summed))
    return tensors


def _rmd_tensors(
    run: RunDir, index: int, merged: list[dict[str, torch.Tensor]], summed: list[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The rmd statistics of ``_open_set_tensors``; stages whose tensors do not fit are damage (of stage ``index``)."""
    tensors = {}
    name = ""
    try:  # row counts checked by the caller, the rest by openset's check_rmd
        for name in RMD_ROWS:  # one per class, concatenated
            tensors[name] = torch.cat([t[name] for t in merged])
        for name in RUNNING:  # the scatters and their counts, summed
            tensors[name] = torch.stack([t[name].double() for t in summed]).sum(0).float()
        carried = merged[-1].get(RMD_MEAN_CARRIED)  # a carried run: every class's mean, moved by its newest stage
        if carried is not None:
            if tuple(carried.shape) != tuple(tensors[RMD_MEAN].shape):
                shape = tuple(tensors[RMD_MEAN].shape)
                raise ValueError(f"{RMD_MEAN_CARRIED} has shape {tuple(carried.shape)}, expected {shape}")
            tensors[RMD_MEAN] = carried
    except RuntimeError as exc:  # stages of different shapes: damage
        raise _stage_error(run, index, ValueError(f"{name}: {exc}")) from exc
    except ValueError as exc:
        raise _stage_error(run, index, exc) from exc
    return tensors


def _all_hold(parts: list[dict[str, torch.Tensor]], names: tuple[str, ...]) -> bool:
    return all(name in part for part in parts for name in names)
