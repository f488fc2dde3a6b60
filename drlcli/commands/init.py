"""``drl init``: a new run directory for a PTM (its name, shape arguments, sha256 and preprocessing
in run.yaml, with the config; the weights themselves for a random init)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import RunConfig, closest_recipe
from ..errors import UsageError
from ..features import adapter
from ..methods import schedule_of
from ..progress import Progress, ProgressFn
from ..ptm import backbone, hub
from ..ptm.backbone import PTMSource
from ..run.directory import RunDir
from ..run.files import init_files
from ..run.records import run_record
from ..run.trackdir import track_record


@dataclass(frozen=True)
class InitResult:
    run_dir: str
    method: str
    ptm: str  # the timm model name (an hf-hub: PTM's architecture)
    ptm_sha256: str
    ptm_source: str  # random | file | hub | hf-hub
    data_config: dict[str, Any]
    ptm_hub: dict[str, str] | None = None  # hf-hub: repo, revision (commit), weights_sha256
    recipe: str | None = None  # the recipe run.yaml records (``recipes.py``)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def init_run(
    run_dir: Path | str,
    *,
    ptm: str,
    ptm_weights: Path | None = None,
    random_init: bool = False,
    ptm_kwargs: dict[str, Any] | None = None,
    config: RunConfig | None = None,
    recipe: str | None = None,
    seed: int = 0,
    allow_nonempty: bool = False,
    progress: ProgressFn | None = None,
) -> InitResult:
    """Create a run directory for ``ptm``. Random-init weights are stored in the run.

    The folder must be empty (or hold only what an interrupted init left); ``allow_nonempty``
    accepts other files beside the run, which drl never changes. A user's file under one of the
    run's own names (``ptm.safetensors``, ``stages``...) is refused either way. ``recipe``: the recipe
    run.yaml records (``recipes.py``; default: the one ``config`` is closest to)."""
    if ptm_weights is not None and random_init:
        raise UsageError("--ptm-weights and --random-init exclude each other; pass one")
    if hub.is_hub_name(ptm) and (ptm_weights is not None or random_init):
        raise UsageError(f"{ptm} brings its own weights; drop --ptm-weights/--random-init, or name a timm model")
    ptm_kwargs = backbone.check_ptm_kwargs(ptm_kwargs, origin="--ptm-arg (ptm_kwargs)")  # before creating anything
    config = config or RunConfig.for_recipe("default")
    recipe = recipe or closest_recipe(config)[0].name
    run = RunDir(run_dir)
    with run.writer(create=True, allow_nonempty=allow_nonempty) as writer:
        if progress is not None:
            progress(Progress("load", 0, 0, f"the PTM {ptm} (and the sha256 of its weights)"))
        model, ptm_record = _init_ptm(
            ptm, run, ptm_weights=ptm_weights, random_init=random_init, seed=seed, kwargs=ptm_kwargs
        )
        adapter.check_tokens(model, config)
        record = run_record(ptm_record, config, recipe)
        if schedule_of(config).switches:  # its frozen track's config: the track's run.yaml is derived from it
            record = track_record(record, config)
        state = model.state_dict() if random_init else None
        writer.commit(init_files(record, state), manifest=None)
    info = record["ptm"]
    return InitResult(
        str(run.path),
        config.method,
        info["name"],
        info["sha256"],
        info["source"],
        info["data_config"],
        info.get("hub"),
        recipe,
    )


def _init_ptm(
    ptm: str, run: RunDir, *, ptm_weights: Path | None, random_init: bool, seed: int, kwargs: dict[str, Any]
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The PTM ``init`` builds, and run.yaml's ``ptm`` section that lets every later command rebuild it."""
    if hub.is_hub_name(ptm):
        built = hub.load_hub_ptm(ptm, kwargs=kwargs)
        record = {
            "name": built.name,
            "kwargs": built.kwargs,
            "sha256": backbone.fingerprint(built.model),
            "source": "hf-hub",
            "weights_hint": None,
            "hub": built.record,
            "data_config": built.data_config,
        }
        return built.model, record
    model = backbone.create_ptm(
        ptm, source=PTMSource(weights_path=ptm_weights, random_init=random_init, seed=seed), kwargs=kwargs
    )
    record = {
        "name": ptm,
        "kwargs": dict(kwargs),
        "sha256": backbone.fingerprint(model),
        "source": "random" if random_init else ("file" if ptm_weights is not None else "hub"),
        # relative to the run, so it survives moving run and weights together
        "weights_hint": os.path.relpath(Path(ptm_weights).resolve(), run.path.resolve())
        if ptm_weights is not None
        else None,
        "data_config": backbone.data_config(model),
    }
    return model, record
