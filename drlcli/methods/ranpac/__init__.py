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


def carries(config: RunConfig) -> bool:
    """Whether the one adapter set learns at every stage (``first_session.stages all``): a carried run."""
    return adapts(config) and config.first_session.stages == "all"


def switches(config: RunConfig) -> bool:
    """Whether a carried run keeps the frozen default beside it and answers from the track its
    forward transfer picks (``first_session.switch transfer``)."""
    return carries(config) and config.first_session.switch == "transfer"


def pauses(config: RunConfig) -> bool:
    """Whether a switched run trains its carried network only while the forward transfer could still
    pay (``first_session.pause transfer``)."""
    return switches(config) and config.first_session.pause == "transfer"


def build(ptm: nn.Module, config: RunConfig) -> StageNetwork:
    if not adapts(config):
        return build_ipa(ptm, config)  # the bare PTM pass: an IPA network that never gets a stage
    from .network import FirstSessionNetwork

    return FirstSessionNetwork(ptm, config.first_session, read_grid=config.ranpac.layout_grid)


def rules(config: RunConfig) -> None:
    if config.ranpac.subspaces != 1:
        raise UsageError("ranpac.subspaces must be 1 for method ranpac (its head reads the PTM's subspace)")
    if config.first_session.stages == "all":
        if not adapts(config):
            raise UsageError("first_session.stages all trains the adapters: set first_session.peft adaptformer")
        if config.first_session.decide:
            raise UsageError("first_session.decide is for stages first: a carried run (stages all) keeps its adapters")
    elif config.first_session.switch != "none":
        raise UsageError(
            "first_session.switch picks between a carried run and the frozen PTM: set first_session.stages all"
        )
    if config.first_session.pause != "none" and config.first_session.switch != "transfer":
        raise UsageError(
            "first_session.pause stops training a network the frozen track answers for: set first_session.switch transfer"
        )
    if adapts(config) and config.train.kd_weight:
        raise UsageError(
            "train.kd_weight must be 0 for method ranpac (the first session has no frozen PTM to distil to)"
        )


# issue 32's carried schedule (docs/research/adaptation-bounds.md, eleventh round): one set in blocks
# 0-5 trained at every stage, 20 epochs at lr 0.05, held near each stage's start (w 3), the earlier
# classes carried as class Gaussians, read by drl's default head
CARRIED = {
    "first_session": {"peft": "adaptformer", "stages": "all", "blocks": 0.5, "hold_weight": 3.0},
    "ranpac": {
        "covariance_weight": 4.0,
        "covariance_rank": 16,
        "layout_grid": 2,
        "layout_scale": 0.5,
        "lambda_search": "local",
        "lambda_classes": 128,
    },
    "train": {"lr": 0.05, "epochs": 20, "batch_size": 48, "scale_init": 16.0},
}

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
        # the carried schedule, answering from the frozen default (the run's frozen track) until the
        # run's forward transfer says adapting pays (adaptation-bounds.md, fourteenth round), the carried
        # network trained only while it could (sixteenth round)
        "switched": {
            **CARRIED,
            "first_session": {**CARRIED["first_session"], "switch": "transfer", "pause": "transfer"},
        },
    },
    trained_stages=lambda config: None if carries(config) else 1 if adapts(config) else 0,
    decides_first_stage=lambda config: adapts(config) and config.first_session.decide,
    carries_network=carries,
    switches=switches,
    pauses=pauses,
)
