"""Option sections: frozen dataclasses of typed options, each field carrying its allowed range or
choices, built strictly from YAML or dicts (unknown keys, wrong types and out-of-range values are
errors naming the option, never silently ignored).

The sections every run has live here: ``train`` (one stage's optimisation, SPEC §2.2), ``score``
(the prototype bank's scoring, SPEC §2.3) and ``open_set`` (the "unknown" answer's calibration). A
method's or a head's own section lives in its folder (``features/ipa/__init__.py``,
``heads/ridge/options.py``) and is declared to the registry; ``config.RunConfig`` assembles them.
Defaults are the paper's (§IV "Training details") unless SPEC.md says otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from .errors import UsageError, shown

MAX_DIM = 16_384  # adapter and FFN widths: 8x ViT-g's; a typo such as 10^8 is refused before it allocates


@dataclass(frozen=True)
class Range:
    """An interval of allowed values; ``str`` gives it in interval notation, e.g. ``(0, 10]``."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"


def option(default: Any, *, within: Range | None = None, choices: tuple[Any, ...] | None = None) -> Any:
    """A section field with its default and the values it allows (a range for numbers, else choices)."""
    return field(default=default, metadata={"range": within, "choices": choices})


def bound(section: type, name: str) -> Range:
    """The range a section's field allows (for limits shared with the CLI, e.g. ``--workers``)."""
    return next(f for f in fields(section) if f.name == name).metadata["range"]


def build_section(cls: type, data: Any, where: str) -> Any:
    """``cls`` from a mapping, every value of its field's type; ``UsageError`` naming ``where.key``."""
    if not isinstance(data, dict):
        raise UsageError(f"{where} must be a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known, key=str)  # YAML keys may be numbers: no mixed comparisons
    if unknown:
        raise UsageError(f"unknown {where} key(s) {shown(unknown)}; known keys: {sorted(known)}")
    return cls(**{name: _coerce(value, hints[name], f"{where}.{name}") for name, value in data.items()})


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """``value`` as the field's type (an int for a float field becomes a float); ``UsageError`` otherwise."""
    optional = type(None) in getattr(hint, "__args__", ())
    target = next(t for t in getattr(hint, "__args__", (hint,)) if t is not type(None))
    if value is None:
        if optional:
            return None
        raise UsageError(f"{where} must not be empty")
    if isinstance(value, bool) != (target is bool) or not _ACCEPTS[target](value):
        raise UsageError(f"{where} must be {target.__name__}, got {shown(value)}")
    if target is float:
        if not _finite(value):
            raise UsageError(f"{where} must be a finite number, got {shown(value)}")
        return float(value)
    return value


def _finite(value: float) -> bool:
    """Finite, and for an int one a float can hold (``math.isfinite(10**400)`` raises OverflowError)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


_ACCEPTS = {  # what a YAML value may be for a field of each type (bools are told apart before)
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int),
    float: lambda v: isinstance(v, (int, float)),
    str: lambda v: isinstance(v, str),
}


def parse_value(raw: str, where: str) -> Any:
    """A command-line ``KEY=VALUE``'s value as a YAML scalar (``32``, ``0.5``, ``true``, ``ce``) by the
    one bounded YAML parser (``jsonio.load_yaml``): a malformed value, a tag or a 5,000-digit number is
    a ``UsageError`` naming ``where`` (the option), never a crash."""
    from . import jsonio

    try:
        return jsonio.load_yaml(raw)
    except ValueError as exc:
        raise UsageError(
            f"{where}: {shown(raw)} is not a value drl reads ({exc}); write a number, true/false or a name"
        ) from None


def check_section(name: str, section: Any) -> None:
    """``UsageError`` naming the first field of ``section`` outside its choices or range."""
    default = type(section)()
    for item in fields(section):
        value, within, choices = getattr(section, item.name), item.metadata.get("range"), item.metadata.get("choices")
        if choices is not None and value not in choices:
            raise UsageError(f"{name}.{item.name} must be one of {list(choices)}, got {shown(value)}")
        if within is not None and value is not None and (not _finite(value) or value not in within):
            fallback = getattr(default, item.name)
            hint = "" if fallback is None else f" (default {fallback})"
            raise UsageError(f"{name}.{item.name} must be a number in {within}{hint}, got {shown(value)}")


def as_dict(section: Any) -> dict[str, Any]:
    return dataclasses.asdict(section)


# ----------------------------------------------------------------- the sections every run has


@dataclass(frozen=True)
class TrainConfig:
    """One stage's optimisation (SPEC §2.2)."""

    epochs: int = option(20, within=Range(1, 10_000))
    batch_size: int = option(48, within=Range(1, 65_536))
    lr: float = option(0.01, within=Range(0, 10, low_open=True))
    momentum: float = option(0.9, within=Range(0, 1, high_open=True))
    weight_decay: float = option(5e-4, within=Range(0, 1))
    loss: str = option("das", choices=("das", "ce", "cosface"))
    anchor_pos: float = option(1.0, within=Range(-100, 100))  # k for the positive term (k_+)
    anchor_neg: float = option(1.0, within=Range(-100, 100))  # k for the negative term (k_-)
    lambda_pos: float = option(3.0, within=Range(0, 100))
    lambda_neg: float = option(1.0, within=Range(0, 100))
    kd_weight: float = option(0.5, within=Range(0, 100))  # α
    # loss cosface: m, taken off the target class's cosine (CosFace's 0.35)
    margin: float = option(0.35, within=Range(0, 2))
    # σ of the cosine classifier; must exceed the anchor to reach it
    scale_init: float = option(16.0, within=Range(0, 1000, low_open=True))
    # random | prototypes: w_i starts at class i's mean feature
    head_init: str = option("random", choices=("random", "prototypes"))
    # RandomResizedCrop lower scale bound for training images
    crop_scale_min: float = option(0.08, within=Range(0, 1, low_open=True))
    hflip: bool = True
    seed: int = option(0, within=Range(0, 2**32 - 1))
    # each epoch trains on at most this many images of each class, drawn afresh every epoch
    # (``stage/batches.py``); null: every image (runs before this key)
    epoch_images_per_class: int | None = option(None, within=Range(1, 1_000_000))
    # the share of each layout cell's patch tokens a training step of an adapter set reads, drawn afresh
    # for every image (PatchDropout, Liu et al., WACV 2023); 1: every token
    keep_tokens: float = option(1.0, within=Range(0, 1, low_open=True))
    num_workers: int = option(0, within=Range(0, 256))  # DataLoader workers; 0 loads in the main process
    # a new stage whose subspace nothing the run answers reads (``methods.stage_is_read``) is
    # created but not trained; false trains every stage (runs from before this key: false)
    skip_unread: bool = False
    # the training steps' dtype (``precision.training_precision``): call (the call's --precision; runs
    # before this key) | auto (bf16 where the device computes it natively, else the call's) | fp32 | bf16 | fp16
    precision: str = option("call", choices=("call", "auto", "fp32", "bf16", "fp16"))


@dataclass(frozen=True)
class ScoreConfig:
    """How a sample is scored: the prototype bank (SPEC §2.3), or an analytic head (``heads/``)."""

    rule: str = option("reweight", choices=("reweight", "concat"))  # reweight (EASE) | concat (cosine over [f_0..f_t])
    rho: float = option(0.1, within=Range(0, 100))  # weight of the other stages' subspaces (EASE's alpha)
    beta: float = option(1.0, within=Range(0, 100))  # weight of the PTM subspace
    tau: float = option(1.0, within=Range(0, 100, low_open=True))  # temperature of the prototype synthesis
    # prototypes: cosine to the bank (rule above) | ridge: the analytic head (heads/ridge)
    head: str = option("prototypes", choices=("prototypes", "ridge"))


@dataclass(frozen=True)
class OpenSetConfig:
    """Calibration of the "unknown" answer (``heads/openset``), done by every stage at commit time."""

    # target rate of the stage's known images called unknown (on held-out images)
    rejection: float = option(0.05, within=Range(0, 0.5, low_open=True))
    # share of each class's images held out of the prototypes to calibrate (>= 1 image)
    holdout: float = option(0.2, within=Range(0, 0.5, low_open=True))
    # rmd: relative Mahalanobis on f_0 / |f_0| | cosine: to the subspace-0 prototypes
    score: str = option("rmd", choices=("rmd", "cosine"))
    # rmd: the class token of the PTM block at this fraction of its depth (block round(f (depth - 1)),
    # 7 of DeiT's 12) joins f_0, weighted by probe_weight; null: f_0 alone. Not for ease (no PTM subspace)
    probe_depth: float | None = option(0.64, within=Range(0, 1, high_open=True))
    probe_weight: float = option(2.0, within=Range(0, 100, low_open=True))


SHARED_SECTIONS: dict[str, type] = {"train": TrainConfig, "score": ScoreConfig, "open_set": OpenSetConfig}
MAX_WORKERS = int(bound(TrainConfig, "num_workers").high)  # also bounds `eval`/`predict`/`benchmark --workers`
MAX_SEED = int(bound(TrainConfig, "seed").high)  # also bounds `init --seed` and `benchmark --seed`
PRECISIONS = ("fp32", "bf16", "fp16")  # --precision: the network forward's dtype (precision.py)
