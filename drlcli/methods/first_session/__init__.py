"""One AdaptFormer set inside the PTM, read by the ridge head (the ``first_session`` section):
RanPAC's first-session adaptation (``ranpac --preset published``: stage 1 only, frozen afterwards)
and drl's default, the switched carried schedule (issue 32; docs/research/adaptation-bounds.md at b4fbb16):
the set trained again at every stage and held near each stage's start, the earlier classes carried
as class Gaussians, the frozen default kept beside it as the run's frozen track and answering until
the run's forward transfer says adapting pays, the set's training paused where it no longer can.

Not a method of its own: ``drl`` and ``ranpac`` build its network (``network.py``) and share its
predicates and rules here; this module imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import UsageError
from .options import FirstSessionConfig

if TYPE_CHECKING:
    from torch import nn

    from ...config import RunConfig
    from ..base import StageNetwork

SECTION = "first_session"

# the earlier classes' sums rebuilt from their Gaussians with E[φ] in closed form and the Grams
# centred on it, 25 draws an image and the Grams' M x M products from at most 50,000 of them (twentieth
# round: as accurate as 100 uncentred draws an image on three orders, a quarter to a third of the time,
# and the Grams' cost flat in the images seen), each class's rows split between the fit and held-out
# Grams (twenty-first round: 0.16 A_T higher on three orders, no M x M pass a class); ranpac's presets
# keep the carry they were measured with
CARRY_SUMS = {"carry_mean": "exact", "carry_draws": 25, "carry_gram_draws": 50_000, "carry_grams": "split"}
# issue 32's carried schedule (adaptation-bounds.md, eleventh round): one set in blocks 0-5 trained at
# every stage, 20 epochs of cross-entropy at lr 0.05, held near each stage's start (w 3); the head's
# other options are the method's (drl's default ridge head)
CARRIED = {
    SECTION: {"peft": "adaptformer", "stages": "all", "blocks": 0.5, "hold_weight": 3.0},
    "train": {"lr": 0.05, "epochs": 20, "batch_size": 48, "scale_init": 16.0},
    "ranpac": CARRY_SUMS,
}
# ... answering from the frozen default (the run's frozen track) until the run's forward transfer
# says adapting pays (fourteenth round), the set trained only while it could (sixteenth round)
SWITCHED = {**CARRIED, SECTION: {**CARRIED[SECTION], "switch": "transfer", "pause": "transfer"}}


def adapts(config: RunConfig) -> bool:
    """Whether the run adapts the PTM (``first_session.peft``)."""
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


def trained_stages(config: RunConfig) -> int | None:
    """``Method.trained_stages`` of an adapting run: every stage when carried, else stage 1 only."""
    return None if carries(config) else 1


def decides(config: RunConfig) -> bool:
    """``Method.decides_first_stage``: stage 1 keeps its adapters only where they score higher."""
    return adapts(config) and config.first_session.decide


def build(ptm: nn.Module, config: RunConfig) -> StageNetwork:
    """The adapted PTM's network (no adapter yet; stage 1 makes the set)."""
    from .network import FirstSessionNetwork

    return FirstSessionNetwork(ptm, config.first_session, read_grid=config.ranpac.layout_grid)


def rules(config: RunConfig, method: str) -> None:
    """The section's own rules, and those of adapting a PTM that the ridge head reads alone."""
    options = config.first_session
    if options.stages == "all":
        if not adapts(config):
            raise UsageError("first_session.stages all trains the adapters: set first_session.peft adaptformer")
        if options.decide:
            raise UsageError("first_session.decide is for stages first: a carried run (stages all) keeps its adapters")
    elif options.switch != "none":
        raise UsageError(
            "first_session.switch picks between a carried run and the frozen PTM: set first_session.stages all"
        )
    if options.trial != "none" and options.pause != "transfer":
        raise UsageError("first_session.trial decides whether stage 1 trains: set first_session.pause transfer")
    if options.pause != "none" and options.switch != "transfer":
        raise UsageError(
            "first_session.pause stops training a network the frozen track answers for: set first_session.switch transfer"
        )
    if not adapts(config):
        return
    if config.ranpac.subspaces != 1:
        raise UsageError(
            f"ranpac.subspaces must be 1 for method {method} adapting the PTM (its head reads the adapted PTM's "
            "subspace); set first_session.peft none to read stage subspaces"
        )
    if config.train.kd_weight:
        raise UsageError(
            f"train.kd_weight must be 0 for method {method} adapting the PTM (there is no frozen PTM to distil to)"
        )


__all__ = [
    "CARRIED",
    "CARRY_SUMS",
    "SECTION",
    "SWITCHED",
    "FirstSessionConfig",
    "adapts",
    "build",
    "carries",
    "decides",
    "pauses",
    "rules",
    "switches",
    "trained_stages",
]
