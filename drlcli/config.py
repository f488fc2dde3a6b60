"""A run's configuration (``run.yaml``'s ``config``): its method and every option section, typed,
frozen, with strict YAML/dict round trips.

The sections every run has (``train``, ``score``, ``open_set``) are ``options.py``'s; the others
come from the registries: the feature networks' (``ipa``, ``ease``, ``adapter``), the schedule's
and each analytic head's (``ridge``), read as attributes (``config.ridge``). Every config holds every
section, so a run's ``run.yaml`` says all it was made with. A new run starts from a recipe
(``recipes.py``); unknown keys and out-of-range values are errors, never silently ignored. The
section names of earlier releases (``ranpac``, ``first_session``) read as today's (``RENAMED``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from . import heads, jsonio, methods, recipes, storage
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
# sections of earlier releases (run.yaml, .drl files, --config files, benchmark variants) and the
# sections of today that hold their keys: each key goes to the one section that has it
RENAMED: dict[str, tuple[str, ...]] = {"ranpac": ("ridge",), "first_session": ("adapter", "schedule")}


def renamed_section(old: str, key: Any) -> str:
    """The section of today that holds key ``key`` of the earlier section ``old``."""
    owners = [name for name in RENAMED[old] if key in {f.name for f in dataclasses.fields(config_sections()[name])}]
    if not owners:
        raise UsageError(f"unknown key {shown(key)} in config section {old} (now {' and '.join(RENAMED[old])})")
    return owners[0]


def current_sections(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data``'s sections under today's names (an earlier release's ``ranpac`` is ``ridge``; its
    ``first_session`` keys go to ``adapter`` and ``schedule``); a section given under both names is an error."""
    out = {name: value for name, value in data.items() if name not in RENAMED}
    for old, new in RENAMED.items():
        if old not in data:
            continue
        if any(name in data for name in new):
            raise UsageError(f"config section {old} is {' and '.join(new)} today: give one of them, not both")
        values = data[old]
        if not isinstance(values, dict):
            out[new[0]] = values  # build_section names the problem
            continue
        for key, value in values.items():
            out.setdefault(renamed_section(old, key), {})[key] = value
    return out


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
        data = current_sections(data)
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
    def for_recipe(cls, name: str, data: dict[str, Any] | None = None) -> RunConfig:
        """Recipe ``name`` (``recipes.py``): its method's defaults and its options, overlaid by ``data``'s sections."""
        return cls._from_recipe(recipes.get_recipe(name), data)

    @classmethod
    def _from_recipe(cls, recipe: recipes.Recipe, data: dict[str, Any] | None) -> RunConfig:
        spec = methods.get_method(recipe.method)
        base = cls(method=recipe.method, train=spec.train_defaults).to_dict()
        for layer in (recipe.overrides, current_sections(data or {})):
            for section, values in layer.items():
                if section == "method":
                    continue
                if isinstance(values, dict) and isinstance(base.get(section), dict):
                    base[section] = {**base[section], **values}
                else:
                    base[section] = values
        return cls.from_dict(base)

    @classmethod
    def for_method(cls, method: str, data: dict[str, Any] | None = None, *, preset: str | None = None) -> RunConfig:
        """The recipe ``--method METHOD [--preset PRESET]`` names (``recipes.recipe_for``), overlaid by ``data``."""
        return cls._from_recipe(recipes.recipe_for(method, preset), data)

    @classmethod
    def from_yaml(
        cls, path: Path, *, method: str | None = None, preset: str | None = None, recipe: str | None = None
    ) -> RunConfig:
        """A config file's sections over a recipe: ``recipe``, else the file's ``recipe``, else the one
        ``method`` and ``preset`` name (which override the file's ``method`` and ``preset``)."""
        data = _config_file(path)
        named, chosen = _name_in(data, "preset", path), _name_in(data, "recipe", path)  # the options win
        if recipe is not None or (chosen is not None and method is None and preset is None):
            return cls.for_recipe(recipe or chosen, {k: v for k, v in data.items() if k != "method"})
        return cls.for_method(method or data.get("method", "drl"), data, preset=preset or named)

    def with_train(self, **overrides: Any) -> RunConfig:
        """A copy with some training options replaced (``None`` values are ignored)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        merged = {**dataclasses.asdict(self.train), **given}
        return dataclasses.replace(self, train=build_section(TrainConfig, merged, "train"))


def _config_file(path: Path) -> dict[str, Any]:
    """A ``--config`` file's mapping of sections (bounded, strict YAML)."""
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
    return data


def _name_in(data: dict[str, Any], key: str, path: Path) -> str | None:
    """The ``preset`` or ``recipe`` a config file names (taken out of its sections), or None."""
    value = data.pop(key, None)
    if value is not None and not isinstance(value, str):
        raise UsageError(f"config {path}: {key} must be a {key}'s name, got {shown(value)}")
    return value


def _leaves(config: dict[str, Any]) -> dict[str, Any]:
    return {
        f"{section}.{key}": value
        for section, values in config.items()
        if isinstance(values, dict)
        for key, value in values.items()
    }


def differing(config: RunConfig, other: RunConfig) -> list[str]:
    """The options (``section.key``) in which two configs differ."""
    mine, theirs = _leaves(config.to_dict()), _leaves(other.to_dict())
    return sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))


def closest_recipe(config: RunConfig) -> tuple[recipes.Recipe, list[str]]:
    """The recipe of the config's method it is closest to (``recipes.py``; a method no recipe names:
    its defaults alone) and the options that differ from it (a run of an earlier release records its
    options, not a recipe's name)."""
    found = [recipe for recipe in recipes.RECIPES if recipe.method == config.method]
    scored = [
        (recipe, differing(config, RunConfig._from_recipe(recipe, None)))
        for recipe in found or [recipes.recipe_for(config.method)]
    ]
    return min(scored, key=lambda item: len(item[1]))  # the first of equals wins


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
