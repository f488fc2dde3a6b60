"""The ``ptm`` record of a run (run.yaml) and of an export: what ``init`` writes of the PTM (name,
shape arguments, sha256, where the weights came from, its preprocessing), checked field by field
whenever it is read back, before any of it reaches timm, the hub library or a transform."""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import UsageError, shown

MAX_INPUT_SIDE = 4096  # pixels; a PTM input above this is a crafted record, not a ViT
MIN_CROP = 0.05  # crop_pct above it (timm's are 0.8 to 1): a smaller one resizes to 20x the input side and more


PTM_SOURCES = ("random", "file", "hub", "hf-hub")  # hub: timm's own download; hf-hub: a hf-hub:ORG/NAME repo


# A Hugging Face repo id (ORG/NAME, the hub's own rules, shorter), a snapshot's commit, a sha256
HUB_REPO = re.compile(
    r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9])?"
)


HUB_COMMIT = re.compile(r"[0-9a-f]{40}")


SHA256 = re.compile(r"[0-9a-f]{64}")


INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")  # torchvision's modes


CROP_MODES = ("center", "squash", "border")  # timm's


def check_ptm_record(ptm: Any) -> None:
    """The ``ptm`` section of run.yaml as ``drl init`` writes it; ``UsageError`` naming the first
    field that is not (a record read from disk must never reach timm or a transform unchecked)."""
    if not isinstance(ptm, dict):
        raise UsageError(f"ptm must be a mapping, got {type(ptm).__name__}")
    for key, kind in {"name": str, "kwargs": dict, "sha256": str, "source": str, "data_config": dict}.items():
        if not isinstance(ptm.get(key), kind):
            raise UsageError(f"ptm.{key} must be a {kind.__name__}, got {type(ptm.get(key)).__name__}")
    if ptm["source"] not in PTM_SOURCES:
        raise UsageError(f"ptm.source must be one of {list(PTM_SOURCES)}, got {shown(ptm['source'])}")
    if not isinstance(ptm.get("weights_hint"), (str, type(None))):
        raise UsageError("ptm.weights_hint must be a relative path or null")
    if ptm["source"] == "hf-hub":
        check_hub_record(ptm.get("hub"))
    check_data_config(ptm["data_config"])


def check_hub_record(hub: Any) -> None:
    """run.yaml's ``ptm.hub`` as ``drl init --ptm hf-hub:...`` writes it: the repo, the snapshot's
    commit and the weights file's sha256 (nothing else of it reaches the hub library)."""
    if not isinstance(hub, dict):
        raise UsageError(f"ptm.hub must be a mapping for source hf-hub, got {type(hub).__name__}")
    for key, pattern in (("repo", HUB_REPO), ("revision", HUB_COMMIT), ("weights_sha256", SHA256)):
        value = hub.get(key)
        if not (isinstance(value, str) and pattern.fullmatch(value) and ".." not in value and "--" not in value):
            raise UsageError(f"ptm.hub.{key} is not a valid {key.replace('_', ' ')}, got {shown(value)}")


def check_data_config(data_config: Any) -> None:
    """A PTM's preprocessing as ``data.eval_transform`` reads it (from run.yaml or an export):
    input size (3, H, W), mean/std of 3 finite numbers (std > 0), crop, interpolation; else
    ``UsageError`` naming the first field that is not."""
    if not isinstance(data_config, dict):
        raise UsageError(f"data_config must be a mapping, got {type(data_config).__name__}")
    _check_sizes(data_config)
    crop = data_config.get("crop_pct")
    if crop is not None and not (_is_number(crop) and MIN_CROP < crop <= 1):
        raise UsageError(f"data_config.crop_pct must be in ({MIN_CROP}, 1], got {shown(crop)}")
    for key, choices in (("interpolation", INTERPOLATIONS), ("crop_mode", CROP_MODES)):
        if key in data_config and data_config[key] not in choices:
            raise UsageError(f"data_config.{key} must be one of {list(choices)}, got {shown(data_config[key])}")


def _check_sizes(data_config: dict[str, Any]) -> None:
    """input_size [3, H, W] within bounds; mean and std 3 finite numbers each, std > 0."""
    size = data_config.get("input_size")
    if not (_numbers(size, 3, int) and size[0] == 3 and all(1 <= v <= MAX_INPUT_SIDE for v in size)):
        raise UsageError(
            f"data_config.input_size must be [3, H, W] with H, W in [1, {MAX_INPUT_SIDE}], got {shown(size)}"
        )
    for key in ("mean", "std"):
        if not _numbers(data_config.get(key), 3):
            raise UsageError(f"data_config.{key} must be 3 numbers (finite), got {shown(data_config.get(key))}")
    if not all(v > 0 for v in data_config["std"]):
        raise UsageError(f"data_config.std must be > 0, got {shown(data_config['std'])}")


def _numbers(values: Any, count: int, kind: type = float) -> bool:
    """A list of ``count`` finite numbers (ints with ``kind=int``)."""
    return isinstance(values, list) and len(values) == count and all(_is_number(v, kind) for v in values)


def _is_number(value: Any, kind: type = float) -> bool:
    """A finite int or float (not a bool); ``kind=int`` asks for an int."""
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond any float (10**400): no number a transform can use
        return False


def check_input_size(data_config: dict[str, Any], model: Any) -> None:
    """A checked ``data_config``'s input size is one the PTM ``model`` takes: its patch embedding's
    image size (a model of dynamic image size: at least one patch a side); ``UsageError`` otherwise."""
    embed = getattr(model, "patch_embed", None)
    size, patch = getattr(embed, "img_size", None), getattr(embed, "patch_size", None)
    if size is None:
        return
    found = tuple(data_config["input_size"][1:])
    if getattr(model, "dynamic_img_size", False) and patch is not None:
        fits = all(side >= step for side, step in zip(found, tuple(patch)))
    else:
        fits = found == tuple(size)
    if not fits:
        raise UsageError(
            f"data_config.input_size {list(data_config['input_size'])} is not what the PTM takes, "
            f"[3, {', '.join(map(str, size))}]"
        )
