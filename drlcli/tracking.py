"""Experiment tracking: TensorBoard event files of what ``learn-stage`` does (``--tensorboard DIR``,
the optional ``tensorboard`` extra: ``pip install 'drlcli[tensorboard]'``).

Scalars, one tag each:
- per epoch (step: the epoch): ``loss/stage_NNN``, the epoch's mean training loss, and
  ``lr/stage_NNN``, the learning rate it ran at;
- per committed stage (step: the stage): ``accuracy/A_t`` (top-1 on every class seen so far),
  ``accuracy/average`` (Ā), ``forgetting/mean`` and ``forgetting/stage_NNN`` (best earlier
  accuracy on stage NNN's classes minus the accuracy now).

The folder belongs to the experiment, never to a run: one inside a run directory is refused, like
``export --out`` and ``eval --plot``. The writer opens at the first scalar, so a call that learns
nothing leaves no file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import StorageError, UsageError, require
from .metrics import HistorySummary
from .run.access import refuse_inside_run

FLUSH_SECONDS = 10  # how stale a live TensorBoard may be during a long stage


def summary_writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or a ``DependencyError`` naming the extra."""
    require("tensorboard", extra="tensorboard", purpose="--tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


def check_tensorboard_dir(path: Path | str) -> None:
    """Fail before any work: a file in the folder's place, a folder inside a run directory, or
    tensorboard missing."""
    if Path(path).exists() and not Path(path).is_dir():
        raise UsageError(f"--tensorboard {path} is a file; pass a folder for the event files")
    refuse_inside_run(path, option="--tensorboard")
    summary_writer_class()


def stage_tag(name: str, stage: int) -> str:
    return f"{name}/stage_{stage:03d}"


class TensorBoardLog:
    """Scalars of one run's stages, in ``log_dir`` (a context manager: closing flushes them)."""

    def __init__(self, log_dir: Path | str):
        self.log_dir = Path(log_dir)
        self.written = False  # whether any scalar was written (a call that learns nothing writes none)
        self._writer: Any = None

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_epoch(self, stage: int, epoch: int, *, loss: float, lr: float | None) -> None:
        self._scalar(stage_tag("loss", stage), loss, epoch)
        if lr is not None:
            self._scalar(stage_tag("lr", stage), lr, epoch)

    def log_stage(self, stage: int, history: HistorySummary) -> None:
        """A_t, Ā and forgetting after ``stage`` (nothing for a stage without evaluation data)."""
        if history.accuracy and history.accuracy[-1] is not None:
            self._scalar("accuracy/A_t", history.accuracy[-1], stage)
        if history.average is not None:
            self._scalar("accuracy/average", history.average, stage)
        if history.mean_forgetting is not None:
            self._scalar("forgetting/mean", history.mean_forgetting, stage)
        for group, value in history.forgetting.items():
            self._scalar(stage_tag("forgetting", int(group)), value, stage)
        if self._writer is not None:
            self._call("flush")

    def close(self) -> None:
        if self._writer is not None:
            self._call("close")
            self._writer = None

    def _scalar(self, tag: str, value: float, step: int) -> None:
        if self._writer is None:
            writer_class = summary_writer_class()
            try:
                self._writer = writer_class(log_dir=str(self.log_dir), flush_secs=FLUSH_SECONDS)
            except OSError as exc:
                raise self._storage_error(exc) from exc
        self._call("add_scalar", tag, float(value), step)
        self.written = True

    def _call(self, name: str, *args: Any) -> None:
        try:
            getattr(self._writer, name)(*args)
        except OSError as exc:
            raise self._storage_error(exc) from exc

    def _storage_error(self, exc: OSError) -> StorageError:
        return StorageError(
            f"cannot write TensorBoard events to {self.log_dir}: {exc.strerror or exc}; pick another --tensorboard"
        )
