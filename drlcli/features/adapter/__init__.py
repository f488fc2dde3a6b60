"""One AdaptFormer set inside the PTM (the ``adapter`` section of a run config): RanPAC's
first-session adaptation (recipe ``ranpac-published``: trained in stage 1, frozen afterwards) and the
network of drl's default, which trains the same set again at every stage (``schedule``: carried).

``network.py`` holds the module; this module holds the section and the builder, and imports no torch.
Runs of earlier releases named this section and the schedule's together ``first_session``
(``config.py`` reads them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...options import MAX_DIM, Range, option

if TYPE_CHECKING:
    from torch import nn

    from ...config import RunConfig
    from .. import StageNetwork

SECTION = "adapter"


@dataclass(frozen=True)
class AdapterConfig:
    """A PEFT module inside the PTM, read by the ridge head: x + MLP(LN(x)) + s·Up(ReLU(Down(x)))."""

    # none: the frozen PTM (RanPAC without its first phase) | adaptformer: the adapter set
    peft: str = option("none", choices=("none", "adaptformer"))
    adapter_dim: int = option(64, within=Range(1, MAX_DIM))  # r (RanPAC's ffn_num)
    scale: float = option(0.1, within=Range(0, 100))  # s
    # the leading share of the PTM's blocks that get adapters (at least one block): 1.0 is RanPAC's
    # every block; the default's adaptation gains sit in blocks 0-5 of 12 (0.5)
    blocks: float = option(1.0, within=Range(0, 1, low_open=True))
    # on the bottleneck, training only (as in the public RanPAC code)
    dropout: float = option(0.1, within=Range(0, 1, high_open=True))


def adapts(config: RunConfig) -> bool:
    """Whether the run adapts the PTM (``adapter.peft``)."""
    return config.adapter.peft != "none"


def check_tokens(ptm: nn.Module, config: RunConfig) -> None:
    """Refuse, before a run is made, a share of tokens (``train.keep_tokens``) the PTM's grid cannot keep."""
    if adapts(config) and config.train.keep_tokens < 1:
        from .network import token_cells

        token_cells(ptm, config.ridge.layout_grid, config.train.keep_tokens)


def build(ptm: nn.Module, config: RunConfig) -> StageNetwork:
    """The adapted PTM's network (no adapter yet; stage 1 makes the set)."""
    from .network import AdapterNetwork

    return AdapterNetwork(
        ptm,
        config.adapter,
        carried=config.schedule.stages == "all",
        hold_weight=config.schedule.hold_weight,
        hold_share=config.schedule.hold_share,
        read_grid=config.ridge.layout_grid,
        keep_tokens=config.train.keep_tokens,
    )
