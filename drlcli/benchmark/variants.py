"""Benchmark variants: ``method[/key=value...]``, e.g. ``drl/loss=ce``, ``drl/gate=sum``,
``ease/epochs=3``, ``drl/preset=paper`` (a method's named recipe); keys are config fields (``train.lr`` or just ``lr`` when the name is unique
across sections). ``--rescore`` options are score-section keys alone (``beta=0/rule=concat``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from ..config import RunConfig, config_sections
from ..errors import UsageError, shown
from ..options import parse_value

SECTIONS = config_sections()


@dataclass(frozen=True)
class Variant:
    label: str
    method: str
    overrides: dict[str, dict[str, Any]]  # section -> field -> value
    preset: str | None = None  # a named recipe of the method (``drl/preset=paper``)

    def config(self, *, epochs: int | None, seed: int) -> RunConfig:
        sections = {name: dict(values) for name, values in self.overrides.items()}
        train = sections.setdefault("train", {})
        train.setdefault("seed", seed)
        if epochs is not None:
            train.setdefault("epochs", epochs)
        return RunConfig.for_method(self.method, sections, preset=self.preset)

    @property
    def dirname(self) -> str:
        return re.sub(r"[^A-Za-z0-9._=-]+", "_", self.label.replace("/", "__"))


def _resolve_key(key: str) -> tuple[str, str]:
    if "." in key:
        section, name = key.split(".", 1)
        if section in SECTIONS and name in {f.name for f in fields(SECTIONS[section])}:
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
        raise UsageError("empty --methods entry; use e.g. drl,ease,simplecil")
    method, overrides, preset = parts[0], {}, None
    for part in parts[1:]:
        if "=" not in part:
            raise UsageError(f"variant option {shown(part)} in {shown(text)} is not KEY=VALUE; use e.g. drl/loss=ce")
        key, raw = part.split("=", 1)
        if key == "preset":
            preset = raw
            continue
        section, name = _resolve_key(key)
        overrides.setdefault(section, {})[name] = parse_value(raw, f"--methods {method}/{key}")
    variant = Variant(text.strip(), method, overrides, preset)
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
