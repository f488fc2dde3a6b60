"""What a method is: the facts in which methods differ, and the interfaces their parts share.

A ``Method`` names its stage network (``build``), whether learn-stage trains a new stage, whether
subspace 0 is the PTM's (``offset``), the prefix of its stage tensors, its training defaults, its
config rules and, for an analytic method, its head. Everything else (data, prototypes, the
training loop, evaluation, run directory, export) is shared and reads these facts.

This module and the method modules import no torch at run time: ``drl --help`` lists the
registry's names without loading it. Networks and heads are imported when first built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..config import RunConfig, TrainConfig

if TYPE_CHECKING:
    from torch import Tensor, nn

    from ..api import LoadedRun


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
        """Append a freshly initialised stage (seeded, on the PTM's device) and return it."""
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

    def forward_train(self, images: Tensor) -> tuple[Tensor | None, Tensor]:
        """(PTM feature (B, d) or None, newest stage's feature (B, d)), gradients for the newest stage only."""
        ...


class HeadFit(Protocol):
    """One stage's fit of an analytic head (``ranpac.StageFit``)."""

    head: nn.Module
    tensors: dict[str, Tensor]  # into the stage's weights file
    statistics: dict[str, Tensor]  # the stage's statistics file
    meta: dict[str, Any]  # into stage.json, under the method's name; has "seconds"
    num_params: int


class AnalyticHead(Protocol):
    """A head fitted from statistics instead of scored against prototypes (``ranpac.py``):
    ``head(features (B, S, d)) -> scores (B, C)``. The head module also says what it reads
    (``stages_read(width)``, ``layout_grid``) and checks it against the network (``check_width``)."""

    def fit_stage(
        self,
        loaded: LoadedRun,
        features: Tensor,
        labels: Tensor,
        *,
        image_labels: list[int],
        indices: list[int] | None,
        num_classes: int,
        config: RunConfig,
        stage_index: int,
    ) -> HeadFit:
        """learn-stage: add a stage's features (N, S, d) to the run's statistics and solve."""
        ...

    def from_stages(self, stage_tensors: list[dict[str, Tensor]]) -> nn.Module:
        """load a run: the head from every committed stage's tensors."""
        ...

    def from_state(self, state: dict[str, Tensor]) -> nn.Module:
        """load an export: the head from its own state dict."""
        ...


def _no_rules(config: RunConfig) -> None:
    return None


@dataclass(frozen=True)
class Method:
    """The facts of one method; see ``methods/__init__.py`` for the registry."""

    name: str
    build: Callable[[nn.Module, RunConfig], StageNetwork]  # the network over a frozen PTM, no stage yet
    trains: bool  # learn-stage trains a new stage (train.py) and stores its parameters
    offset: int  # 1: subspace 0 is the PTM's; 0: only stage subspaces (see prototypes.py)
    tensor_prefix: str  # prefix of the method's tensors in a stage's weights file
    train_defaults: TrainConfig = field(default_factory=TrainConfig)  # the train section of a new run
    rules: Callable[[RunConfig], None] = _no_rules  # UsageError if a config of this method breaks one
    # rules on the method's own config section, checked in every config (each holds every section)
    section_rules: Callable[[RunConfig], None] = _no_rules
    load_head: Callable[[], AnalyticHead] | None = None  # imports the analytic head, if any
    # other sections of a new run that differ from the dataclass defaults: {section: {key: value}}
    defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # named recipes over ``defaults`` (``init --preset``, ``benchmark`` variant ``preset=``)
    presets: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)

    @property
    def head(self) -> AnalyticHead | None:
        """The analytic head, scoring instead of the prototype bank; None for prototype methods."""
        return self.load_head() if self.load_head is not None else None
