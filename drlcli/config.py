"""Typed, frozen hyper-parameters for a run, with strict YAML/dict round trips.

Defaults are the paper's (§IV "Training details") unless SPEC.md says otherwise. Unknown keys
and out-of-range values are errors, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_type_hints

from . import jsonio, storage
from .errors import UsageError

if TYPE_CHECKING:
    from .methods import Method


@dataclass(frozen=True)
class IPAConfig:
    """Shape of each stage's Incremental Parallel Adapter (SPEC §2.1)."""

    adapter_dim: int | None = None  # r; None: d // 16 (48 for ViT-B, 12 for DeiT-Tiny), at least 8
    gamma: float = 0.9  # gate input mix: (1-γ)·previous stage + γ·PTM
    activation: str = "relu"  # adapter and gate bottleneck activation: relu | gelu
    gate: str = "adapt"  # adapt: (1-M)a + Mg | sum: a + g | part: a + Mg
    attention: str = "reuse"  # reuse: A^l mixes the adapter output | none: no mixing
    gate_bias_init: float = 3.0  # M starts at sigmoid(3) = 0.95: a new stream ≈ what it inherits
    ffn_dim: int | None = None  # transfer block FFN hidden width; None: d (the paper's d→d→d)

    def resolved_adapter_dim(self, width: int) -> int:
        return self.adapter_dim if self.adapter_dim is not None else max(8, width // 16)


@dataclass(frozen=True)
class EaseConfig:
    """The EASE baseline's per-stage AdaptFormer adapter (SPEC §3): x + MLP(LN(x)) + s·Up(ReLU(Down(x)))."""

    adapter_dim: int = 64  # r
    scale: float = 0.1  # s
    dropout: float = 0.1  # on the bottleneck, training only (as in the public EASE code)


MAX_CONFIG_FILE_BYTES = 1 << 20  # a --config file: a few sections of options, never megabytes
MAX_LAYOUT_GRID = 8  # ranpac.layout_grid's bound (and that of a g a run or an export stores)


@dataclass(frozen=True)
class RanpacConfig:
    """The RanPAC baseline's analytic head (``ranpac.py``): random projection + ReLU + ridge."""

    proj_dim: int | None = None  # M, width of the random projection; None: min(3000, 16 d) (3000 for DeiT-Tiny)
    val_fraction: float = 0.2  # of each stage's images, held out in the statistics to choose λ
    lambda_min_exp: int = -8  # λ grid: 10^min .. 10^max, one per decade (RanPAC's)
    lambda_max_exp: int = 8
    subspaces: int = 1  # leading subspaces the head reads: 1: f_0 (RanPAC's); 2: [f_0, f_1] (drl: + stage 1's)
    # class covariances (ranpac.py): w of z(ridge) + w z(-Mahalanobis to class means); 0: RanPAC's ridge alone
    covariance_weight: float = 0.0
    covariance_shrink: float = 0.3  # a: S <- (1 - a) S + a (tr S / d) I
    covariance_blend: float = 0.8  # b: S_c <- (1 - b) S_c + b S_pooled
    # the PTM's layout in the head's input (drl's default, not RanPAC's): g > 0 appends the last
    # block's patch tokens averaged over a g x g grid of the image (backbone.ptm_layout), fixed at stage 1
    layout_grid: int = 0
    layout_scale: float = 1.0  # the layout's weight against f_0 in the input (folded into R's rows)

    def resolved_proj_dim(self, width: int) -> int:
        return self.proj_dim if self.proj_dim is not None else min(3000, 16 * width)


@dataclass(frozen=True)
class TrainConfig:
    """One stage's optimisation (SPEC §2.2)."""

    epochs: int = 20
    batch_size: int = 48
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-4
    loss: str = "das"  # das | ce
    anchor_pos: float = 1.0  # k for the positive term (k_+)
    anchor_neg: float = 1.0  # k for the negative term (k_-)
    lambda_pos: float = 3.0
    lambda_neg: float = 1.0
    kd_weight: float = 0.5  # α
    scale_init: float = 16.0  # σ of the cosine classifier; must exceed the anchor to reach it
    head_init: str = "random"  # random | prototypes: w_i starts at class i's mean feature
    crop_scale_min: float = 0.08  # RandomResizedCrop lower scale bound for training images
    hflip: bool = True
    seed: int = 0
    num_workers: int = 0  # DataLoader workers; 0 loads in the main process
    # a new stage whose subspace nothing the run answers reads (``methods.stage_is_read``) is
    # created but not trained; false trains every stage (runs from before this key: false)
    skip_unread: bool = False


@dataclass(frozen=True)
class ScoreConfig:
    """How a sample is scored against the prototype bank (SPEC §2.3)."""

    rule: str = "reweight"  # reweight (EASE) | concat (cosine over [f_0..f_t])
    rho: float = 0.1  # weight of the other stages' subspaces (EASE's alpha)
    beta: float = 1.0  # weight of the PTM subspace
    tau: float = 1.0  # temperature of the semantic-guided prototype synthesis
    head: str = "prototypes"  # prototypes: cosine to the bank (rule above) | ridge: the analytic head (ranpac.py)


@dataclass(frozen=True)
class OpenSetConfig:
    """Calibration of the "unknown" answer (``openset.py``), done by every stage at commit time."""

    rejection: float = 0.05  # target rate of the stage's known images called unknown (on held-out images)
    holdout: float = 0.2  # share of each class's images held out of the prototypes to calibrate (>= 1 image)
    score: str = "rmd"  # rmd: relative Mahalanobis on f_0 / |f_0| | cosine: to the subspace-0 prototypes
    # rmd: the class token of the PTM block at this fraction of its depth (block round(f (depth - 1)),
    # 7 of DeiT's 12) joins f_0, weighted by probe_weight; null: f_0 alone. Not for ease (no PTM subspace)
    probe_depth: float | None = 0.64
    probe_weight: float = 2.0


@dataclass(frozen=True)
class RunConfig:
    method: str = "drl"
    ipa: IPAConfig = field(default_factory=IPAConfig)
    ease: EaseConfig = field(default_factory=EaseConfig)
    ranpac: RanpacConfig = field(default_factory=RanpacConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    open_set: OpenSetConfig = field(default_factory=OpenSetConfig)

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        return _build(cls, data, "config")

    @classmethod
    def for_method(cls, method: str, data: dict[str, Any] | None = None, *, preset: str | None = None) -> RunConfig:
        """``method``'s defaults (its train recipe and other sections), then the named ``preset`` of the
        method if given, overlaid by ``data``'s sections."""
        spec = _method(method)
        if preset is not None and preset not in spec.presets:
            known = list(spec.presets) or "none"
            raise UsageError(f"method {method} has no preset {preset!r}; its presets: {known}")
        base = cls(method=method, train=spec.train_defaults).to_dict()
        layers = [spec.defaults, spec.presets[preset] if preset else {}, data or {}]
        for layer in layers:
            for section, values in layer.items():
                if section == "method":
                    continue
                if isinstance(values, dict) and isinstance(base.get(section), dict):
                    base[section] = {**base[section], **values}
                else:
                    base[section] = values
        return cls.from_dict(base)

    @classmethod
    def from_yaml(cls, path: Path, *, method: str | None = None, preset: str | None = None) -> RunConfig:
        """A config file's sections over ``method``'s defaults (``method`` overrides the file's)."""
        try:
            text = storage.read_regular(Path(path), limit=MAX_CONFIG_FILE_BYTES, what="config", follow=True)
            data = jsonio.load_yaml(text) or {}
        except OSError as exc:
            raise UsageError(f"cannot read config {path}: {exc.strerror}; pass a readable YAML file") from exc
        except ValueError as exc:
            raise UsageError(
                f"config {path} is not a YAML file drl reads ({exc}); pass a YAML mapping of sections"
            ) from exc
        if not isinstance(data, dict):
            raise UsageError(f"config {path} must be a YAML mapping of sections")
        return cls.for_method(method or data.get("method", "drl"), data, preset=preset)

    def with_train(self, **overrides: Any) -> RunConfig:
        """A copy with some training options replaced (``None`` values are ignored)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        merged = {**dataclasses.asdict(self.train), **given}
        return dataclasses.replace(self, train=_build(TrainConfig, merged, "train"))


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise UsageError(f"{where} must be a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(f"unknown {where} key(s) {unknown}; known keys: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{where}.{name}")
        else:
            kwargs[name] = _coerce(value, hint, f"{where}.{name}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    allowed = [t for t in getattr(hint, "__args__", (hint,)) if t is not type(None)]
    if value is None:
        if type(None) in getattr(hint, "__args__", ()):
            return None
        raise UsageError(f"{where} must not be empty")
    target = allowed[0]
    if target is bool:
        if isinstance(value, bool):
            return value
    elif target is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise UsageError(f"{where} must be a finite number, got {value}")
        return float(value)
    elif (
        target is int
        and isinstance(value, int)
        and not isinstance(value, bool)
        or target is str
        and isinstance(value, str)
    ):
        return value
    raise UsageError(f"{where} must be {target.__name__}, got {value!r}")


def _registry() -> dict[str, Method]:
    """The registered methods (``methods/``, which imports this module: so imported here, late)."""
    from .methods import METHODS

    return METHODS


def _method(name: str) -> Method:
    from .methods import get_method

    return get_method(name)


def config_sections() -> dict[str, type]:
    """Each section of a run config (``ipa``, ``ease``, ``ranpac``, ``train``, ``score``, ``open_set``) and its dataclass."""
    hints = get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in fields(RunConfig) if dataclasses.is_dataclass(hints[f.name])}


_CHOICES = {
    ("ipa", "activation"): ("relu", "gelu"),
    ("ipa", "gate"): ("adapt", "sum", "part"),
    ("ipa", "attention"): ("reuse", "none"),
    ("train", "loss"): ("das", "ce"),
    ("train", "head_init"): ("random", "prototypes"),
    ("score", "rule"): ("reweight", "concat"),
    ("score", "head"): ("prototypes", "ridge"),
    ("open_set", "score"): ("rmd", "cosine"),  # openset.RULES
}


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


_DEFAULTS = {
    "ipa": IPAConfig(),
    "ease": EaseConfig(),
    "train": TrainConfig(),
    "score": ScoreConfig(),
    "ranpac": RanpacConfig(),
    "open_set": OpenSetConfig(),
}

# Every number a run config holds, with the values that make sense (NaN and ±inf never do).
_RANGES = {
    ("ipa", "adapter_dim"): Range(1, MAX_DIM),
    ("ipa", "ffn_dim"): Range(1, MAX_DIM),
    ("ipa", "gamma"): Range(0, 1),
    ("ipa", "gate_bias_init"): Range(-100, 100),
    ("ease", "adapter_dim"): Range(1, MAX_DIM),
    ("ease", "scale"): Range(0, 100),
    ("ease", "dropout"): Range(0, 1, high_open=True),
    ("train", "epochs"): Range(1, 10_000),
    ("train", "batch_size"): Range(1, 65_536),
    ("train", "lr"): Range(0, 10, low_open=True),
    ("train", "momentum"): Range(0, 1, high_open=True),
    ("train", "weight_decay"): Range(0, 1),
    ("train", "anchor_pos"): Range(-100, 100),
    ("train", "anchor_neg"): Range(-100, 100),
    ("train", "lambda_pos"): Range(0, 100),
    ("train", "lambda_neg"): Range(0, 100),
    ("train", "kd_weight"): Range(0, 100),
    ("train", "scale_init"): Range(0, 1000, low_open=True),
    ("train", "crop_scale_min"): Range(0, 1, low_open=True),
    ("train", "seed"): Range(0, 2**32 - 1),
    ("train", "num_workers"): Range(0, 256),
    ("score", "rho"): Range(0, 100),
    ("score", "beta"): Range(0, 100),
    ("score", "tau"): Range(0, 100, low_open=True),
    ("ranpac", "proj_dim"): Range(1, 65_536),
    ("ranpac", "val_fraction"): Range(0, 1, low_open=True, high_open=True),
    ("ranpac", "lambda_min_exp"): Range(-30, 30),
    ("ranpac", "lambda_max_exp"): Range(-30, 30),
    ("ranpac", "subspaces"): Range(1, 2),
    ("ranpac", "covariance_weight"): Range(0, 100),
    ("ranpac", "covariance_shrink"): Range(0, 1),
    ("ranpac", "covariance_blend"): Range(0, 1),
    ("ranpac", "layout_grid"): Range(0, MAX_LAYOUT_GRID),
    ("ranpac", "layout_scale"): Range(0, 100, low_open=True),
    ("open_set", "rejection"): Range(0, 0.5, low_open=True),
    ("open_set", "holdout"): Range(0, 0.5, low_open=True),
    ("open_set", "probe_depth"): Range(0, 1, high_open=True),
    ("open_set", "probe_weight"): Range(0, 100, low_open=True),
}


def validate(cfg: RunConfig) -> None:
    """Raise ``UsageError`` naming the first option that is unknown, non-finite or out of range,
    or that breaks a rule of the config's method (``methods/``)."""
    method = _method(cfg.method)
    for (section, name), choices in _CHOICES.items():
        value = getattr(getattr(cfg, section), name)
        if value not in choices:
            raise UsageError(f"{section}.{name} must be one of {list(choices)}, got {value!r}")
    for (section, name), allowed in _RANGES.items():
        value = getattr(getattr(cfg, section), name)
        if value is not None and (not math.isfinite(value) or value not in allowed):
            default = getattr(_DEFAULTS[section], name)
            hint = "" if default is None else f" (default {default})"
            raise UsageError(f"{section}.{name} must be a number in {allowed}{hint}, got {value}")
    method.rules(cfg)
    for other in _registry().values():  # every config holds every method's section
        other.section_rules(cfg)
    if cfg.score.head == "ridge" and not method.offset:
        raise UsageError(f"score.head ridge needs a PTM subspace, which method {cfg.method} has not: use prototypes")
    if cfg.ranpac.subspaces == 2 and not (method.trains and method.offset and cfg.score.head == "ridge"):
        raise UsageError("ranpac.subspaces 2 reads stage 1's subspace: only for method drl with score.head ridge")


MAX_WORKERS = _RANGES[("train", "num_workers")].high  # also bounds `eval`/`predict`/`benchmark --workers`
PRECISIONS = ("fp32", "bf16", "fp16")  # --precision: the network forward's dtype (precision.py)
MAX_SEED = _RANGES[("train", "seed")].high  # also bounds `init --seed` and `benchmark --seed`
MAX_INPUT_SIDE = 4096  # pixels; a PTM input above this is a crafted record, not a ViT
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
        raise UsageError(f"ptm.source must be one of {list(PTM_SOURCES)}, got {ptm['source']!r}")
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
            raise UsageError(f"ptm.hub.{key} is not a valid {key.replace('_', ' ')}, got {value!r}")


def check_data_config(data_config: Any) -> None:
    """A PTM's preprocessing as ``data.eval_transform`` reads it (from run.yaml or an export):
    input size (3, H, W), mean/std of 3 finite numbers (std > 0), crop, interpolation; else
    ``UsageError`` naming the first field that is not."""
    if not isinstance(data_config, dict):
        raise UsageError(f"data_config must be a mapping, got {type(data_config).__name__}")
    size = data_config.get("input_size")
    if not (
        isinstance(size, list)
        and len(size) == 3
        and size[0] == 3
        and all(_is_number(v, int) and 1 <= v <= MAX_INPUT_SIDE for v in size)
    ):
        raise UsageError(f"data_config.input_size must be [3, H, W] with H, W in [1, {MAX_INPUT_SIDE}], got {size!r}")
    for key in ("mean", "std"):
        values = data_config.get(key)
        if not (isinstance(values, list) and len(values) == 3 and all(_is_number(v) for v in values)):
            raise UsageError(f"data_config.{key} must be 3 numbers (finite), got {values!r}")
    if not all(v > 0 for v in data_config["std"]):
        raise UsageError(f"data_config.std must be > 0, got {data_config['std']!r}")
    crop = data_config.get("crop_pct")
    if crop is not None and not (_is_number(crop) and 0 < crop <= 2):
        raise UsageError(f"data_config.crop_pct must be in (0, 2], got {crop!r}")
    for key, choices in (("interpolation", INTERPOLATIONS), ("crop_mode", CROP_MODES)):
        if key in data_config and data_config[key] not in choices:
            raise UsageError(f"data_config.{key} must be one of {list(choices)}, got {data_config[key]!r}")


def _is_number(value: Any, kind: type = float) -> bool:
    """A finite int or float (not a bool); ``kind=int`` asks for an int."""
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        return False
    return math.isfinite(value)
