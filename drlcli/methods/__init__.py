"""The methods drl offers (SPEC §3, ``--method``): one folder each, registered here.

- ``drl/``: the IPA network, one pass for every subspace, PTM subspace + one per stage.
- ``simplecil/``: the PTM's subspace alone, nothing trained.
- ``ease/``: independent adapters per stage, one ViT pass per stage, no PTM subspace.
- ``ranpac/``: the PTM's subspace scored by the ridge head (``heads/ridge``), nothing trained.

To add a method: write ``methods/<name>/__init__.py`` defining ``METHOD = Method(...)`` (``base.py``
says what each field means; its network follows the ``StageNetwork`` protocol, its options are a
section dataclass named in ``Method.sections``) and add it to the ``METHODS`` line below. Nothing
else names methods: the CLI's ``--method`` choices, the config's sections, defaults and validation,
learn-stage, loading, export and forget all read this registry.

This module and the method folders' ``__init__`` import no torch: ``drl --help`` lists the
registry's names without loading it. Networks are imported when first built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import UsageError, shown
from ..heads import HEADS, Head
from . import drl, ease, ranpac, simplecil
from .base import Method, StageNetwork

if TYPE_CHECKING:
    from ..config import RunConfig

# the order is the CLI's (--help, shell completion)
METHODS: dict[str, Method] = {m.name: m for m in (drl.METHOD, simplecil.METHOD, ease.METHOD, ranpac.METHOD)}


def get_method(name: str) -> Method:
    """The method called ``name``; ``UsageError`` naming the choices for any other name."""
    method = METHODS.get(name) if isinstance(name, str) else None
    if method is None:
        raise UsageError(f"unknown method {shown(name)}; choose one of {list(METHODS)}")
    return method


def method_of(config: RunConfig) -> Method:
    return METHODS[config.method]


def sections() -> dict[str, type]:
    """Every method's own option sections, in registry order (every run config holds them all)."""
    return {name: cls for method in METHODS.values() for name, cls in method.sections.items()}


def head_of(config: RunConfig) -> Head | None:
    """The analytic head that scores this run, or None (the prototype bank scores): the method's own
    (an analytic method's), or the one ``score.head`` asks for (drl's default: ridge)."""
    name = method_of(config).head or (config.score.head if config.score.head != "prototypes" else None)
    return HEADS[name] if name is not None else None


def stages_read(config: RunConfig) -> int | None:
    """How many leading stage subspaces the run's answers read: None (all) under the prototype bank;
    under an analytic head its own count (none for drl's default head, whose answers and "unknown"
    answer read the PTM alone)."""
    head = head_of(config)
    return None if head is None else head.stages_read(config)


def stage_is_read(config: RunConfig, index: int) -> bool:
    """Whether anything the run answers reads stage ``index``'s subspace (``stages_read``)."""
    read = stages_read(config)
    return read is None or index <= read


__all__ = [
    "METHODS",
    "Method",
    "StageNetwork",
    "get_method",
    "head_of",
    "method_of",
    "sections",
    "stage_is_read",
    "stages_read",
]
