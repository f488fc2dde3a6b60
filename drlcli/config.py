"""A run's configuration (``run.yaml``'s ``config``): its method and every option section, typed,
frozen, with strict YAML/dict round trips.

The sections every run has (``train``, ``score``, ``open_set``) are ``options.py``'s; the others
come from the registries: each method's own (``ipa``, ``ease``) and each analytic head's
(the ridge head's), read as attributes (``config.ipa``). Every config holds every
section, so a run's ``run.yaml`` says all it was made with. A new run starts from its method's
defaults and named preset (``methods/``); unknown keys and out-of-range values are errors, never
silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from . import heads, jsonio, methods, storage
from .errors import UsageError, shown
from .options import (
    SHARED_SECTIONS,
    OpenSetConfig,
    ScoreConfig,
    TrainConfig,
    as_dict,
    build_section,
    check_section,
)

MAX_CONFIG_FILE_BYTES = 1 << 20  # a --config file: a few sections of options, never megabytes


def own_sections() -> dict[str, type]:
    """The sections the registries add, in order: every method's, then every analytic head's."""
    return {**methods.sections(), **heads.sections()}


def config_sections() -> dict[str, type]:
    """Every section of a run config and its dataclass (``ipa``, ``ease``, the heads', ``train``, ...)."""
    return {**own_sections(), **SHARED_SECTIONS}


@dataclass(frozen=True)
class RunConfig:
    method: str = "drl"
    train: TrainConfig = field(default_factory=TrainConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    open_set: OpenSetConfig = field(default_factory=OpenSetConfig)
    # the methods' and heads' own sections by name (``own_sections``); missing ones take their defaults
    sections: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        known = own_sections()
        unknown = sorted(set(self.sections) - set(known))
        if unknown:
            raise UsageError(f"unknown config section(s) {unknown}; known: {sorted(config_sections())}")
        filled = {name: self.sections.get(name) or cls() for name, cls in known.items()}
        object.__setattr__(self, "sections", MappingProxyType(filled))
        validate(self)

    def __getattr__(self, name: str) -> Any:
        """A method's or head's own section: ``config.ipa``, ``config.ease``."""
        sections = self.__dict__.get("sections")
        if sections is not None and name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__} has no section {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunConfig) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(jsonio.dumps(self.to_dict(), sort_keys=True))

    def to_dict(self) -> dict[str, Any]:
        own = {name: as_dict(section) for name, section in self.sections.items()}
        shared = {name: as_dict(getattr(self, name)) for name in SHARED_SECTIONS}
        return {"method": self.method, **own, **shared}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        if not isinstance(data, dict):
            raise UsageError(f"config must be a mapping, got {type(data).__name__}")
        known = config_sections()
        unknown = sorted(set(data) - set(known) - {"method"}, key=str)  # YAML keys may be numbers
        if unknown:
            raise UsageError(f"unknown config key(s) {shown(unknown)}; known keys: {sorted({*known, 'method'})}")
        method = data.get("method", "drl")
        if not isinstance(method, str):
            raise UsageError(f"config.method must be str, got {shown(method)}")
        built = {
            name: build_section(known[name], value, f"config.{name}") for name, value in data.items() if name in known
        }
        shared = {name: built.pop(name) for name in SHARED_SECTIONS if name in built}
        return cls(method=method, sections=built, **shared)

    @classmethod
    def for_method(cls, method: str, data: dict[str, Any] | None = None, *, preset: str | None = None) -> RunConfig:
        """``method``'s defaults (its train recipe and other sections), then the named ``preset`` of the
        method (if none is named, its default preset, if it has one), overlaid by ``data``'s sections."""
        spec = methods.get_method(method)
        if preset is not None and preset not in spec.presets:
            known = list(spec.presets) or "none"
            raise UsageError(f"method {method} has no preset {shown(preset)}; its presets: {known}")
        preset = spec.default_preset if preset is None else preset
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
        """A config file's sections over ``method``'s defaults and preset (``method`` and ``preset``
        override the file's ``method`` and ``preset``)."""
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
        named = data.pop("preset", None)  # the file may name its method's preset; --preset wins
        if named is not None and not isinstance(named, str):
            raise UsageError(f"config {path}: preset must be a preset's name, got {shown(named)}")
        return cls.for_method(method or data.get("method", "drl"), data, preset=preset or named)

    def with_train(self, **overrides: Any) -> RunConfig:
        """A copy with some training options replaced (``None`` values are ignored)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        merged = {**dataclasses.asdict(self.train), **given}
        return dataclasses.replace(self, train=build_section(TrainConfig, merged, "train"))


def validate(cfg: RunConfig) -> None:
    """Raise ``UsageError`` naming the first option that is unknown, non-finite or out of range,
    or that breaks a rule of the config's method or of a head (``methods/``, ``heads/``)."""
    method = methods.get_method(cfg.method)
    for name in SHARED_SECTIONS:
        check_section(name, getattr(cfg, name))
    for name, section in cfg.sections.items():
        check_section(name, section)
    method.rules(cfg)
    for head in heads.HEADS.values():  # every config holds every head's section
        head.rules(cfg, method)
