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
from ..recipes import BY_NAME
from ..version import __version__
from .layout import RUN_CONFIG, RUN_CONFIG_KIND

if TYPE_CHECKING:
    from .directory import RunDir


def run_record(ptm_record: dict[str, Any], config: RunConfig, recipe: str | None = None) -> dict[str, Any]:
    """run.yaml of a new run: its PTM section, the recipe it was made from (``recipes.py``) and its config."""
    return {
        "kind": RUN_CONFIG_KIND,
        "drl_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "ptm": ptm_record,
        **({"recipe": recipe} if recipe is not None else {}),
        "config": config.to_dict(),
    }


def recorded_recipe(record: dict[str, Any]) -> str | None:
    """The recipe run.yaml names (``recipes.py``), or None: a run of an earlier release, or a name no
    recipe has (a hand-edited record)."""
    name = record.get("recipe")
    return name if isinstance(name, str) and name in BY_NAME else None


def read_record(run: RunDir, manifest: dict[str, Any]) -> tuple[dict[str, Any], RunConfig]:
    """run.yaml and its hyper-parameters. A record that passed its checksum but is not what
    ``init`` writes (crafted by hand, or by a buggy tool) is an IntegrityError, never a crash."""
    record = run.run_config(manifest)
    try:
        check_ptm_record(record.get("ptm"))
        config = RunConfig.from_dict(record.get("config"))
    except UsageError as exc:
        raise IntegrityError(
            f"{run.shown(RUN_CONFIG)} is not a valid run config ({exc}); restore it from a backup"
        ) from exc
    return record, config


_STAGE_META_TYPES = {
    "classes": list,
    "images_per_class": dict,
    "data_fingerprint": str,
    "metrics": dict,
}
MAX_COUNT = 2**63 - 1  # a count drl writes (stage, images, parameters) fits an int64 and, roughly, a float


def is_count(value: Any) -> bool:
    """A whole number drl counts with: an int (not a bool) in [0, ``MAX_COUNT``]."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def is_number(value: Any) -> bool:
    """An int or float (not a bool) that is a finite float: ``1e400`` parses as inf, ``10**400`` as an
    int no float holds; either would break the arithmetic and formatting that read it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _is_percent(value: Any) -> bool:
    return is_number(value) and 0 <= value <= 100


def _is_optional_percent(value: Any) -> bool:
    return value is None or _is_percent(value)


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
    problem = _header_problem(index, meta)
    return problem if problem is not None else next((p for check in _PARTS if (p := check(meta)) is not None), None)


def _header_problem(index: int, meta: dict[str, Any]) -> str | None:
    """The fields every stage.json has: their types, and the stage it says it is."""
    for key, kind in _STAGE_META_TYPES.items():
        if not isinstance(meta.get(key), kind):
            return f"{key} is not a {kind.__name__}"
    for key in ("stage", "num_params"):
        if not is_count(meta.get(key)):
            return f"{key} is not a count (an int in [0, 2^63))"
    return f"it says it is stage {meta['stage']}" if meta["stage"] != index else None


def _names_problem(meta: dict[str, Any]) -> str | None:
    """``classes`` a list of names; ``eval_data``, when present, an eval set found (``_eval_data_found``)."""
    if not meta["classes"] or not all(isinstance(c, str) and c for c in meta["classes"]):
        return "classes is not a list of names"
    eval_data = meta.get("eval_data")
    if eval_data is not None and not (isinstance(eval_data, dict) and _eval_data_found(eval_data)):
        return "eval_data has no path"
    return None


def _eval_data_found(entry: dict[str, Any]) -> bool:
    """A registered eval set has a path; one held out of its drop (--eval-fraction) a fraction instead."""
    if "held_out" in entry:
        fraction = entry["held_out"]
        return is_number(fraction) and 0 < fraction < 1 and "path" not in entry
    return isinstance(entry.get("path"), str)


def _images_problem(meta: dict[str, Any]) -> str | None:
    """``images_per_class``: a count of images for each class name."""
    bad = next((name for name, count in meta["images_per_class"].items() if not is_count(count)), None)
    return None if bad is None else f"images_per_class.{bad} is not a count of images"


def _open_set_problem(meta: dict[str, Any]) -> str | None:
    """``open_set`` (absent before the "unknown" answer's calibration): its thresholds finite numbers."""
    entry = meta.get("open_set")
    if entry is None:
        return None
    if not isinstance(entry, dict):
        return "open_set is not a mapping"
    bad = next(
        (k for k in ("threshold", "rmd_threshold") if entry.get(k) is not None and not is_number(entry[k])), None
    )
    return None if bad is None else f"open_set.{bad} is not a finite number"


def _switch_problem(meta: dict[str, Any]) -> str | None:
    """``switch`` and ``carry.transfer`` (a switched or carried run's): when present, as drl writes them."""
    if "switch" in meta and switch_record(meta) is None:
        return "switch is not a switch record (answers, top-1 percentages, frozen_seconds, frozen_stage_sha256)"
    carry = meta.get("carry")
    if carry is not None and not isinstance(carry, dict):
        return "carry is not a mapping"
    if carry is not None and "transfer" in carry and transfer_record(meta) is None:
        return "carry.transfer is not forward-transfer counts (better + worse <= images, for the stage and the run)"
    return None


def _metrics_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with a stage's ``metrics`` (None: nothing): the evaluation, train and seconds."""
    problem = _eval_problem(meta["metrics"].get("eval"))
    if problem is not None:
        return f"metrics.eval{problem}"
    train = meta["metrics"].get("train")
    if train is not None and not isinstance(train, dict):
        return "metrics.train is not a mapping"
    seconds = {"train.seconds": (train or {}).get("seconds"), "learn_seconds": meta["metrics"].get("learn_seconds")}
    bad = next((name for name, value in seconds.items() if value is not None and not _is_seconds(value)), None)
    return f"metrics.{bad} is not a number of seconds" if bad else None


_EVAL_FIELDS = {  # an AccuracyReport's fields as stage.json holds them, and what each must be
    "top1": _is_percent,
    "num_images": is_count,
    "old": _is_optional_percent,
    "new": _is_optional_percent,
    "top5": _is_optional_percent,
}


def _eval_problem(evaluation: Any) -> str | None:
    """What is wrong with ``metrics.eval`` (an ``AccuracyReport``; falsy: no evaluation), as the rest of
    the field's name (``.top1 is not ...``); None: nothing."""
    if not evaluation:
        return None
    if not isinstance(evaluation, dict):
        return " is not a mapping"
    problem = _eval_fields_problem(evaluation)
    return problem if problem is not None else _groups_problem(evaluation.get("groups", {}))


def _eval_fields_problem(evaluation: dict[str, Any]) -> str | None:
    """``metrics.eval``'s accuracies (``_EVAL_FIELDS``): none drl does not report, each as it writes it."""
    unknown = sorted(set(evaluation) - {*_EVAL_FIELDS, "groups"})
    if unknown:
        return f" holds {unknown[0]!r}, no accuracy drl reports"
    for key, ok in _EVAL_FIELDS.items():
        if not ok(evaluation.get(key)) and (key in evaluation or key in ("top1", "num_images")):
            return f".{key} is not {'a count' if key == 'num_images' else 'a percentage'}"
    return None


def _groups_problem(groups: Any) -> str | None:
    """``metrics.eval.groups``: a percentage per stage group."""
    if not isinstance(groups, dict):
        return ".groups is not a mapping"
    bad = next((g for g, v in groups.items() if not (g.isdigit() and len(g) < 10 and _is_percent(v))), None)
    return None if bad is None else f".groups.{bad[:20]} is not a stage's percentage"


_PARTS = (_names_problem, _images_problem, _open_set_problem, _switch_problem, _metrics_problem)


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
    """Stage 1's first-session decision as stage.json holds it (``stage/decide.py``); None
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
    if not all(_is_optional_percent(v) for v in scores.values()):
        return None
    seconds, sha = record.get("frozen_seconds"), record.get("frozen_stage_sha256")
    if not (_is_seconds(seconds) and isinstance(sha, str)):
        return None
    return {"answers": record["answers"], "top1": scores, "frozen_seconds": seconds, "frozen_stage_sha256": sha}


def train_metrics(meta: dict[str, Any]) -> dict[str, Any]:
    """A checked stage's ``metrics.train`` (``check_stage_meta``); empty for a method that trains nothing."""
    return meta["metrics"].get("train") or {}


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**53


def _amount(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and 0 <= value < 1e9


def passes_record(meta: dict[str, Any]) -> dict[str, float] | None:
    """A stage's learning cost as stage.json holds it (``metrics.passes``: forward passes per image,
    ``stage/cost.py``); None when it has none or a malformed one."""
    record = meta["metrics"].get("passes")
    keys = ("per_image", "training", "features", "trial")
    if not isinstance(record, dict) or not all(_amount(record.get(k)) for k in keys):
        return None
    return {k: float(record[k]) for k in keys}


def trial_record(meta: dict[str, Any]) -> dict[str, Any] | None:
    """A stage's trial as stage.json holds it (``carry.trial``, ``stage/trial.py``); None when it has
    none or a malformed one."""
    carry = meta.get("carry")
    record = carry.get("trial") if isinstance(carry, dict) else None
    if not isinstance(record, dict) or not isinstance(record.get("margins"), dict):
        return None
    margins = record["margins"]
    counts = ("classes_trained", "images_trained", "epochs", "classes_measured", "images_measured")
    checks = [_count(record.get(k)) for k in counts] + [_count(margins.get("images"))]
    checks += [_real(margins.get(k)) for k in ("percent", "z", "floor")]
    checks += [_amount(record.get("seconds")), type(record.get("trains")) is bool]
    checks += [type(record.get("deferred", False)) is bool]  # absent before stages of too few classes deferred
    if not all(checks):
        return None
    return {
        **{k: record[k] for k in (*counts, "seconds", "trains")},
        "deferred": record.get("deferred", False) and not record["trains"],
        "margins": {k: margins[k] for k in ("images", "percent", "z", "floor")},
    }


def _real(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and abs(value) < 1e9


def set_has_trained(metas: list[dict[str, Any]]) -> bool:
    """Whether a run with these stage records has trained its adapter set: it has a stage, and its trials did
    not keep the set untrained (``trial_declined``)."""
    return bool(metas) and not trial_declined(metas)


def trial_declined(metas: list[dict[str, Any]]) -> bool:
    """Whether the run's adapter set has never trained because its trials said adapting changes little
    (``stage/trial.py``): stage 1 was tried, and every stage kept the set as it stood."""
    carries = [m.get("carry") for m in metas]
    if not carries or not (isinstance(carries[0], dict) and isinstance(carries[0].get("trial"), dict)):
        return False
    return all(isinstance(c, dict) and c.get("paused") is True for c in carries)
