"""A run's records as drl reads them back: run.yaml (the PTM record and the config) and each stage's
stage.json, every field drl reads checked for the type it writes (a crafted record is damage, exit
5, never a crash), and the accuracy history they hold."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from ..config import RunConfig
from ..errors import IntegrityError, UsageError
from ..metrics import AccuracyReport, HistorySummary, Transfer, summarize_history
from ..ptm.record import check_ptm_record
from ..version import __version__
from .layout import RUN_CONFIG, RUN_CONFIG_KIND

if TYPE_CHECKING:
    from .directory import RunDir


def run_record(ptm_record: dict[str, Any], config: RunConfig) -> dict[str, Any]:
    """run.yaml of a new run: its PTM section and config."""
    return {
        "kind": RUN_CONFIG_KIND,
        "drl_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "ptm": ptm_record,
        "config": config.to_dict(),
    }


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


def checked_metas(run: RunDir, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every committed stage's stage.json, in stage order, each checked (``check_stage_meta``)."""
    metas = [run.stage_meta(i, manifest) for i in run.stage_indices(manifest)]
    for index, meta in zip(run.stage_indices(manifest), metas):
        check_stage_meta(run, index, meta)
    return metas


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
    return _metrics_problem(meta)


def _metrics_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with a stage's ``metrics`` (None: nothing): the evaluation, train and seconds."""
    try:
        history_of([meta])
    except (TypeError, ValueError, AttributeError) as exc:
        return f"metrics are malformed: {exc}"
    train = meta["metrics"].get("train")
    if train is not None and not isinstance(train, dict):
        return "metrics.train is not a mapping"
    seconds = {"train.seconds": (train or {}).get("seconds"), "learn_seconds": meta["metrics"].get("learn_seconds")}
    bad = next((name for name, value in seconds.items() if value is not None and not _is_seconds(value)), None)
    return f"metrics.{bad} is not a number of seconds" if bad else None


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


def history_of(metas: list[dict[str, Any]]) -> HistorySummary:
    reports = [AccuracyReport(**m["metrics"]["eval"]) if m["metrics"].get("eval") else None for m in metas]
    return summarize_history(reports)


def first_session_record(meta: dict[str, Any]) -> dict[str, Any] | None:
    """Stage 1's first-session decision as stage.json holds it (``stage/first_session.py``); None
    when it has none or a malformed one (a crafted stage.json is reported as having none)."""
    record = meta.get("first_session")
    if not isinstance(record, dict) or record.get("kept") not in ("adapted", "frozen"):
        return None
    scores = [record.get("adapted_top1"), record.get("frozen_top1")]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 100 for v in scores):
        return None
    held = record.get("held_out")
    if not isinstance(held, int) or isinstance(held, bool) or held < 0:
        return None
    return {"adapted_top1": float(scores[0]), "frozen_top1": float(scores[1]), "held_out": held, "kept": record["kept"]}


def transfer_record(meta: dict[str, Any]) -> dict[str, Any] | None:
    """A carried stage's forward transfer as stage.json holds it (``carry.transfer``: the stage's
    counts and the run's so far, ``metrics.Transfer``), what the run's say recomputed from them; None
    when it has none or a malformed one (a crafted stage.json is reported as having none)."""
    carry = meta.get("carry")
    record = carry.get("transfer") if isinstance(carry, dict) else None
    if not isinstance(record, dict):
        return None
    try:
        own, run = Transfer.from_dict(record), Transfer.from_dict(record.get("run"))
    except ValueError:
        return None
    return own.record(run)


def switch_record(meta: dict[str, Any]) -> dict[str, Any] | None:
    """A switched run's stage record (stage.json ``switch``: the track that answers and both tracks'
    top-1); None when it has none or a malformed one."""
    record = meta.get("switch")
    if not isinstance(record, dict) or record.get("answers") not in ("carried", "frozen"):
        return None
    top1 = record.get("top1")
    if not isinstance(top1, dict):
        return None
    scores = {k: top1.get(k) for k in ("carried", "frozen")}
    if not all(v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in scores.values()):
        return None
    seconds, sha = record.get("frozen_seconds"), record.get("frozen_stage_sha256")
    if not (isinstance(seconds, int | float) and not isinstance(seconds, bool) and isinstance(sha, str)):
        return None
    return {"answers": record["answers"], "top1": scores, "frozen_seconds": seconds, "frozen_stage_sha256": sha}


def train_metrics(meta: dict[str, Any]) -> dict[str, Any]:
    """A checked stage's ``metrics.train`` (``check_stage_meta``); empty for a method that trains nothing."""
    return meta["metrics"].get("train") or {}
