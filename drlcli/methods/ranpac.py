"""``ranpac``: the PTM's subspace alone, scored by an analytic head (``drlcli/ranpac.py``: random
projection, ReLU, ridge regression from accumulated statistics); nothing trained."""

from __future__ import annotations

from ..config import RunConfig
from ..errors import UsageError
from .base import AnalyticHead, Method
from .drl import build_ipa

TENSOR_PREFIX = "ranpac."  # the head's tensors in a stage's weights file


def section_rules(config: RunConfig) -> None:
    if config.ranpac.lambda_min_exp > config.ranpac.lambda_max_exp:
        raise UsageError("ranpac.lambda_min_exp must be <= ranpac.lambda_max_exp")


def load_head() -> AnalyticHead:
    from .. import ranpac

    return ranpac  # the module: fit_stage, from_stages, from_state


METHOD = Method(
    name="ranpac",
    build=build_ipa,
    trains=False,
    offset=1,
    tensor_prefix=TENSOR_PREFIX,
    section_rules=section_rules,
    load_head=load_head,
)
