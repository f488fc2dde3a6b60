"""``ranpac``: the PTM's subspace scored by the ridge head (``heads/ridge``: random projection,
ReLU, ridge regression from accumulated statistics). By default nothing is trained (RanPAC
without its first phase). With ``first_session.peft adaptformer`` (the ``published`` preset,
RanPAC as McDonnell et al. published it) stage 1 first trains AdaptFormer adapters inside the PTM
with cross-entropy (``network.py``; RanPAC's recipe: 20 epochs, SGD lr 0.01, batch 48), frozen
afterwards; every feature the head reads comes from that adapted PTM."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import UsageError
from ...options import TrainConfig
from ..base import Method, StageNetwork
from ..drl import build_ipa
from .options import FirstSessionConfig

if TYPE_CHECKING:
    from torch import nn

    from ...config import RunConfig


def adapts(config: RunConfig) -> bool:
    """Whether stage 1 adapts the PTM (``first_session.peft``)."""
    return config.first_session.peft != "none"


def build(ptm: nn.Module, config: RunConfig) -> StageNetwork:
    if not adapts(config):
        return build_ipa(ptm, config)  # the bare PTM pass: an IPA network that never gets a stage
    from .network import FirstSessionNetwork

    return FirstSessionNetwork(ptm, config.first_session, read_grid=config.ranpac.layout_grid)


def rules(config: RunConfig) -> None:
    if config.ranpac.subspaces != 1:
        raise UsageError("ranpac.subspaces must be 1 for method ranpac (its head reads the PTM's subspace)")
    if config.first_session.stages == "all":  # the network and its hold term are here; learn-stage's carry is not yet
        raise UsageError(
            "first_session.stages all is not available yet (a carried run needs learn-stage's carry, "
            "docs/research/carried-preset-plan.md): use first"
        )
    if adapts(config) and config.train.kd_weight:
        raise UsageError(
            "train.kd_weight must be 0 for method ranpac (the first session has no frozen PTM to distil to)"
        )


METHOD = Method(
    name="ranpac",
    build=build,
    trains=True,  # stage 1 only, and only with a first session (trained_stages)
    offset=1,
    tensor_prefix="adapt.",
    sections={"first_session": FirstSessionConfig},
    # RanPAC's first session (its public code, after LAMDA-PILOT): CE through a cosine head whose
    # scale starts at 1, SGD lr 0.01, momentum 0.9, weight decay 5e-4, cosine schedule, 20 epochs, batch 48
    train_defaults=TrainConfig(loss="ce", kd_weight=0.0, scale_init=1.0, lr=0.01, epochs=20, batch_size=48),
    rules=rules,
    head="ridge",
    presets={"published": {"first_session": {"peft": "adaptformer"}}},
    trained_stages=lambda config: 1 if adapts(config) else 0,
    decides_first_stage=lambda config: adapts(config) and config.first_session.decide,
)
