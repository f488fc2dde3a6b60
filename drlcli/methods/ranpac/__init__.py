"""``ranpac``: the PTM's subspace alone, scored by the ridge head (``heads/ridge``: random
projection, ReLU, ridge regression from accumulated statistics); nothing trained."""

from __future__ import annotations

from ..base import Method
from ..drl import build_ipa

METHOD = Method(name="ranpac", build=build_ipa, trains=False, offset=1, tensor_prefix="", head="ridge")
