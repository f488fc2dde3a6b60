"""What a method is: the facts in which methods differ, and the interfaces their parts share.

A ``Method`` names its stage network (``build``), whether learn-stage trains a new stage, whether
subspace 0 is the PTM's (``offset``), the prefix of its stage tensors, its option sections, its
training defaults, its config rules and, for an analytic method, its head (``heads/``). Everything
else (data, prototypes, the training loop, evaluation, run directory, export) is shared and reads
these facts.

This module and the method modules import no torch at run time: ``drl --help`` lists the
registry's names without loading it. Networks and heads are imported when first built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..options import TrainConfig

if TYPE_CHECKING:
    from torch import Tensor, nn

    from ..config import RunConfig


@runtime_checkable
class StageNetwork(Protocol):
    """A method's network: the frozen PTM and one trainable module per learned stage
    (``ipa.IPANetwork``, ``ease.EaseNetwork``); an ``nn.Module``, so ``network(images)`` is ``forward``.

    Each stage module has ``num_params()``. Stages are appended by ``new_stage`` and frozen by
    the caller once trained (or loaded); a stage's state dict is what a run stores under the
    method's ``tensor_prefix``.
    """

    ptm: nn.Module  # frozen
    width: int  # d
    stages: nn.ModuleList

    @property
    def num_stages(self) -> int: ...

    @property
    def num_subspaces(self) -> int:
        """S, the width of ``forward``'s subspace axis: the method's offset + num_stages."""
        ...

    def new_stage(self, *, seed: int) -> nn.Module:
        """Append a freshly initialised stage (seeded, on the PTM's device) and return it (a network that
        carries one stage, ``Method.carries_network``, reopens that one instead)."""
        ...

    def forward(
        self, images: Tensor, stages: int | None = None, layout: int = 0, probes: tuple[int, ...] = ()
    ) -> Tensor:
        """Every subspace's feature: (B, 3, H, W) -> (B, S, d); with ``stages`` k, only the subspaces
        of the PTM (when the method has one) and of the first k stages, the others not computed;
        with ``layout`` g > 0, g² rows of the PTM's layout after them (``backbone.ptm_layout``);
        with ``probes``, the class token after each of those PTM blocks last (``backbone.ptm_probe``;
        layout and probes: methods with a PTM subspace only)."""
        ...

    def forward_train(self, images: Tensor) -> tuple[Tensor, ...]:
        """(PTM feature (B, d) or None, newest stage's feature (B, d), *loss terms of the network's own),
        gradients for the newest stage only."""
        ...


def _no_rules(config: RunConfig) -> None:
    return None


@dataclass(frozen=True)
class Method:
    """The facts of one method; see ``methods/__init__.py`` for the registry."""

    name: str
    build: Callable[[nn.Module, RunConfig], StageNetwork]  # the network over a frozen PTM, no stage yet
    trains: bool  # learn-stage trains a new stage and stores its parameters
    offset: int  # 1: subspace 0 is the PTM's; 0: only stage subspaces (see heads/prototypes.py)
    tensor_prefix: str  # prefix of the method's tensors in a stage's weights file
    # its own option sections of a run config: {section: dataclass} (every config holds every method's)
    sections: Mapping[str, type] = field(default_factory=dict)
    train_defaults: TrainConfig = field(default_factory=TrainConfig)  # the train section of a new run
    rules: Callable[[RunConfig], None] = _no_rules  # UsageError if a config of this method breaks one
    head: str | None = None  # the analytic head it always scores with (``heads.HEADS``); None: score.head's
    # other sections of a new run that differ from the dataclass defaults: {section: {key: value}}
    defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # named recipes over ``defaults`` (``init --preset``, ``benchmark`` variant ``preset=``)
    presets: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)
    # the preset a new run gets when none is named (None: ``defaults`` alone); naming another replaces it
    default_preset: str | None = None
    # how many leading stages it trains at most, by config (None: every stage whose subspace is read;
    # a method that adapts the PTM in its first session: 1, else 0); the others get no stage network
    trained_stages: Callable[[RunConfig], int | None] = lambda config: None
    # whether stage 1's network is trained on part of its images and kept only if the head scores
    # the held-out part higher with it (``stage/first_session.py``)
    decides_first_stage: Callable[[RunConfig], bool] = lambda config: False
    # one stage network, made in stage 1 and trained again at every stage, the newest stage's totals
    # holding it; the head carries the earlier classes (``heads/ridge/carry.py``): a carried run
    carries_network: Callable[[RunConfig], bool] = lambda config: False
    # a carried run that also keeps the frozen default's run beside it (its frozen track,
    # ``run/track.py``) and answers from the track the stage's forward transfer picks
    switches: Callable[[RunConfig], bool] = lambda config: False
    # a switched run whose carried network trains a stage only while the run's forward transfer so far,
    # the stage's own included, could still reach the floor (``stage.context.Began``)
    pauses: Callable[[RunConfig], bool] = lambda config: False
