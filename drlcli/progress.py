"""What the library reports while it works: ``Progress`` events, as numbers the CLI formats (a bar
on a terminal, plain lines and a heartbeat otherwise). Nothing in the library prints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """What the library reports while it works, as numbers (the CLI formats them): a phase, its step
    count, and the phase's own figures. ``detail`` is text only where there is no number: a warning,
    the folder being validated, the benchmark's variant and stage."""

    phase: str  # "validate" | "resume" | "train" | "prototypes" | "evaluate" | "predict" | "warning"
    step: int
    total: int
    detail: str = ""
    epoch: int | None = None  # train: the epoch running, of ``epochs``
    epochs: int | None = None
    loss: float | None = None  # train: this step's batch loss
    lr: float | None = None  # train: this epoch's learning rate
    eval_set: int | None = None  # evaluate: the eval set being read, of ``num_eval_sets``
    num_eval_sets: int | None = None
    num_failed: int | None = None  # predict: images that could not be read so far


ProgressFn = Callable[[Progress], None]
