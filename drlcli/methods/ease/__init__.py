"""``ease`` (SPEC §3): independent AdaptFormer adapters per stage (``network.py``, options in
``options.py``), one ViT pass per stage, no PTM subspace; trained with EASE's published recipe."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import UsageError
from ...options import TrainConfig
from ..base import Method, StageNetwork
from .options import EaseConfig

if TYPE_CHECKING:
    from torch import nn

    from ...config import RunConfig


def build(ptm: nn.Module, config: RunConfig) -> StageNetwork:
    from .network import EaseNetwork

    return EaseNetwork(ptm, config.ease)


def rules(config: RunConfig) -> None:
    if config.train.kd_weight:
        raise UsageError("train.kd_weight must be 0 for method ease (it has no PTM stream to distil from)")


METHOD = Method(
    name="ease",
    build=build,
    trains=True,
    offset=0,  # EASE's default use_init_ptm = false
    tensor_prefix="ease.",
    sections={"ease": EaseConfig},
    # the EASE paper / LAMDA-PILOT ease.json: CE through a cosine head whose scale starts at 1, no distillation
    train_defaults=TrainConfig(loss="ce", kd_weight=0.0, scale_init=1.0, lr=0.025, epochs=20, batch_size=48),
    rules=rules,
)
