"""What a method is: the facts a run stores under its ``method`` name.

A ``Method`` names its feature network (``build``, from ``features/``), whether learn-stage trains a
new stage, whether subspace 0 is the PTM's (``offset``), the prefix of its stage tensors, its option
sections, its training defaults, its config rules, its schedule (``schedule/``) and, for an analytic
method, its head (``heads/``). Everything else (data, prototypes, the training loop, evaluation, run
directory, export) is shared and reads these facts. The configurations people choose are recipes
(``recipes.py``).

This module and the method modules import no torch at run time: ``drl --help`` lists the
registry's names without loading it. Networks and heads are imported when first built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..options import TrainConfig
from ..schedule import EVERY_STAGE, Schedule

if TYPE_CHECKING:
    from torch import nn

    from ..config import RunConfig
    from ..features import StageNetwork


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
    # when its network trains across stages and which head answers (``schedule.Schedule``)
    schedule: Callable[[RunConfig], Schedule] = lambda config: EVERY_STAGE
