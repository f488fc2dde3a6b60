"""``simplecil``: the frozen PTM's subspace alone (an IPA network that never gets a stage),
class-mean prototypes, cosine nearest mean; nothing trained."""

from __future__ import annotations

from ..base import Method
from ..drl import build_ipa

METHOD = Method(name="simplecil", build=build_ipa, trains=False, offset=1, tensor_prefix="")
