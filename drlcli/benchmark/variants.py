"""Benchmark variants: ``recipe[/key=value...]`` or ``method[/key=value...]``, e.g. ``default``,
``frozen/lr=0.01``, ``ranpac-published``, ``ease/epochs=3``, ``drl/preset=paper`` (a recipe under its
method's name); keys are config fields (``train.lr``, or just ``lr`` when the name is unique across
sections; the section names of earlier releases read as today's). ``--rescore`` options are
score-section keys alone (``beta=0/rule=concat``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from ..config import RENAMED, RunConfig, config_sections, renamed_section
from ..errors import UsageError, shown
from ..methods import METHODS
from ..options import parse_value
from ..recipes import BY_NAME

SECTIONS = config_sections()


@dataclass(frozen=True)
class Variant:
    label: str
    method: str
    overrides: dict[str, dict[str, Any]]  # section -> field -> value
    preset: str | None = None  # a recipe under the method's name (``drl/preset=paper``)
    recipe: str | None = None  # named as a recipe (``frozen``): ``method`` is the one it is stored as

    def config(self, *, epochs: int | None, seed: int) -> RunConfig:
        sections = {name: dict(values) for name, values in self.overrides.items()}
        train = sections.setdefault("train", {})
        train.setdefault("seed", seed)
        if epochs is not None:
            train.setdefault("epochs", epochs)
        if self.recipe is not None:
            return RunConfig.for_recipe(self.recipe, sections)
        return RunConfig.for_method(self.method, sections, preset=self.preset)

    @property
    def dirname(self) -> str:
        return re.sub(r"[^A-Za-z0-9._=-]+", "_", self.label.replace("/", "__"))


def _holds(section: str, name: str) -> bool:
    return section in SECTIONS and name in {f.name for f in fields(SECTIONS[section])}


def _resolve_key(key: str) -> tuple[str, str]:
    if "." in key:
        section, name = key.split(".", 1)
        section = renamed_section(section, name) if section in RENAMED else section  # an earlier release's name
        if _holds(section, name):
            return section, name
        raise UsageError(f"unknown variant option {shown(key)}; use a config key such as train.lr or ipa.gate")
    owners = [s for s, cls in SECTIONS.items() if key in {f.name for f in fields(cls)}]
    if len(owners) == 1:
        return owners[0], key
    if not owners:
        raise UsageError(f"unknown variant option {shown(key)}; use a config key such as lr, loss, gate or rule")
    raise UsageError(f"variant option {shown(key)} is ambiguous; write it as one of {[f'{s}.{key}' for s in owners]}")


def parse_variant(text: str) -> Variant:
    """``method[/key=value...]`` -> Variant (values parsed as YAML scalars)."""
    parts = [p for p in text.strip().split("/") if p]
    if not parts:
        raise UsageError("empty --methods entry; use e.g. default,frozen,ease")
    method, overrides, preset = parts[0], {}, None
    recipe = parts[0] if parts[0] in BY_NAME and parts[0] not in METHODS else None
    if recipe is not None:
        method = BY_NAME[recipe].method
    for part in parts[1:]:
        if "=" not in part:
            raise UsageError(f"variant option {shown(part)} in {shown(text)} is not KEY=VALUE; use e.g. drl/loss=ce")
        key, raw = part.split("=", 1)
        if key == "preset":
            if recipe is not None:
                raise UsageError(f"{shown(text)}: {recipe} is a recipe; drop preset= or name its method")
            preset = raw
            continue
        section, name = _resolve_key(key)
        overrides.setdefault(section, {})[name] = parse_value(raw, f"--methods {method}/{key}")
    variant = Variant(text.strip(), method, overrides, preset, recipe)
    variant.config(epochs=None, seed=0)  # validate now, before any work
    return variant


def parse_methods(text: str) -> list[Variant]:
    variants = [parse_variant(item) for item in text.split(",") if item.strip()]
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise UsageError(f"--methods lists a variant twice: {labels}")
    if not variants:
        raise UsageError("--methods is empty; use e.g. drl,ease,simplecil")
    return variants


def parse_score(text: str) -> dict[str, Any]:
    """``key=value[/key=value]`` over the score section, e.g. ``beta=0/rule=concat``: prototype
    scoring of the run's bank, whatever head the run itself scores with (``score.head``)."""
    out = {}
    for part in [p for p in text.split("/") if p]:
        if "=" not in part:
            raise UsageError(f"--rescore {shown(text)}: {shown(part)} is not KEY=VALUE; use e.g. beta=0 or rule=concat")
        key, raw = part.split("=", 1)
        section, name = _resolve_key(key if "." in key else f"score.{key}")
        if section != "score":
            raise UsageError(f"--rescore takes score options (rule, rho, beta, tau), not {shown(key)}")
        if name == "head":  # a ridge head is fitted at learn time; rescoring re-scores the prototype bank
            raise UsageError("--rescore re-scores the prototype bank (rule, rho, beta, tau); head is chosen at init")
        out[name] = parse_value(raw, f"--rescore {key}")
    RunConfig.for_method("drl", {"score": out})  # validate the values now
    return out
