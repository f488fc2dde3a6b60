"""``drl`` (the default). Two networks over the frozen PTM, by config:

- the default, the ``switched`` preset (issue 32; ``methods/first_session``): one AdaptFormer set in
  the PTM's first six blocks, trained with cross-entropy at every stage and held near each stage's
  start, the earlier classes carried as class Gaussians by the ridge head; the frozen PTM's run is
  kept beside it (the run's frozen track) and answers until the run's forward transfer says adapting
  pays, and the set stops training where it no longer can (docs/research/adaptation-bounds.md at b4fbb16).
- the IPA network (``network.py``, the ``ipa`` section), one pass for every subspace, the PTM's
  subspace plus one per stage, each stage trained with DAS + distillation (``stage/train.py``).
  ``--preset frozen`` reads the PTM's subspace alone, so it trains nothing (``train.skip_unread``);
  ``--preset paper`` is the paper's recipe, every stage trained and scored by the prototype bank.

Scoring, chosen on validation splits (``docs/research/ptm-layout.md`` at b4fbb16 and the rounds before it): the
analytic ridge head on the (adapted or frozen) PTM subspace and the PTM's 2 x 2 layout, with class
covariances (``score.head: ridge``, ``heads/ridge``), which beat the paper's reweighted cosine to the
prototype bank on Caltech-101 and Caltech-101-Sketch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import UsageError
from ...heads import ridge
from .. import first_session
from ..base import Method, StageNetwork
from ..first_session import adapts
from .options import IPAConfig

if TYPE_CHECKING:
    from torch import nn

    from ...config import RunConfig

# class covariances of rank 16 (docs/research/covariance-rank.md at b4fbb16): flat in the classes, as accurate and
# λ searched from the stage before's over at most 128 classes (flat in the stages and classes:
# docs/performance.md, docs/research/lambda-search.md at b4fbb16)
RIDGE_DEFAULTS = {
    "covariance_weight": 4.0,
    "covariance_rank": 16,
    "layout_grid": 2,
    "layout_scale": 0.5,
    "lambda_search": "local",
    "lambda_classes": 128,
}

# the adapted set learns with cross-entropy and no distillation (there is no frozen PTM in its pass;
# the hold term keeps it near each stage's start): adaptation-bounds.md, fifth to eleventh rounds
_CE = {"loss": "ce", "kd_weight": 0.0}
CARRIED = {**first_session.CARRIED, "train": {**first_session.CARRIED["train"], **_CE}}
# ... and stage 1 trains only where a short trial says adapting pays on this data (``stage/trial.py``)
SWITCHED = {
    **first_session.SWITCHED,
    first_session.SECTION: {**first_session.SWITCHED[first_session.SECTION], "trial": "transfer"},
    "train": {**first_session.SWITCHED["train"], **_CE},
}


def build_ipa(ptm: nn.Module, config: RunConfig) -> StageNetwork:
    from .network import IPANetwork

    return IPANetwork(ptm, config.ipa)


def build(ptm: nn.Module, config: RunConfig) -> StageNetwork:
    return first_session.build(ptm, config) if adapts(config) else build_ipa(ptm, config)


def rules(config: RunConfig) -> None:
    first_session.rules(config, "drl")
    if adapts(config) and config.score.head != "ridge":
        raise UsageError(
            "score.head must be ridge for method drl adapting the PTM (first_session.peft); "
            "the prototype bank reads stage subspaces: use --preset paper"
        )


METHOD = Method(
    name="drl",
    build=build,
    trains=True,
    offset=1,
    tensor_prefix="ipa.",
    sections={"ipa": IPAConfig},
    rules=rules,
    defaults={
        "score": {"head": "ridge"},
        ridge.SECTION: RIDGE_DEFAULTS,
        "train": {"skip_unread": True},  # the frozen head reads no stage subspace: none is trained
    },
    presets={
        "switched": SWITCHED,
        "frozen": {},  # the frozen PTM read by the ridge head: nothing trained (the default before the switched one)
        "carried": CARRIED,  # the switched schedule without its frozen track: always the adapted PTM
        # the paper's §III-D scoring (SPEC §2.3), which reads every stage, each trained
        "paper": {"score": {"head": "prototypes"}, "train": {"skip_unread": False}},
    },
    default_preset="switched",
    trained_stages=lambda config: first_session.trained_stages(config) if adapts(config) else None,
    decides_first_stage=first_session.decides,
    carries_network=first_session.carries,
    switches=first_session.switches,
    pauses=first_session.pauses,
)
