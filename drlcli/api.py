"""The library API behind every CLI command: one function per command, typed results.

Each function takes explicit paths, options and a device, raises ``DrlError`` subclasses for
anything a user can cause, and reports progress through an optional callback. Nothing here
prints; ``cli/render.py`` renders the results.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from . import __version__, backbone, distributed, forget, hub, openset, restore
from .backbone import PTMSource
from .config import RunConfig, check_ptm_record
from .data import (
    LabelledImages,
    check_workers,
    dataset_images,
    refuse_near_duplicates,
    scan_class_folders,
    validate_images,
)
from .errors import DataError, DivergedError, IntegrityError, PTMError, RunStateError, UsageError
from .methods import AnalyticHead, HeadFit, Method, analytic_head, method_of, stage_is_read, stages_read
from .metrics import AccuracyReport, HistorySummary, accuracy_report, most_confused, summarize_history
from .model import IncrementalModel, class_means, embed_images, empty_prototypes
from .openset import Calibration, OpenSetReport, calibrate, open_set_report
from .precision import check_precision
from .restore import restore_model
from .rundir import PTM_WEIGHTS, RUN_CONFIG, RUN_CONFIG_KIND, RunDir, RunWriter, StageRecord, init_files, stage_files
from .tracking import TensorBoardLog, check_tensorboard_dir
from .train import TrainProgress, TrainResult, TrainState, train_stage

EVAL_BATCH_SIZE = 64
TOP_K = 5  # eval reports top-1 and top-5
log = logging.getLogger(__name__)  # debug lines: what --verbose shows (timings, per-epoch losses)


@dataclass(frozen=True)
class Progress:
    """What the library reports while it works, as numbers (the CLI formats them): a phase, its step
    count, and the phase's own figures. ``detail`` is text only where there is no number: a warning,
    the folder being validated, the benchmark's variant and stage."""

    phase: str  # "validate" | "resume" | "train" | "prototypes" | "evaluate" | "predict" | "warning"
    step: int
    total: int
    detail: str = ""
    epoch: int | None = None  # train: the epoch running, of ``epochs``
    epochs: int | None = None
    loss: float | None = None  # train: this step's batch loss
    lr: float | None = None  # train: this epoch's learning rate
    eval_set: int | None = None  # evaluate: the eval set being read, of ``num_eval_sets``
    num_eval_sets: int | None = None
    num_failed: int | None = None  # predict: images that could not be read so far


ProgressFn = Callable[[Progress], None]


def resolve_device(device: str) -> torch.device:
    """auto: CUDA if present; under torchrun each process takes the GPU of its LOCAL_RANK."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device} requested but CUDA is not available; use --device cpu")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise UsageError(f"device {device} requested but this host has {count} GPU(s) (cuda:0 to cuda:{count - 1})")
    if resolved.type == "cuda" and distributed.launched():
        resolved = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return resolved


# ---------------------------------------------------------------------------------- init


@dataclass(frozen=True)
class InitResult:
    run_dir: str
    method: str
    ptm: str  # the timm model name (an hf-hub: PTM's architecture)
    ptm_sha256: str
    ptm_source: str  # random | file | hub | hf-hub
    data_config: dict[str, Any]
    ptm_hub: dict[str, str] | None = None  # hf-hub: repo, revision (commit), weights_sha256

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
    seed: int = 0,
    allow_nonempty: bool = False,
    progress: ProgressFn | None = None,
) -> InitResult:
    """Create a run directory for ``ptm``. Random-init weights are stored in the run.

    The folder must be empty (or hold only what an interrupted init left); ``allow_nonempty``
    accepts other files beside the run, which drl never changes. A user's file under one of the
    run's own names (``ptm.safetensors``, ``stages``...) is refused either way."""
    if ptm_weights is not None and random_init:
        raise UsageError("--ptm-weights and --random-init exclude each other; pass one")
    if hub.is_hub_name(ptm) and (ptm_weights is not None or random_init):
        raise UsageError(f"{ptm} brings its own weights; drop --ptm-weights/--random-init, or name a timm model")
    ptm_kwargs = backbone.check_ptm_kwargs(ptm_kwargs, origin="--ptm-arg (ptm_kwargs)")  # before creating anything
    config = config or RunConfig.for_method("drl")
    run = RunDir(run_dir)
    with run.writer(create=True, allow_nonempty=allow_nonempty) as writer:
        if progress is not None:
            progress(Progress("load", 0, 0, f"the PTM {ptm} (and the sha256 of its weights)"))
        model, ptm_record = _init_ptm(
            ptm, run, ptm_weights=ptm_weights, random_init=random_init, seed=seed, kwargs=ptm_kwargs
        )
        record = {
            "kind": RUN_CONFIG_KIND,
            "drl_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "ptm": ptm_record,
            "config": config.to_dict(),
        }
        writer.commit(init_files(record, model.state_dict() if random_init else None), manifest=None)
    info = record["ptm"]
    return InitResult(
        str(run.path), config.method, info["name"], info["sha256"], info["source"], info["data_config"], info.get("hub")
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


# ------------------------------------------------------------------------- loading a run


@dataclass
class LoadedRun:
    run: RunDir
    manifest: dict[str, Any]
    record: dict[str, Any]  # run.yaml
    config: RunConfig
    model: IncrementalModel
    stage_metas: list[dict[str, Any]]
    forgotten: forget.ForgetLog = field(default_factory=forget.ForgetLog)  # classes out of the answers
    stage_tensors: list[dict[str, torch.Tensor]] = field(default_factory=list)  # each stage's weights file


def load_ptm(run: RunDir, record: dict[str, Any], manifest: dict[str, Any], *, ptm_weights: Path | None):
    """Rebuild the run's PTM and check it is bit-for-bit the one the run was created with."""
    info = record["ptm"]
    # run.yaml may come from anywhere: only the ViT shape arguments init writes reach timm
    kwargs = backbone.check_ptm_kwargs(info.get("kwargs"), origin=f"run {run.path}", error=IntegrityError)
    if run.has_ptm_weights(manifest):
        model = backbone.create_ptm(
            info["name"], source=PTMSource(random_init=True), kwargs=kwargs, unsupported=IntegrityError
        )
        backbone.load_state(model, run.ptm_weights(manifest), origin=str(run.path / PTM_WEIGHTS))
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
    found = backbone.fingerprint(model)
    if found != info["sha256"]:
        raise IntegrityError(
            f"PTM weights differ from the run's (sha256 {found[:12]}... vs {info['sha256'][:12]}...); "
            "pass the weights the run was created with"
        )
    return model


def load_run(run_dir: Path | str, *, device: str = "auto", ptm_weights: Path | None = None) -> LoadedRun:
    """The run's model and records, all of one generation (``RunDir.read_generation``: a ``drl
    forget`` committing meanwhile makes it read the newer one)."""
    run = RunDir(run_dir)
    return run.read_generation(lambda manifest: _load(run, manifest, device=device, ptm_weights=ptm_weights))


def _load(run: RunDir, manifest: dict[str, Any], *, device: str, ptm_weights: Path | None) -> LoadedRun:
    start = time.perf_counter()
    record, config = read_record(run, manifest)
    ptm = load_ptm(run, record, manifest, ptm_weights=ptm_weights).to(resolve_device(device))
    stages = run.stages(manifest)
    for stage in stages:
        check_stage_meta(run, stage.index, stage.meta)
    forgotten, classes = forget.active_classes(run, manifest, stages)  # per stage: its classes not forgotten
    tensors = _run_tensors(run, method_of(config), analytic_head(config), stages, classes, width=backbone.width(ptm))

    def fit_error(position: int | None, exc: Exception) -> IntegrityError:
        index = stages[position].index if position is not None else stages[-1].index
        return _stage_error(run, index, exc)

    model = restore_model(
        ptm,
        config,
        tensors,
        class_names=[name for names in classes for name in names],
        num_stages=len(stages) if method_of(config).trains else 0,
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
    return LoadedRun(run, manifest, record, config, model, metas, forgotten, [stage.tensors for stage in stages])


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
) -> dict[str, torch.Tensor]:
    """A run's stages under ``restore.py``'s tensor names: each stage's ``<method prefix><param>``
    becomes ``stage.<i>.<param>``, the per-stage prototype rows (n, subspaces then, d) one zero-padded
    bank, the stage files' head tensors the head's state. ``classes`` holds each stage's active classes
    (not forgotten): one prototype row each. Each stage's tensors are checked first."""
    num_subspaces = method.offset + (len(stages) if method.trains else 0)
    tensors: dict[str, torch.Tensor] = {}
    rows, class_stage = [], []
    for position, stage in enumerate(stages):
        prototypes = stage.tensors.get("prototypes")
        subspaces = method.offset + (position + 1 if method.trains else 0)
        expected = (len(classes[position]), subspaces, width)
        if prototypes is None or tuple(prototypes.shape) != expected:
            found = "none" if prototypes is None else tuple(prototypes.shape)
            raise _stage_error(run, stage.index, ValueError(f"prototypes have shape {found}, expected {expected}"))
        bad = non_finite(stage.tensors)
        if bad:
            raise _stage_error(run, stage.index, ValueError(f"tensor {bad} holds NaN or infinite values"))
        for name in (openset.BIAS, *openset.RMD_ROWS):  # one row per class; the rest by openset's checks
            rows_of = stage.tensors.get(name)
            if rows_of is not None and (rows_of.dim() == 0 or rows_of.shape[0] != expected[0]):
                raise _stage_error(
                    run,
                    stage.index,
                    ValueError(f"{name} has shape {tuple(rows_of.shape)}, expected {expected[0]} rows"),
                )
        padded = torch.zeros(expected[0], num_subspaces, width)  # subspaces added later: synthesised
        padded[:, :subspaces] = prototypes
        rows.append(padded)
        class_stage += [stage.index] * expected[0]
        if method.trains:
            state = restore.with_prefix(stage.tensors, method.tensor_prefix)
            tensors.update({restore.stage_prefix(position) + k: v for k, v in state.items()})
    tensors[restore.PROTOTYPES] = torch.cat(rows) if rows else empty_prototypes(width, method.offset)
    tensors[restore.CLASS_STAGE] = torch.tensor(class_stage, dtype=torch.long)
    tensors.update(_open_set_tensors(run, stages))
    if head is not None and stages:  # the analytic head: R from stage 1, W from the newest stage
        try:
            module = head.from_stages([stage.tensors for stage in stages])
            module.check_width(width)
            state = module.state_dict()
        except (RuntimeError, KeyError, ValueError) as exc:  # a crafted or damaged head tensor
            raise _stage_error(run, stages[-1].index, exc) from exc
        tensors.update({restore.HEAD + k: v for k, v in state.items()})
    return tensors


def _open_set_tensors(run: RunDir, stages: list[StageRecord]) -> dict[str, torch.Tensor]:
    """The run's open-set tensors from its stages' (``openset.py``): the biases when every stage has
    them (runs from before open-set scoring have none), the rmd statistics when every stage has them
    (the rows concatenated, the scatters and their counts summed)."""
    tensors: dict[str, torch.Tensor] = {}
    if not stages or any(openset.BIAS not in stage.tensors for stage in stages):
        return tensors
    tensors[openset.BIAS] = torch.cat([stage.tensors[openset.BIAS].flatten() for stage in stages])
    if all(name in stage.tensors for stage in stages for name in openset.RMD_TENSORS):
        for name in openset.RMD_TENSORS:  # row counts checked by the caller, the rest by openset.check_rmd
            try:
                if name in openset.RMD_ROWS:
                    tensors[name] = torch.cat([stage.tensors[name] for stage in stages])
                else:  # the scatters and their counts
                    tensors[name] = torch.stack([stage.tensors[name].double() for stage in stages]).sum(0).float()
            except RuntimeError as exc:  # stages of different shapes: damage
                raise _stage_error(run, stages[-1].index, ValueError(f"{name}: {exc}")) from exc
    return tensors


def read_record(run: RunDir, manifest: dict[str, Any]) -> tuple[dict[str, Any], RunConfig]:
    """run.yaml and its hyper-parameters. A record that passed its checksum but is not what
    ``init`` writes (crafted by hand, or by a buggy tool) is an IntegrityError, never a crash."""
    record = run.run_config(manifest)
    try:
        check_ptm_record(record.get("ptm"))
        config = RunConfig.from_dict(record.get("config"))
    except UsageError as exc:
        raise IntegrityError(
            f"{run.path / RUN_CONFIG} is not a valid run config ({exc}); restore it from a backup"
        ) from exc
    return record, config


_STAGE_META_TYPES = {
    "stage": int,
    "classes": list,
    "images_per_class": dict,
    "data_fingerprint": str,
    "num_params": int,
    "metrics": dict,
}


def check_stage_meta(run: RunDir, index: int, meta: dict[str, Any]) -> None:
    """The fields of a stage's metadata that drl reads have the types it writes; else IntegrityError."""
    problem = _stage_meta_problem(index, meta)
    if problem is not None:
        raise IntegrityError(f"stage {index} of run {run.path} is malformed ({problem}); restore it from a backup")


def _stage_meta_problem(index: int, meta: dict[str, Any]) -> str | None:
    for key, kind in _STAGE_META_TYPES.items():
        if not isinstance(meta.get(key), kind):
            return f"{key} is not a {kind.__name__}"
    if meta["stage"] != index:
        return f"it says it is stage {meta['stage']}"
    if not meta["classes"] or not all(isinstance(c, str) and c for c in meta["classes"]):
        return "classes is not a list of names"
    eval_data = meta.get("eval_data")
    if eval_data is not None and not (isinstance(eval_data, dict) and isinstance(eval_data.get("path"), str)):
        return "eval_data has no path"
    try:
        history_of([meta])
    except (TypeError, ValueError, AttributeError) as exc:
        return f"metrics are malformed: {exc}"
    train = meta["metrics"].get("train")
    if train is not None and not isinstance(train, dict):
        return "metrics.train is not a mapping"
    for name, value in (
        ("train.seconds", (train or {}).get("seconds")),
        ("learn_seconds", meta["metrics"].get("learn_seconds")),
    ):
        if value is not None and not _is_seconds(value):
            return f"metrics.{name} is not a number of seconds"
    return None


def _is_seconds(value: Any) -> bool:
    """A finite non-negative int or float (not a bool, not an int beyond any float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value)) and value >= 0
    except OverflowError:
        return False


def non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding NaN or ±inf, or None."""
    return next((k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)


# ---------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class EvalSet:
    """Labelled images (a folder or a dataset) mapped onto the run's global class indices."""

    images: LabelledImages
    label_map: list[int]


def eval_set(images: LabelledImages, model: IncrementalModel, *, what: str) -> EvalSet:
    index = model.class_index()
    unknown = [c for c in images.class_names if c not in index]
    if unknown:
        raise DataError(
            f"{what} {images.origin} has class(es) this run has not learned: {unknown[:5]}; "
            "evaluate only learned classes (see `drl info`)"
        )
    return EvalSet(images, [index[c] for c in images.class_names])


def labelled_images(
    folder: Path | None, dataset: Any, class_names: Sequence[str] | None, *, what: str
) -> LabelledImages | None:
    """A folder's listing or a dataset's items (read and checked), or None when neither is given."""
    if folder is not None and dataset is not None:
        raise UsageError(f"pass {what} as a folder ({what}_dir) or as a dataset ({what}), not both")
    if dataset is not None:
        return dataset_images(dataset, class_names=class_names, what=what)
    if folder is not None:
        return scan_class_folders(folder, what=f"--{what.replace('_', '-')}")
    return None


def _check_class_names_use(class_names: Sequence[str] | None, *datasets: Any) -> None:
    if class_names is not None and all(d is None for d in datasets):
        raise UsageError(
            "class_names names the int labels of a dataset (data=...); a folder's classes are its sub-folders"
        )


def evaluate_sets(
    model: IncrementalModel,
    sets: list[EvalSet],
    *,
    num_workers: int = 0,
    precision: str = "fp32",
    progress: ProgressFn | None = None,
) -> AccuracyReport:
    ranked, targets, _ = predict_sets(model, sets, num_workers=num_workers, precision=precision, progress=progress)
    return accuracy_report(ranked[:, 0], targets, model.class_stage, num_stages=model.num_stages, ranked=ranked)


def predict_sets(
    model: IncrementalModel,
    sets: list[EvalSet],
    *,
    num_workers: int = 0,
    precision: str = "fp32",
    progress: ProgressFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each image's TOP_K best-scored classes (N, k), best first, its target (global class
    indices; -1 for an image of a class not learned) and known(x) (N,) (``openset.py``; None when
    the model is not calibrated), over every set, gathered from all ranks. The network runs in
    ``precision``, the scoring in fp32."""
    predictions, targets, known = [], [], []
    for k, item in enumerate(sets, 1):
        report_step = (
            (lambda step, total, k=k: progress(Progress("evaluate", step, total, eval_set=k, num_eval_sets=len(sets))))
            if progress
            else None
        )
        feats, labels = embed_images(
            model.network,
            item.images,
            model.data_config,
            batch_size=EVAL_BATCH_SIZE,
            num_workers=num_workers,
            precision=precision,
            indices=distributed.shard(len(item.images)),
            progress=report_step,
            stages=model.stages_scored,
            layout=model.layout_scored,
            probes=model.probes_read,
        )
        scoring, inputs = model.split(feats)
        scores = model.scores(scoring)
        predictions.append(scores.topk(min(TOP_K, scores.shape[1]), dim=1).indices.cpu())
        targets.append(torch.tensor(item.label_map, dtype=torch.long)[labels])
        margin = model.known(inputs)
        known.append(margin.cpu() if margin is not None else torch.zeros(0))
    calibrated = model.open_set_answer is not None
    parts = distributed.all_gather_objects((torch.cat(predictions), torch.cat(targets), torch.cat(known)))
    ranked, target = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return ranked, target, torch.cat([p[2] for p in parts]) if calibrated else None


def registered_eval_sets(loaded: LoadedRun, *, missing: list[str] | None = None) -> list[EvalSet]:
    """The eval sets earlier stages registered. A missing folder is an error, or, when a
    ``missing`` list is given, appended to it as a warning and skipped."""
    sets = []
    for meta in loaded.stage_metas:
        entry = meta.get("eval_data")
        if not entry:
            continue
        path = loaded.run.path / entry["path"]
        if not path.is_dir():
            what = f"eval data registered by stage {meta['stage']} is not at {path}"
            if missing is None:
                raise DataError(f"{what}; restore it or evaluate with --data DIR")
            missing.append(f"{what}: left out of this evaluation")
            continue
        images = scan_class_folders(path, what="registered eval data")
        images = forget.without_forgotten(images, loaded.forgotten, loaded.model.class_names)
        if images is not None:  # None: every class of it is forgotten
            sets.append(eval_set(images, loaded.model, what="registered eval data"))
    return sets


@dataclass(frozen=True)
class EvalResult:
    report: AccuracyReport
    history: HistorySummary
    num_stages: int
    num_classes: int
    confused: list[dict[str, Any]] = field(default_factory=list)  # most frequent true → predicted
    run_dir: str | None = None
    plot: str | None = None  # the --plot file written
    open_set: OpenSetReport | None = None  # with --unknown-data

    def to_dict(self) -> dict[str, Any]:
        return {
            "open_set": self.open_set.to_dict() if self.open_set else None,
            "run_dir": self.run_dir,
            "accuracy": self.report.to_dict(),
            "history": self.history.to_dict(),
            "confused": self.confused,
            "num_stages": self.num_stages,
            "num_classes": self.num_classes,
            "plot": self.plot,
        }


def history_of(metas: list[dict[str, Any]]) -> HistorySummary:
    reports = [AccuracyReport(**m["metrics"]["eval"]) if m["metrics"].get("eval") else None for m in metas]
    return summarize_history(reports)


def evaluate(
    run_dir: Path | str,
    *,
    data_dir: Path | None = None,
    data: Any = None,
    class_names: Sequence[str] | None = None,
    all_seen: bool = False,
    device: str = "auto",
    ptm_weights: Path | None = None,
    confusions: int = 5,
    plot_path: Path | None = None,
    unknown_dir: Path | None = None,
    num_workers: int = 0,
    precision: str = "fp32",
    progress: ProgressFn | None = None,
) -> EvalResult:
    """Top-1 on a labelled folder (``data_dir``), a torch Dataset of (image, label) pairs (``data``,
    int labels named by ``class_names``: ``data.dataset_images``) or every registered eval set
    (``all_seen``); the accuracy history, the ``confusions`` most frequent mistakes, optionally a
    figure of the history (``plot_path``, needs the ``plot`` extra) and, with ``unknown_dir`` (class
    folders of classes the run has not learned), how well the "unknown" answer separates them
    (``openset.py``). Images load in ``num_workers`` worker processes; the network runs in
    ``precision`` (fp32, bf16, or fp16 on CUDA)."""
    if (data_dir is None and data is None) == (not all_seen):
        raise UsageError("pass exactly one of --all-seen or --data DIR (Python: data_dir or data)")
    _check_class_names_use(class_names, data)
    if confusions < 0:
        raise UsageError(f"--confusions must be >= 0, got {confusions}")
    check_workers(num_workers)
    check_precision(precision, resolve_device(device))
    if plot_path is not None:
        from .plots import check_plot_path

        check_plot_path(plot_path)
    if progress is not None:
        progress(Progress("load", 0, 0, "the PTM and the run's stages"))
    loaded = load_run(run_dir, device=device, ptm_weights=ptm_weights)
    if not loaded.stage_metas:
        raise UsageError(f"run {run_dir} has learned no stage yet; run `drl learn-stage` first")
    images = labelled_images(data_dir, data, class_names, what="data")
    if images is not None:
        validate_images(images)
        sets = [eval_set(images, loaded.model, what="--data" if data_dir is not None else "data")]
    else:
        sets = registered_eval_sets(loaded)
        if not sets:
            raise UsageError("no eval data is registered; pass --eval-data to learn-stage, or use --data DIR")
    model = loaded.model
    unknown = _unknown_set(unknown_dir, model)
    every = sets + ([unknown] if unknown else [])
    ranked, targets, known = predict_sets(model, every, num_workers=num_workers, precision=precision, progress=progress)
    open_set = None
    if unknown is not None:
        is_unknown = targets < 0
        if known is None:
            raise RunStateError(
                "--unknown-data needs a run whose every stage calibrated the unknown answer (learned with "
                "drlcli 0.2 or later); learn the stages again in a new run"
            )
        correct = ranked[~is_unknown, 0] == targets[~is_unknown]
        probe = model.probes_read[0] if model.probes_read else None
        open_set = open_set_report(
            known[~is_unknown], correct, known[is_unknown], rule=model.open_set_answer, probe_block=probe
        )
        ranked, targets = ranked[~is_unknown], targets[~is_unknown]
    predictions = ranked[:, 0]
    report = accuracy_report(predictions, targets, model.class_stage, num_stages=model.num_stages, ranked=ranked)
    history = history_of(loaded.stage_metas)
    plot = None
    if plot_path is not None and distributed.is_main():
        from .plots import history_plot

        if progress is not None:
            progress(Progress("plot", 0, 0, str(plot_path)))
        title = f"{loaded.config.method}, {loaded.record['ptm']['name']}: {model.num_stages} stages, top-1 now {report.top1:.2f}%"
        plot = str(history_plot(history, plot_path, title=title))
    return EvalResult(
        report,
        history,
        model.num_stages,
        len(model.class_names),
        most_confused(predictions, targets, model.class_names, top=confusions),
        str(loaded.run.path),
        plot,
        open_set,
    )


def _unknown_set(unknown_dir: Path | None, model: IncrementalModel) -> EvalSet | None:
    """``--unknown-data``: class folders of classes the run has not learned (label -1)."""
    if unknown_dir is None:
        return None
    images = scan_class_folders(unknown_dir, what="--unknown-data")
    validate_images(images)
    learned = [c for c in images.class_names if c in model.class_index()]
    if learned:
        raise DataError(
            f"--unknown-data {unknown_dir} has class(es) this run has learned: {learned[:5]}; "
            "pass only images of classes it has not learned"
        )
    return EvalSet(images, [-1] * len(images.class_names))


# --------------------------------------------------------------------------- learn-stage


@dataclass(frozen=True)
class StageResult:
    status: str  # "learned" | "unchanged" (the same data was already committed as this stage)
    resumed_from_epoch: int | None  # epochs reused from an interrupted run's checkpoint
    stage: int
    classes: list[str]
    num_images: int
    train_seconds: float
    total_seconds: float
    epoch_losses: list[float]
    scale: float | None
    num_params: int
    stage_bytes: int
    eval: AccuracyReport | None
    history: HistorySummary
    warnings: list[str] = field(default_factory=list)
    run_dir: str | None = None
    precision: str = "fp32"  # the network forward's (for "unchanged": the committed stage's)
    tensorboard_dir: str | None = None  # where this call wrote TensorBoard event files, if it did
    training_skipped: bool = False  # the stage was created untrained: nothing reads it (train.skip_unread)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["eval"] = self.eval.to_dict() if self.eval else None
        out["history"] = self.history.to_dict()
        return out


def learn_stage(
    run_dir: Path | str,
    *,
    data_dir: Path | None = None,
    eval_data_dir: Path | None = None,
    data: Any = None,
    eval_data: Any = None,
    class_names: Sequence[str] | None = None,
    train_overrides: dict[str, Any] | None = None,
    device: str = "auto",
    ptm_weights: Path | None = None,
    restart: bool = False,
    precision: str = "fp32",
    tensorboard_dir: Path | None = None,
    progress: ProgressFn | None = None,
) -> StageResult:
    """Learn the classes in ``data_dir`` as a new stage and commit it atomically.

    Instead of folders, ``data`` (and ``eval_data``) may be torch Datasets of (image, label) pairs:
    images as PIL images or tensors, labels as class names or ints indexing ``class_names``
    (``data.dataset_images``). Every item is read once up front, to check it and to fingerprint
    the data. A dataset's eval set counts in this stage's evaluation but, having no path, is not
    registered for later ones (``eval --all-seen``).

    Each finished epoch is checkpointed; an interrupted call resumes from its last epoch when run
    again with the same data, options and precision (``restart`` discards it instead). Running
    again after the stage committed, with the same data, changes nothing.

    ``precision``: the dtype the network's forward runs in, in training, the prototype pass and
    the evaluation (fp32, bf16, or fp16 on CUDA; ``precision.py``); stage.json records it.
    ``tensorboard_dir``: also write TensorBoard event files there (``tracking.py``, the
    ``tensorboard`` extra), never inside a run directory.

    The phases, in order: prepare (read the run and the data) -> the idempotence check -> check
    the data -> train or resume -> prototypes (and an analytic head's fit) -> evaluate -> record
    -> commit.
    """
    start = time.perf_counter()
    check_precision(precision, resolve_device(device))
    if tensorboard_dir is not None:
        check_tensorboard_dir(tensorboard_dir)
    run = RunDir(run_dir)
    # under torchrun only rank 0 locks and writes (the run, the event files); the others read the
    # same committed state
    main = distributed.is_main()
    with (
        run.writer() if main else contextlib.nullcontext() as writer,
        TensorBoardLog(tensorboard_dir) if main and tensorboard_dir else contextlib.nullcontext() as tracker,
    ):
        distributed.barrier()  # rank 0 holds the lock (or failed, which stops every rank)
        records = _read_records(run, _Sources(data_dir, eval_data_dir, data, eval_data, class_names), progress)
        unchanged = _already_committed(records)
        if unchanged is not None:
            return unchanged
        _check_classes(records.images, records.eval_images, records.learned)
        stage = _prepare(
            run,
            writer,
            records,
            train_overrides=train_overrides,
            device=device,
            ptm_weights=ptm_weights,
            precision=precision,
            tracker=tracker,
            progress=progress,
        )
        _check_data(stage)
        trained = _train_or_resume(stage, restart=restart)
        fitted = _prototypes(stage)
        evaluated = _evaluate(stage)
        record = _record(stage, trained, fitted, evaluated)
        _commit(stage, record)
        distributed.barrier()  # every rank returns only once the stage is committed
        result = _learned(stage, trained, fitted, evaluated, record, start=start)
        if tracker is not None:
            tracker.log_stage(result.stage, result.history)
            result = replace(result, tensorboard_dir=str(tracker.log_dir) if tracker.written else None)
    return result


@dataclass(frozen=True)
class _StageContext:
    """One learn-stage call, as ``_prepare`` read it: what every later phase works from."""

    run: RunDir
    writer: RunWriter | None  # rank 0 holds the run's lock; None on the other ranks
    manifest: dict[str, Any]
    config: RunConfig  # the run's, with this call's training overrides
    method: Method
    loaded: LoadedRun  # its model gains the new stage and classes as the phases go
    learned: dict[str, int]  # class name -> stage, before this one
    images: LabelledImages
    eval_images: LabelledImages | None
    eval_data_dir: Path | None  # a folder's (registered for later evaluations); None for a dataset
    fingerprint: str  # of ``images``
    index: int  # of the new stage
    device: str
    precision: str  # the network forward's: fp32 | bf16 | fp16
    tracker: TensorBoardLog | None  # --tensorboard's event files (rank 0)
    progress: ProgressFn | None

    @property
    def model(self) -> IncrementalModel:
        return self.loaded.model

    @property
    def untrained(self) -> bool:
        """The method trains stages, but this one is created untrained: nothing the run answers
        reads its subspace (``train.skip_unread``, ``methods.stage_is_read``)."""
        return self.method.trains and self.config.train.skip_unread and not stage_is_read(self.config, self.index)

    def say(self, phase: str, step: int, total: int, detail: str = "") -> None:
        if self.progress is not None:
            self.progress(Progress(phase, step, total, detail))

    def discard_checkpoint(self) -> None:
        if self.writer is not None:
            self.writer.discard_checkpoint()


@dataclass(frozen=True)
class _Trained:
    result: TrainResult | None  # None: the method trains nothing, or the stage was not trained
    resumed_from: int | None  # the epoch an interrupted call's checkpoint had reached
    skipped: bool = False  # the stage was created, not trained: nothing reads it (train.skip_unread)


@dataclass(frozen=True)
class _Fitted:
    fit: HeadFit | None  # the analytic head's, if the method has one
    calibration: Calibration  # the stage's open-set thresholds
    bias: torch.Tensor  # (n,) the open-set biases of the stage's classes
    rmd: tuple[openset.Moments, torch.Tensor] | None  # the rmd rule's moments and (n,) biases of them
    seconds: float  # the feature pass for the prototypes, and the head's fit


@dataclass(frozen=True)
class _Evaluated:
    report: AccuracyReport | None  # None: no eval set registered or given
    warnings: list[str]  # registered eval sets that were left out


@dataclass(frozen=True)
class _Record:
    meta: dict[str, Any]  # stage.json
    files: dict[str, bytes]  # the stage's files, as committed


@dataclass(frozen=True)
class _Sources:
    """What learn-stage learns from and evaluates on: folders or datasets (``class_names`` names
    the datasets' int labels)."""

    data_dir: Path | None
    eval_data_dir: Path | None
    data: Any
    eval_data: Any
    class_names: Sequence[str] | None


@dataclass(frozen=True)
class _Records:
    """What learn-stage reads before it builds any model or decodes any image: the run's records
    and the data folders' listings, enough to refuse a learned class or see a drop already learned."""

    manifest: dict[str, Any]
    config: RunConfig  # the run's, before this call's training overrides
    metas: list[dict[str, Any]]  # every stage's stage.json, checked
    learned: dict[str, int]  # class name -> stage, classes the run answers with (not forgotten)
    images: LabelledImages
    eval_images: LabelledImages | None
    eval_data_dir: Path | None
    fingerprint: str  # of ``images``
    run: RunDir


def _read_records(run: RunDir, data: _Sources, progress: ProgressFn | None) -> _Records:
    """The run's records and the data's listings (under the run's lock): seconds, not minutes."""
    if progress is not None:
        progress(Progress("read", 0, 0, "the run's records and the data folders"))
    manifest = run.manifest()
    _, config = read_record(run, manifest)
    metas = [run.stage_meta(i, manifest) for i in run.stage_indices(manifest)]
    for index, meta in zip(run.stage_indices(manifest), metas):
        check_stage_meta(run, index, meta)
    forgotten = forget.read_log(run, manifest, {meta["stage"]: meta for meta in metas})
    _check_class_names_use(data.class_names, data.data, data.eval_data)
    images = labelled_images(data.data_dir, data.data, data.class_names, what="data")
    if images is None:
        raise UsageError("pass the new classes' images: data_dir (a folder) or data (a Dataset)")
    eval_images = labelled_images(data.eval_data_dir, data.eval_data, data.class_names, what="eval_data")
    return _Records(
        manifest=manifest,
        config=config,
        metas=metas,
        learned={name: meta["stage"] for meta in metas for name in forgotten.active(meta)},
        images=images,
        eval_images=eval_images,
        eval_data_dir=data.eval_data_dir,
        fingerprint=images.fingerprint(),  # stats every file: once
        run=run,
    )


def _prepare(
    run: RunDir,
    writer: RunWriter | None,
    records: _Records,
    *,
    train_overrides: dict[str, Any] | None,
    device: str,
    ptm_weights: Path | None,
    precision: str,
    tracker: TensorBoardLog | None,
    progress: ProgressFn | None,
) -> _StageContext:
    """Load the run's model (the PTM, every stage) and set up the call: its config with the overrides."""
    if progress is not None:
        progress(Progress("load", 0, 0, "the PTM and the run's stages"))
    loaded = load_run(run.path, device=device, ptm_weights=ptm_weights)
    return _StageContext(
        run=run,
        writer=writer,
        manifest=records.manifest,
        config=records.config.with_train(**(train_overrides or {})),
        method=method_of(records.config),
        loaded=loaded,
        learned=records.learned,
        images=records.images,
        eval_images=records.eval_images,
        eval_data_dir=records.eval_data_dir,
        fingerprint=records.fingerprint,
        index=max(run.stage_indices(records.manifest), default=0) + 1,
        device=device,
        precision=precision,
        tracker=tracker,
        progress=progress,
    )


def _check_data(stage: _StageContext) -> None:
    """Every image of --data and --eval-data decodes (DataError otherwise)."""
    for item in (stage.images, stage.eval_images):
        if item is not None:
            stage.say("validate", 0, len(item), item.origin)
            tick = time.perf_counter()
            validate_images(
                item, progress=lambda step, total, item=item: stage.say("validate", step, total, item.origin)
            )
            log.debug("validated %d images of %s in %.1fs", len(item), item.origin, time.perf_counter() - tick)


def _check_classes(images: LabelledImages, eval_images: LabelledImages | None, learned: dict[str, int]) -> None:
    """A stage brings new classes only, none a near-duplicate name of a learned one; --eval-data
    holds learned classes or this stage's."""
    for name in images.class_names:
        if name in learned:
            raise DataError(
                f"class {name!r} in --data was already learned in stage {learned[name]}; "
                "new stages bring new classes only: rename or remove that folder"
            )
    refuse_near_duplicates(images.class_names, learned)
    if eval_images is not None:
        unknown = [c for c in eval_images.class_names if c not in learned and c not in images.class_names]
        if unknown:
            raise DataError(
                f"--eval-data {eval_images.origin} has class(es) neither learned nor in --data: "
                f"{unknown[:5]}; remove them or add them to --data"
            )


def _train_or_resume(stage: _StageContext, *, restart: bool) -> _Trained:
    """A trained method's new stage: trained, from the last epoch checkpoint when one fits. Each
    finished epoch is checkpointed (rank 0); a diverged training leaves no checkpoint behind."""
    if not stage.method.trains:
        return _Trained(None, None)
    network, train = stage.model.network, stage.config.train
    network.new_stage(seed=train.seed + stage.index)
    if stage.untrained:
        network.stages[-1].eval().requires_grad_(False)  # as training leaves it
        log.debug("stage %d not trained: nothing the run answers reads its subspace", stage.index)
        return _Trained(None, None, skipped=True)
    key = _checkpoint_key(
        stage.manifest,
        stage.index,
        stage.config,
        stage.fingerprint,
        device_type=resolve_device(stage.device).type,
        precision=stage.precision,
    )
    resume = _resume_state(stage, key, restart=restart)

    def epoch_done(state: TrainState) -> None:
        log.debug("epoch %d/%d: loss %.4f (%.1fs)", state.epoch, train.epochs, state.epoch_losses[-1], state.seconds)
        if stage.writer is not None:
            stage.writer.save_checkpoint({**key, **_state_meta(state)}, state.tensors)
        if stage.tracker is not None:  # after the checkpoint: a point is never logged for an epoch that is redone
            stage.tracker.log_epoch(stage.index, state.epoch, loss=state.epoch_losses[-1], lr=state.lr)

    try:
        result = train_stage(
            network,
            stage.images,
            train,
            stage.model.data_config,
            precision=stage.precision,
            progress=_train_progress(stage.progress),
            resume=resume,
            on_epoch=epoch_done,
        )
    except DivergedError:
        stage.discard_checkpoint()  # resuming it would diverge again: the re-run starts afresh
        raise
    log.debug("trained %d steps in %.1fs, scale σ %.2f", result.steps, result.seconds, result.scale)
    _check_ranks_agree(network.stages[-1])
    return _Trained(result, resume.epoch if resume is not None else None)


def _resume_state(stage: _StageContext, key: dict[str, Any], *, restart: bool) -> TrainState | None:
    """The epoch checkpoint to continue from: read by rank 0, sent to every rank. ``restart`` discards it."""
    resume = None
    if stage.writer is not None:
        resume = None if restart else _resumable(stage.run, key)
        if restart:
            stage.writer.discard_checkpoint()
    resume = distributed.broadcast_object(resume)
    if resume is not None:
        stage.say("resume", resume.epoch, stage.config.train.epochs, "from the last finished epoch")
    return resume


def _train_progress(progress: ProgressFn | None) -> Callable[[TrainProgress], None] | None:
    """Training steps as progress counted over the whole stage: one bar, one ETA."""
    if progress is None:
        return None
    return lambda p: progress(
        Progress(
            "train",
            (p.epoch - 1) * p.steps + p.step,
            p.epochs * p.steps,
            epoch=p.epoch,
            epochs=p.epochs,
            loss=p.loss,
            lr=p.lr,
        )
    )


def _prototypes(stage: _StageContext) -> _Fitted:
    """The new classes' prototypes in every subspace (their mean feature); the run's analytic head
    (ranpac's; drl's with score.head ridge) is fitted on the same features. A run that trains no
    stage nothing reads (``train.skip_unread``) computes no such subspace either: its prototype
    rows there are zero, and nothing scores with them."""
    tick = time.perf_counter()
    images, model, head = stage.images, stage.model, analytic_head(stage.config)
    shard = distributed.shard(len(images))
    computed = stages_read(stage.config) if stage.untrained else None  # stage subspaces computed (None: all)
    # the head's input may end with the PTM's layout rows: g as stage 1 stored it, or as configured
    layout = 0 if head is None else model.layout_scored if model.head is not None else stage.config.ranpac.layout_grid
    old_bias, old_rmd = model.unknown_bias, model.unknown_rmd
    if old_rmd is None and stage.index == 1:
        old_rmd = (openset.Moments.empty(model.rmd_width), torch.zeros(0))
    # the probe block's class token, while the run's rmd statistics are calibrated with it
    probes = (model.open_set_probe,) if old_rmd is not None and model.open_set_probe is not None else ()
    feats, labels = embed_images(
        model.network,
        images,
        model.data_config,
        batch_size=EVAL_BATCH_SIZE,
        num_workers=stage.config.train.num_workers,
        precision=stage.precision,
        indices=shard,
        progress=(lambda s, t: stage.say("prototypes", s, t)) if stage.progress else None,
        stages=computed,
        layout=layout,
        probes=probes,
    )
    feats, rmd_feats = openset.split_probe(feats, len(probes), model.probe_weight)  # the head's rows, the rmd input
    total = model.network.num_subspaces
    subspaces = feats[:, : total if computed is None else stage.method.offset + computed]
    means = class_means(subspaces, labels, len(images.class_names))
    if means.shape[1] < total:  # the subspaces not computed
        means = torch.cat([means, means.new_zeros(means.shape[0], total - means.shape[1], means.shape[2])], dim=1)
    model.add_classes(list(images.class_names), stage.index, means)
    stage.say("calibrate", 0, 0, "the unknown answer's thresholds")
    calibration, moments = _calibrate(stage, feats, rmd_feats, labels, shard, None if old_rmd is None else old_rmd[0])
    n = len(images.class_names)
    new_bias = torch.full((n,), calibration.threshold)
    # a run from before the rmd statistics stays with the cosine rule (calibrate gave no rmd threshold)
    rmd = None if calibration.rmd_threshold is None else (moments, torch.full((n,), calibration.rmd_threshold))
    if old_bias is not None or stage.index == 1:  # a run from before open-set scoring stays without it
        joined = (
            None if rmd is None or old_rmd is None else (old_rmd[0].joined(rmd[0]), torch.cat([old_rmd[1], rmd[1]]))
        )
        model.calibrated(new_bias if old_bias is None else torch.cat([old_bias, new_bias]), joined)
    log.debug("prototypes of %d classes in %.1fs", len(images.class_names), time.perf_counter() - tick)
    fit = None
    if head is not None:
        stage.say("fit", 0, 0, "the head from the run's statistics")
        fit = head.fit_stage(
            stage.loaded,
            feats,
            labels,
            image_labels=images.labels,
            indices=shard,
            num_classes=len(images.class_names),
            config=stage.config,
            stage_index=stage.index,
        )
        model.head = fit.head.to(model.device)
        log.debug("%s head fitted in %.1fs: %s", stage.config.method, fit.meta["seconds"], fit.meta["lambda"])
    return _Fitted(fit, calibration, new_bias, rmd, time.perf_counter() - tick)


def _calibrate(
    stage: _StageContext,
    feats: torch.Tensor,
    rmd_feats: torch.Tensor,
    labels: torch.Tensor,
    shard: list[int] | None,
    earlier: openset.Moments | None,
) -> tuple[Calibration, openset.Moments]:
    """The stage's open-set thresholds (``openset.calibrate``; the rmd rule's against ``earlier``,
    the moments of the classes before it) and its classes' moments, from every process's subspace-0
    features and rmd inputs (``openset.rmd_input``), put back in the stage's image order so that
    they do not depend on the sharding."""
    index = torch.tensor(shard if shard is not None else range(len(labels)), dtype=torch.long)
    parts = distributed.all_gather_objects((index, feats[:, 0].cpu(), rmd_feats.cpu(), labels.cpu()))
    index = torch.cat([p[0] for p in parts])
    order = index.argsort()
    features = torch.cat([p[1] for p in parts])[order]
    rmd_features = torch.cat([p[2] for p in parts])[order]
    targets = torch.cat([p[3] for p in parts])[order]
    n = len(stage.images.class_names)
    seed = stage.config.train.seed + stage.index
    cal = calibrate(features, targets, n, stage.config.open_set, seed=seed, earlier=earlier, rmd_features=rmd_features)
    return cal, openset.Moments.of(rmd_features, targets, n)


def _evaluate(stage: _StageContext) -> _Evaluated:
    """Top-1 on every eval set earlier stages registered (a missing one is a warning) and on --eval-data."""
    warnings: list[str] = []
    sets = registered_eval_sets(stage.loaded, missing=warnings)
    for message in warnings:
        stage.say("warning", 0, 0, message)
    if stage.eval_images is not None:
        sets.append(eval_set(stage.eval_images, stage.model, what="--eval-data"))
    tick = time.perf_counter()
    report = None
    if sets:
        report = evaluate_sets(
            stage.model,
            sets,
            num_workers=stage.config.train.num_workers,
            precision=stage.precision,
            progress=stage.progress,
        )
    if report is not None:
        log.debug("evaluated %d images in %.1fs", report.num_images, time.perf_counter() - tick)
    return _Evaluated(report, warnings)


def _record(stage: _StageContext, trained: _Trained, fitted: _Fitted, evaluated: _Evaluated) -> _Record:
    """The stage's files: its tensors (refused if any is NaN or infinite) and its metadata."""
    tensors = {
        "prototypes": stage.model.real_prototypes[-len(stage.images.class_names) :],
        openset.BIAS: fitted.bias,
    }
    if fitted.rmd is not None:
        tensors.update(fitted.rmd[0].tensors())
        tensors[openset.RMD_BIAS] = fitted.rmd[1]
    if stage.method.trains:
        new = stage.model.network.stages[-1].state_dict()
        tensors.update({f"{stage.method.tensor_prefix}{k}": v for k, v in new.items()})
    if fitted.fit is not None:
        tensors.update(fitted.fit.tensors)
    bad = non_finite(tensors)
    if bad is not None:
        stage.discard_checkpoint()
        raise DivergedError(
            f"training diverged: {bad} of stage {stage.index} holds NaN or infinite values; nothing was "
            f"committed: lower --lr (now {stage.config.train.lr:g})"
        )
    meta = _stage_meta(stage, trained, fitted, evaluated)
    statistics = fitted.fit.statistics if fitted.fit is not None else None
    return _Record(meta, stage_files(stage.index, meta, tensors, statistics))


def _stage_meta(stage: _StageContext, trained: _Trained, fitted: _Fitted, evaluated: _Evaluated) -> dict[str, Any]:
    """stage.json: what the stage learned from, on what, and how well."""
    images, fit, report = stage.images, fitted.fit, evaluated.report
    if trained.result is not None:
        train_metrics = asdict(trained.result)
    else:
        train_metrics = {"seconds": fitted.seconds} if fit is not None else None  # the feature pass and solve
    if trained.skipped:
        train_metrics = {**(train_metrics or {}), "skipped": True}
    if stage.method.trains:
        num_params = stage.model.network.stages[-1].num_params()
    else:
        num_params = fit.num_params if fit is not None else 0
    meta = {
        "stage": stage.index,
        "drl_version": __version__,
        "classes": list(images.class_names),
        "images_per_class": images.counts(),
        "data_fingerprint": stage.fingerprint,
        "train": asdict(stage.config.train) if stage.method.trains else None,
        "device": str(stage.model.device),
        "precision": stage.precision,  # the forward's in training, prototypes and evaluation
        "world_size": distributed.world_size(),
        "eval_data": _eval_data_entry(stage),
        "num_params": num_params,
        "eval_missing": evaluated.warnings,
        "metrics": {
            "eval": report.to_dict() if report else None,
            "train": train_metrics,
            # learning without evaluation, for every method alike: SGD (if any), feature pass, fit
            "learn_seconds": round((trained.result.seconds if trained.result else 0.0) + fitted.seconds, 3),
        },
    }
    meta["open_set"] = fitted.calibration.to_dict()
    if fit is not None:
        meta["ridge"] = fit.meta  # the ridge head's λ, validation errors and counts (ranpac and drl alike)
    return meta


def _eval_data_entry(stage: _StageContext) -> dict[str, Any] | None:
    """--eval-data as registered for later evaluations: relative to the run, with its classes and
    fingerprint (a folder only: a dataset has no path to find it again)."""
    if stage.eval_images is None or stage.eval_data_dir is None:
        return None
    return {
        "path": os.path.relpath(Path(stage.eval_data_dir).resolve(), stage.run.path.resolve()),
        "classes": list(stage.eval_images.class_names),
        "fingerprint": stage.eval_images.fingerprint(),
    }


def _commit(stage: _StageContext, record: _Record) -> None:
    """Rank 0 commits the stage atomically, then drops the epoch checkpoint it no longer needs."""
    if stage.writer is None:
        return
    stage.say("commit", 0, 0, f"stage {stage.index}")
    tick = time.perf_counter()
    stage.writer.commit(record.files, manifest=stage.manifest, new_stage=stage.index)
    stage.writer.discard_checkpoint()
    log.debug(
        "committed stage %d (%d bytes) in %.2fs",
        stage.index,
        sum(map(len, record.files.values())),
        time.perf_counter() - tick,
    )


def _learned(
    stage: _StageContext, trained: _Trained, fitted: _Fitted, evaluated: _Evaluated, record: _Record, *, start: float
) -> StageResult:
    """What learn-stage reports for a stage it learned and committed."""
    train = trained.result
    return StageResult(
        status="learned",
        resumed_from_epoch=trained.resumed_from,
        stage=stage.index,
        classes=list(stage.images.class_names),
        num_images=len(stage.images),
        train_seconds=train.seconds if train else fitted.seconds if fitted.fit else 0.0,
        total_seconds=time.perf_counter() - start,
        epoch_losses=train.epoch_losses if train else [],
        scale=train.scale if train else None,
        num_params=record.meta["num_params"],
        training_skipped=trained.skipped,
        stage_bytes=sum(len(b) for b in record.files.values()),
        eval=evaluated.report,
        history=history_of([*stage.loaded.stage_metas, record.meta]),
        warnings=evaluated.warnings,
        run_dir=str(stage.run.path),
        precision=stage.precision,
    )


def train_metrics(meta: dict[str, Any]) -> dict[str, Any]:
    """A checked stage's ``metrics.train`` (``check_stage_meta``); empty for a method that trains nothing."""
    return meta["metrics"].get("train") or {}


def _already_committed(records: _Records) -> StageResult | None:
    """The committed stage that learned exactly these images, as a no-op result (or None). Its
    classes as learned: a class forgotten since (drl forget) does not make the same drop new again."""
    classes = list(records.images.class_names)
    meta = next(
        (m for m in records.metas if m["classes"] == classes and m["data_fingerprint"] == records.fingerprint), None
    )
    if meta is None:
        return None
    index = meta["stage"]
    train = train_metrics(meta)
    evaluation = meta["metrics"].get("eval")
    return StageResult(
        status="unchanged",
        resumed_from_epoch=None,
        stage=index,
        classes=list(meta["classes"]),
        num_images=len(records.images),
        train_seconds=0.0,
        total_seconds=0.0,
        epoch_losses=[],
        scale=train.get("scale"),
        num_params=meta["num_params"],
        stage_bytes=records.run.stage_bytes(index, records.manifest),
        eval=AccuracyReport(**evaluation) if evaluation else None,
        history=history_of(records.metas[: records.metas.index(meta) + 1]),
        run_dir=str(records.run.path),
        precision=meta.get("precision", "fp32"),  # absent: committed before drl recorded it, in fp32
        training_skipped=train.get("skipped") is True,
    )


def _check_ranks_agree(stage: torch.nn.Module) -> None:
    """All processes must hold bit-identical stage parameters before rank 0 commits them."""
    if distributed.world_size() == 1:
        return
    digests = distributed.all_gather_objects(backbone.fingerprint(stage))
    if len(set(digests)) != 1:
        raise IntegrityError(
            f"the {len(digests)} processes ended training with different stage parameters; nothing was "
            "committed. Re-run; if it persists, report it with your torchrun command"
        )


def _checkpoint_key(
    manifest: dict[str, Any], stage: int, config: RunConfig, fingerprint: str, *, device_type: str, precision: str
) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed: base state, stage, data, options, device type
    (kernels and RNG streams differ between CPU and CUDA: a resume across them is not the same run)
    and precision (likewise; fp16's checkpoint also holds its loss scale)."""
    train = asdict(config.train)  # num_workers included: worker seeding changes the augmentations
    train["world_size"] = distributed.world_size()
    return {
        "generation": manifest["generation"],
        "stage": stage,
        "data_fingerprint": fingerprint,
        "train": train,
        "device": device_type,
        "precision": precision,
    }


def _state_meta(state: TrainState) -> dict[str, Any]:
    return {"epoch": state.epoch, "epoch_losses": state.epoch_losses, "seconds": state.seconds, "steps": state.steps}


def _resumable(run: RunDir, key: dict[str, Any]) -> TrainState | None:
    """The checkpoint to resume, None when there is none; an error when it needs other options."""
    found = run.checkpoint()
    if found is None:
        return None
    meta, tensors = found
    if meta.get("generation") != key["generation"] or meta.get("stage") != key["stage"]:
        return None  # left behind by a stage that no longer applies; the next save replaces it
    if not _checkpoint_meta_ok(meta):
        raise RunStateError(
            f"the epoch checkpoint of stage {key['stage']} in {run.path} is malformed; pass --restart to discard it"
        )
    written_on = meta.get("device", key["device"])  # absent: written before drl recorded it
    if written_on != key["device"]:
        raise RunStateError(
            f"stage {key['stage']} was interrupted after epoch {meta.get('epoch')} on {written_on}, and this run "
            f"is on {key['device']}: a resume across device types would not continue the same training; re-run "
            f"with --device {written_on} to resume, or pass --restart to discard it"
        )
    written_in = meta.get("precision", "fp32")  # absent: written before drl had --precision, in fp32
    if written_in != key["precision"]:
        raise RunStateError(
            f"stage {key['stage']} was interrupted after epoch {meta.get('epoch')} in {written_in}, and this call "
            f"asks for {key['precision']}: a resume across precisions would not continue the same training; re-run "
            f"with --precision {written_in} to resume, or pass --restart to discard it"
        )
    differs = ["--data images"] if meta.get("data_fingerprint") != key["data_fingerprint"] else []
    differs += [
        f"{name} {meta['train'].get(name)!r} -> {value!r}"
        for name, value in key["train"].items()
        if meta.get("train", {}).get(name) != value
    ]
    if differs:
        raise RunStateError(
            f"stage {key['stage']} was interrupted after epoch {meta.get('epoch')} with other data or options "
            f"({', '.join(differs)}); re-run with the same ones to resume, or pass --restart to discard it"
        )
    return TrainState(meta["epoch"], tensors, list(meta["epoch_losses"]), float(meta["seconds"]), meta["steps"])


_CHECKPOINT_META_TYPES = {"epoch": int, "epoch_losses": list, "seconds": (int, float), "steps": int, "train": dict}


def _checkpoint_meta_ok(meta: dict[str, Any]) -> bool:
    """The checkpoint's metadata has the fields and types ``save_checkpoint`` writes."""
    return all(isinstance(meta.get(k), kind) for k, kind in _CHECKPOINT_META_TYPES.items())


# -------------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class VerifyResult:
    run_dir: str
    format_version: int
    generation: int
    num_stages: int
    files_checked: int
    bytes_checked: int
    interrupted_stage: dict[str, Any] | None  # a resumable checkpoint, if one is waiting

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify(run_dir: Path | str, *, progress: ProgressFn | None = None) -> VerifyResult:
    """Check every file the manifest lists (size, sha256, content) and the format; raise naming each damage."""
    run = RunDir(run_dir)
    return run.read_generation(lambda manifest: _verify(run, manifest, progress))


def _verify(run: RunDir, manifest: dict[str, Any], progress: ProgressFn | None) -> VerifyResult:
    report = (lambda step, total, name: progress(Progress("verify", step, total, name))) if progress else None
    problems = run.problems(manifest, progress=report)
    if problems:
        raise IntegrityError(f"run {run.path} is damaged: {'; '.join(problems)}" if len(problems) > 1 else problems[0])
    forget.check(run, manifest)  # the forget log and what it kept fit the stages
    checkpoint = run.checkpoint()
    waiting = None
    if checkpoint is not None and checkpoint[0].get("generation") == manifest["generation"]:
        meta = checkpoint[0]
        if _checkpoint_meta_ok(meta):
            waiting = {"stage": meta.get("stage"), "epoch": meta["epoch"], "epochs": meta["train"].get("epochs")}
    return VerifyResult(
        str(run.path),
        manifest["format_version"],
        manifest["generation"],
        len(manifest["stages"]),
        len(manifest["files"]),
        run.size_bytes(manifest),
        waiting,
    )


# ---------------------------------------------------------------------------------- info


def _threshold(meta: dict[str, Any], key: str = "threshold") -> float | None:
    entry = meta.get("open_set")
    value = entry.get(key) if isinstance(entry, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def info(run_dir: Path | str) -> dict[str, Any]:
    """What the run holds: PTM, method, stages, classes, sizes, accuracy history (no PTM load)."""
    run = RunDir(run_dir)
    return run.read_generation(lambda manifest: _info(run, manifest))


def _info(run: RunDir, manifest: dict[str, Any]) -> dict[str, Any]:
    record, _ = read_record(run, manifest)
    stages, metas = [], [run.stage_meta(i, manifest) for i in run.stage_indices(manifest)]
    for index, meta in zip(run.stage_indices(manifest), metas):
        check_stage_meta(run, index, meta)
    forgotten = forget.read_log(run, manifest, {meta["stage"]: meta for meta in metas})
    total_bytes = run.size_bytes(manifest)
    cum_params = cum_bytes = cum_classes = 0
    for index, meta in zip(run.stage_indices(manifest), metas):
        evaluation = meta["metrics"].get("eval")
        stage_bytes = run.stage_bytes(index, manifest)
        cum_params += meta["num_params"]
        cum_bytes += stage_bytes
        num_classes = len(forgotten.active(meta))
        cum_classes += num_classes
        stages.append(
            {
                "stage": index,
                "num_classes": num_classes,  # its classes the run answers with (not forgotten)
                "classes": meta["classes"],  # as learned
                "forgotten": forgotten.of_stage(index),  # of those, the ones out of the answers (drl forget)
                "num_images": sum(meta["images_per_class"].values()),
                "num_params": meta["num_params"],  # learned in this stage (the PTM is frozen)
                # its adapters stored as initialised: nothing the run answers reads them (train.skip_unread)
                "untrained": train_metrics(meta).get("skipped") is True,
                "bytes": stage_bytes,  # on disk: the stage's parameters, its classes' prototypes, stage.json
                "cumulative_classes": cum_classes,
                "cumulative_params": cum_params,
                "cumulative_bytes": cum_bytes,  # every stage so far (base_bytes not included)
                "accuracy": evaluation["top1"] if evaluation else None,
                "train_seconds": train_metrics(meta).get("seconds"),
                "unknown_threshold": _threshold(meta),  # the open-set calibration (openset.py); null before it
                "unknown_rmd_threshold": _threshold(meta, "rmd_threshold"),  # the rmd score's; null before it
            }
        )
    return {
        "run_dir": str(run.path),
        "format_version": manifest["format_version"],
        "generation": manifest["generation"],
        "method": record["config"]["method"],
        "ptm": {
            **{k: record["ptm"][k] for k in ("name", "kwargs", "sha256", "source", "data_config")},
            "hub": record["ptm"].get("hub"),  # hf-hub: repo, revision, weights_sha256; else null
        },
        "num_stages": len(stages),
        "num_classes": sum(s["num_classes"] for s in stages),
        "total_bytes": total_bytes,
        "base_bytes": total_bytes - cum_bytes,  # run.yaml (+ ptm.safetensors for --random-init)
        "stages": stages,
        "forgotten": [entry.to_dict() for entry in forgotten.forgotten],
        "forget_history": list(forgotten.events),
        "history": history_of(metas).to_dict(),
        "config": record["config"],
    }
