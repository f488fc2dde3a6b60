"""The ``first_session`` section of a run config: one AdaptFormer set inside the PTM, RanPAC's
first-session adaptation (``drl init --method ranpac --preset published``) or drl's default carried
schedule (``first_session/__init__.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from ...options import MAX_DIM, Range, option


@dataclass(frozen=True)
class FirstSessionConfig:
    """Stage 1 trains a PEFT module inside the PTM, which stays frozen afterwards (RanPAC phase 1)."""

    # none: the frozen PTM (RanPAC without its first phase) | adaptformer: x + MLP(LN(x)) + s·Up(ReLU(Down(x)))
    peft: str = option("none", choices=("none", "adaptformer"))
    adapter_dim: int = option(64, within=Range(1, MAX_DIM))  # r (RanPAC's ffn_num)
    scale: float = option(0.1, within=Range(0, 100))  # s
    # the leading share of the PTM's blocks that get adapters (at least one block): 1.0 is RanPAC's
    # every block; issue 32's research found the adaptation's gain in blocks 0-5 of 12 (0.5)
    blocks: float = option(1.0, within=Range(0, 1, low_open=True))
    # on the bottleneck, training only (as in the public RanPAC code)
    dropout: float = option(0.1, within=Range(0, 1, high_open=True))
    # drl's extension (issue 32), not RanPAC's: "all" trains the one adapter set again at every stage
    # (a carried run); "first" is RanPAC's, frozen after stage 1
    stages: str = option("first", choices=("first", "all"))
    # "all", from stage 2 on: the loss adds this times the mean relative squared move of the stage's
    # own images' read tokens (f_0 and the layout cells) from where the set put them when the stage began
    hold_weight: float = option(3.0, within=Range(0, 1e4))
    # drl's extension, not RanPAC's: train the adapters on the fit part of stage 1's images only, fit
    # the head on the fit part's frozen and adapted features, and keep the adapters only when the
    # held-out part (the ridge head's statistics split) scores higher with them
    decide: bool = False
    # drl's extension (issue 32), "all" only: "transfer" keeps the frozen default run beside the
    # carried one (the run's frozen track) and answers from the carried network only from the stage on
    # which the run's forward transfer (``metrics.Transfer``) says adapting tells new classes apart
    # better than the frozen PTM; "none" always answers from the carried network
    switch: str = option("none", choices=("none", "transfer"))
    # drl's extension (issue 32), with switch "transfer" only: "transfer" trains the carried network
    # at a stage only while the run's forward transfer so far could still reach the switch's floor
    # (``metrics.Transfer.stalls``); a paused stage fits the head on the network as it stands
    pause: str = option("none", choices=("none", "transfer"))
    # drl's extension, with pause "transfer" only: "transfer" tries adapting before a stage trains,
    # while no stage has trained the set, up to ``trial_stages`` stages (``stage/trial.py``): a copy of the set trained
    # ``trial_epochs`` on half of the stage's classes (at most ``trial_images`` images each), the
    # other half's margins compared through it and the frozen PTM; the stage trains only where they widen
    trial: str = option("none", choices=("none", "transfer"))
    trial_epochs: int = option(10, within=Range(1, 1000))
    trial_images: int = option(32, within=Range(1, 1_000_000))
    trial_stages: int = option(3, within=Range(1, 1_000_000))  # stages tried while the set never trained
