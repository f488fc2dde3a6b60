"""``ranpac``: the PTM's subspace scored by the ridge head (``heads/ridge``: random projection,
ReLU, ridge regression from accumulated statistics). By default nothing is trained (RanPAC
without its first phase). With ``first_session.peft adaptformer`` (the ``published`` preset,
RanPAC as McDonnell et al. published it) stage 1 first trains AdaptFormer adapters inside the PTM
with cross-entropy (``methods/first_session``; RanPAC's recipe: 20 epochs, SGD lr 0.01, batch 48), frozen
afterwards; every feature the head reads comes from that adapted PTM."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import UsageError
from ...options import TrainConfig
from .. import first_session
from ..base import Method, StageNetwork
from ..drl import RIDGE_DEFAULTS, build_ipa
from ..first_session import FirstSessionConfig, adapts, carries

if TYPE_CHECKING:
    from torch import nn

    from ...config import RunConfig


def build(ptm: nn.Module, config: RunConfig) -> StageNetwork:
    # without adaptation: the bare PTM pass, an IPA network that never gets a stage
    return first_session.build(ptm, config) if adapts(config) else build_ipa(ptm, config)


def rules(config: RunConfig) -> None:
    if config.ranpac.subspaces != 1:
        raise UsageError("ranpac.subspaces must be 1 for method ranpac (its head reads the PTM's subspace)")
    first_session.rules(config, "ranpac")


# drl's default schedule under RanPAC's name (drl's own ridge options) as it was measured, before its
# carried sums changed (``first_session.CARRY_SUMS``): kept so that the commands docs/benchmarks.md ran
# as ``ranpac/preset=carried`` and ``ranpac/preset=switched`` reproduce
CARRIED = {**first_session.CARRIED, "ranpac": RIDGE_DEFAULTS}

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
    presets={
        "published": {"first_session": {"peft": "adaptformer"}},
        "carried": CARRIED,
        "switched": {**first_session.SWITCHED, "ranpac": RIDGE_DEFAULTS},  # drl's default
    },
    trained_stages=lambda config: first_session.trained_stages(config) if adapts(config) else 0,
    decides_first_stage=first_session.decides,
    carries_network=carries,
    switches=first_session.switches,
    pauses=first_session.pauses,
)
