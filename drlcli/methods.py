"""What differs between methods, in one table; everything else (data, prototypes, training loop,
evaluation, run directory, export) is shared.

- ``drl``: the IPA network (``ipa.py``), one pass for every subspace, PTM subspace + one per stage.
- ``ease``: independent adapters per stage (``ease.py``), one ViT pass per stage, no PTM subspace.
- ``simplecil``: the PTM's subspace alone, nothing trained.
- ``ranpac``: the PTM's subspace alone, scored by an analytic head (``ranpac.py``: random
  projection, ReLU, ridge regression from accumulated statistics), nothing trained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from torch import nn

from . import ranpac
from .config import RunConfig
from .ease import EaseNetwork
from .ipa import IPANetwork


@dataclass(frozen=True)
class Method:
    name: str
    trains: bool  # learn-stage trains new stage parameters
    offset: int  # 1: subspace 0 is the PTM's; 0: only stage subspaces (see prototypes.py)
    tensor_prefix: str  # prefix of the stage parameters in a stage's weights file
    build: Callable[[nn.Module, RunConfig], nn.Module]
    # a head fitted from statistics instead of prototypes: a module with fit_stage (learn-stage),
    # from_stages (load a run) and from_state (load an export)
    head: ModuleType | None = None


METHOD_TABLE = {
    "drl": Method("drl", True, 1, "ipa.", lambda ptm, cfg: IPANetwork(ptm, cfg.ipa)),
    "ease": Method("ease", True, 0, "ease.", lambda ptm, cfg: EaseNetwork(ptm, cfg.ease)),
    "simplecil": Method("simplecil", False, 1, "", lambda ptm, cfg: IPANetwork(ptm, cfg.ipa)),
    "ranpac": Method("ranpac", False, 1, ranpac.PREFIX, lambda ptm, cfg: IPANetwork(ptm, cfg.ipa), head=ranpac),
}


def method_of(config: RunConfig) -> Method:
    return METHOD_TABLE[config.method]


def analytic_head(config: RunConfig) -> ModuleType | None:
    """The module of the head fitted from statistics that scores this run, or None (prototypes):
    ranpac's always, drl's when ``score.head`` is ridge."""
    method = method_of(config)
    if method.head is None and config.score.head == "ridge":
        return ranpac
    return method.head
