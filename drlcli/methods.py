"""What differs between methods, in one table; everything else (data, prototypes, training loop,
evaluation, run directory, export) is shared.

- ``drl``: the IPA network (``ipa.py``), one pass for every subspace, PTM subspace + one per stage.
- ``ease``: independent adapters per stage (``ease.py``), one ViT pass per stage, no PTM subspace.
- ``simplecil``: the PTM's subspace alone, nothing trained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

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


METHOD_TABLE = {
    "drl": Method("drl", True, 1, "ipa.", lambda ptm, cfg: IPANetwork(ptm, cfg.ipa)),
    "ease": Method("ease", True, 0, "ease.", lambda ptm, cfg: EaseNetwork(ptm, cfg.ease)),
    "simplecil": Method("simplecil", False, 1, "", lambda ptm, cfg: IPANetwork(ptm, cfg.ipa)),
}


def method_of(config: RunConfig) -> Method:
    return METHOD_TABLE[config.method]
