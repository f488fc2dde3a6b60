"""The methods drl offers (SPEC §3, ``--method``): one module each, registered here.

- ``drl`` (``drl.py``): the IPA network, one pass for every subspace, PTM subspace + one per stage.
- ``simplecil`` (``simplecil.py``): the PTM's subspace alone, nothing trained.
- ``ease`` (``ease.py``): independent adapters per stage, one ViT pass per stage, no PTM subspace.
- ``ranpac`` (``ranpac.py``): the PTM's subspace scored by an analytic head, nothing trained.

To add a method: write ``methods/<name>.py`` defining ``METHOD = Method(...)`` (``base.py`` says
what each field means; its network follows the ``StageNetwork`` protocol) and add it to the
``METHODS`` line below. Nothing else names methods: the CLI's ``--method`` choices, the config's
defaults and validation, learn-stage, loading and export all read this registry.
"""

from __future__ import annotations

from ..config import RunConfig
from ..errors import UsageError
from . import drl, ease, ranpac, simplecil
from .base import AnalyticHead, HeadFit, Method, StageNetwork

# the order is the CLI's (--help, shell completion)
METHODS: dict[str, Method] = {m.name: m for m in (drl.METHOD, simplecil.METHOD, ease.METHOD, ranpac.METHOD)}


def get_method(name: str) -> Method:
    """The method called ``name``; ``UsageError`` naming the choices for any other name."""
    method = METHODS.get(name) if isinstance(name, str) else None
    if method is None:
        raise UsageError(f"unknown method {name!r}; choose one of {list(METHODS)}")
    return method


def method_of(config: RunConfig) -> Method:
    return METHODS[config.method]


def analytic_head(config: RunConfig) -> AnalyticHead | None:
    """The head fitted from statistics that scores this run, or None (the prototype bank scores):
    the method's own (ranpac), or the ridge head when ``score.head`` asks for it (drl)."""
    head = method_of(config).head
    if head is None and config.score.head == "ridge":
        head = ranpac.load_head()
    return head


def stages_read(config: RunConfig) -> int | None:
    """How many leading stage subspaces the run's answers read: None (all) under the prototype bank;
    under an analytic head its own (``ranpac.subspaces`` - 1: none for drl's default head, whose
    answers and "unknown" answer read the PTM alone)."""
    return None if analytic_head(config) is None else config.ranpac.subspaces - 1


def stage_is_read(config: RunConfig, index: int) -> bool:
    """Whether anything the run answers reads stage ``index``'s subspace (``stages_read``)."""
    read = stages_read(config)
    return read is None or index <= read


__all__ = [
    "METHODS",
    "AnalyticHead",
    "HeadFit",
    "Method",
    "StageNetwork",
    "analytic_head",
    "get_method",
    "method_of",
    "stage_is_read",
    "stages_read",
]
