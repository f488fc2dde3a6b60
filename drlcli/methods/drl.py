"""``drl`` (the default): the IPA network (``ipa.py``), one pass for every subspace, the PTM's
subspace plus one per stage, each stage trained with DAS + distillation (``train.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Method, StageNetwork

if TYPE_CHECKING:
    from torch import nn

    from ..config import RunConfig


def build_ipa(ptm: nn.Module, config: RunConfig) -> StageNetwork:
    from ..ipa import IPANetwork

    return IPANetwork(ptm, config.ipa)


METHOD = Method(name="drl", build=build_ipa, trains=True, offset=1, tensor_prefix="ipa.")
