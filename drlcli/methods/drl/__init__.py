"""``drl`` (the default): the IPA network (``network.py``), one pass for every subspace, the PTM's
subspace plus one per stage, each stage trained with DAS + distillation (``stage/train.py``); its
options are the ``ipa`` section (``options.py``).

Scoring, chosen on validation splits (``docs/research/ptm-layout.md`` and the rounds before it): a new run is scored by the analytic
ridge head on the PTM subspace and the PTM's 2 x 2 layout, with class covariances (``score.head:
ridge``, ``heads/ridge``), which beat the paper's reweighted cosine to the prototype bank on
Caltech-101 and Caltech-101-Sketch. That head reads no stage subspace, so a new run creates each
stage but does not train it (``train.skip_unread``; false trains them). The paper's recipe is the
``paper`` preset (``drl init --preset paper``): every stage trained and scored."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...heads import ridge
from ..base import Method, StageNetwork
from .options import IPAConfig

if TYPE_CHECKING:
    from torch import nn

    from ...config import RunConfig


def build_ipa(ptm: nn.Module, config: RunConfig) -> StageNetwork:
    from .network import IPANetwork

    return IPANetwork(ptm, config.ipa)


METHOD = Method(
    name="drl",
    build=build_ipa,
    trains=True,
    offset=1,
    tensor_prefix="ipa.",
    sections={"ipa": IPAConfig},
    defaults={
        "score": {"head": "ridge"},
        # class covariances of rank 16 (docs/research/covariance-rank.md): flat in the classes, as accurate
        # and λ searched from the stage before's (flat in the stages: docs/performance.md)
        ridge.SECTION: {
            "covariance_weight": 4.0,
            "covariance_rank": 16,
            "layout_grid": 2,
            "layout_scale": 0.5,
            "lambda_search": "local",
            "lambda_classes": 128,  # and over at most 128 classes (flat in the classes: docs/research/lambda-search.md)
        },
        "train": {"skip_unread": True},  # the head reads no stage subspace: none is trained
    },
    # the paper's §III-D scoring (SPEC §2.3), which reads every stage, each trained
    presets={"paper": {"score": {"head": "prototypes"}, "train": {"skip_unread": False}}},
)
