"""What the phases of one learn-stage call share: the call's sources, the run's records read before
any model is built, the context every later phase works from, and each phase's result."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config import RunConfig
from ..data import LabelledImages
from ..device import resolve_device
from ..distributed import world_size
from ..errors import IntegrityError
from ..evaluation import SetFeatures
from ..heads import HeadFit
from ..heads.openset.calibrate import Calibration
from ..heads.openset.rmd import Moments
from ..methods import Method, trains_stage
from ..metrics import AccuracyReport, Transfer
from ..model import IncrementalModel
from ..options import TrainConfig
from ..precision import training_precision
from ..progress import Progress, ProgressFn
from ..run.directory import RunDir
from ..run.load import LoadedRun
from ..run.records import set_has_trained
from ..run.writer import RunWriter
from ..schedule import Schedule
from ..tracking import TensorBoardLog
from .train import TrainResult

if TYPE_CHECKING:
    from .decide import Decision


@dataclass(frozen=True)
class StageContext:
    """One learn-stage call, as ``prepare`` read it: what every later phase works from."""

    run: RunDir
    writer: RunWriter | None  # rank 0 holds the run's lock; None on the other ranks
    manifest: dict[str, Any]
    config: RunConfig  # the run's, with this call's training overrides
    method: Method
    loaded: LoadedRun  # its model gains the new stage and classes as the phases go
    learned: dict[str, int]  # class name -> stage, before this one
    images: LabelledImages
    eval_images: LabelledImages | None
    eval_data_dir: Path | None  # a folder's (registered for later evaluations); None for a dataset
    fingerprint: str  # of ``images``
    index: int  # of the new stage
    device: str
    precision: str  # the network forward's: fp32 | bf16 | fp16
    tracker: TensorBoardLog | None  # --tensorboard's event files (rank 0)
    progress: ProgressFn | None
    # --eval-fraction: ``eval_images`` were held out of the drop ({"held_out": F, "seed": s}); None: not
    held_out: dict[str, Any] | None = None
    # the training options the call set (--epochs, --batch-size): the schedule's later ones do not replace them
    train_given: frozenset[str] = frozenset()

    @property
    def model(self) -> IncrementalModel:
        return self.loaded.model

    @property
    def schedule(self) -> Schedule:
        """When the run's network trains and which head answers (``schedule/``)."""
        return self.method.schedule(self.config)

    @property
    def train_precision(self) -> str:
        """The training steps' dtype (``train.precision``); the rest of the stage runs in ``precision``."""
        return training_precision(self.config.train.precision, self.precision, resolve_device(self.device))

    @property
    def train(self) -> TrainConfig:
        """The training options of this stage: the run's, with the epochs and batch its schedule gives a
        stage after the set first trained (``Schedule.epochs``, ``Schedule.batch_size``), unless the call
        set them."""
        train, schedule = self.config.train, self.schedule
        before = set_has_trained(self.loaded.stage_metas)
        epochs, batch_size = train.epochs, train.batch_size
        if "epochs" not in self.train_given:
            epochs = schedule.epochs(epochs, trained_before=before)
        if "batch_size" not in self.train_given:
            batch_size = schedule.batch_size(batch_size, trained_before=before, processes=world_size())
        if (epochs, batch_size) == (train.epochs, train.batch_size):
            return train
        return replace(train, epochs=epochs, batch_size=batch_size)

    @property
    def untrained(self) -> bool:
        """The method trains stages, but this one gets no stage network: the schedule trains only
        the stages before it (``Schedule.trained_stages``), or nothing the run answers reads its
        subspace (``train.skip_unread``, ``methods.stage_is_read``)."""
        return self.method.trains and not trains_stage(self.config, self.index)

    def earlier_transfer(self) -> Transfer:
        """A carried run's forward-transfer counts so far, from its newest stage's record (zero for a
        stage 1, or a record from before them); counts that cannot be are an IntegrityError."""
        carry = self.loaded.stage_metas[-1].get("carry") if self.loaded.stage_metas else None
        try:
            before = carry.get("transfer") if isinstance(carry, dict) else None
            if before is not None and not isinstance(before, dict):
                raise ValueError("carry.transfer must be a mapping")
            return Transfer.from_dict(before["run"]) if before else Transfer(0, 0, 0)
        except (KeyError, ValueError) as exc:
            raise IntegrityError(f"the run's last stage record does not fit ({exc}); restore it from a backup") from exc

    @property
    def skip_reason(self) -> str:
        """Why an untrained stage has no network, for people (``untrained``)."""
        limit = self.schedule.trained_stages
        if limit is None:
            return "nothing the run answers would read them (train.skip_unread; a run initialised with it false trains and stores them)"
        if limit == 0:
            return f"method {self.method.name} trains none (adapter.peft none)"
        return f"method {self.method.name} adapts the PTM in stage 1 only (schedule.stages first)"

    def say(self, phase: str, step: int, total: int, detail: str = "") -> None:
        if self.progress is not None:
            self.progress(Progress(phase, step, total, detail))

    def discard_checkpoint(self) -> None:
        if self.writer is not None:
            self.writer.discard_checkpoint()


@dataclass(frozen=True)
class Trained:
    result: TrainResult | None  # None: the method trains nothing, or the stage was not trained
    resumed_from: int | None  # the epoch an interrupted call's checkpoint had reached
    skipped: bool = False  # no stage network was made: nothing reads its subspace (train.skip_unread)
    paused: bool = False  # a switched run's carried network, not trained this stage (``Began.paused``)


@dataclass(frozen=True)
class Began:
    """A carried run's stage as it begins (``begin.carried_start``): every image's head rows and rmd
    inputs through the network as the stage begins, in the stage's image order, and the stage's
    forward transfer, stage.json's ``carry.transfer``. ``paused``: a switched run that pauses
    (``Schedule.pauses``) and whose transfer so far, this stage's included, says adapting stalls (or,
    while no stage trained the set, whose trial says adapting would not pay) does not train the
    network this stage. Stage 1 has one only where it was tried."""

    rows: torch.Tensor | None  # (N, S', d); None: stage 1 trains after its trial (``trial.py``): not needed
    rmd_rows: torch.Tensor | None  # (N, ...) the "unknown" answer's inputs
    transfer: dict[str, Any] | None  # None at stage 1: its trial's margins are no answers' counts
    paused: bool
    seconds: float  # its passes, counted in the stage's feature-phase seconds (``Fitted.seconds``)
    trial: dict[str, Any] | None = None  # the stage's trial, while no stage trained the set (``trial.py``)
    passes: float = 0.0  # its feature passes, per image of the stage (stage.json ``metrics.passes``)
    trial_passes: float = 0.0  # the trial's, likewise
    untrained: bool = False  # the set stays untrained this stage: the frozen PTM, as the frozen track's

    @property
    def moves(self) -> bool:
        """The stage trains the network from where ``rows`` put its images (stage 1 has none)."""
        return not self.paused and self.rows is not None

    def record(self) -> dict[str, Any]:
        """What stage.json's ``carry`` takes of it: the transfer, the trial, whether the stage paused."""
        return {
            **({"transfer": self.transfer} if self.transfer is not None else {}),
            **({"trial": self.trial} if self.trial is not None else {}),
            **({"paused": True} if self.paused else {}),
        }


@dataclass(frozen=True)
class Fitted:
    fit: HeadFit | None  # the analytic head's, if the method has one
    calibration: Calibration  # the stage's open-set thresholds
    bias: torch.Tensor  # (n,) the open-set biases of the stage's classes
    rmd: tuple[Moments, torch.Tensor] | None  # the rmd rule's moments and (n,) biases of them
    seconds: float  # the feature pass for the prototypes, and the head's fit
    decision: Decision | None = None  # stage 1's adapted against frozen features (decide.py)
    carry: dict[str, Any] | None = None  # a carried run's stage > 1: how far it moved the earlier classes
    # (n, d) f_0 of this process's share of the stage's images, as the pass gave it: a switched run's
    # frozen track hands the run its frozen PTM's (``begin.carried_start``), saving the run that pass
    f0: torch.Tensor | None = None
    # with f0, the same pass's head rows and rmd inputs (a frozen track's: the untrained set's rows too)
    rows: torch.Tensor | None = None
    rmd_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class Evaluated:
    report: AccuracyReport | None  # None: no eval set registered or given
    warnings: list[str]  # registered eval sets that were left out
    switch: dict[str, Any] | None = None  # a switched run: the track that answers (``switch.answered``)
    rows: tuple[SetFeatures, ...] = ()  # each eval set's rows, where kept (a switched run's frozen track's)


@dataclass(frozen=True)
class Record:
    meta: dict[str, Any]  # stage.json
    files: dict[str, bytes]  # the stage's files, as committed
    carries_totals: bool = False  # its totals file holds the run's: the earlier stages' goes


@dataclass(frozen=True)
class Sources:
    """What learn-stage learns from and evaluates on: folders or datasets (``class_names`` names
    the datasets' int labels)."""

    data_dir: Path | None
    eval_data_dir: Path | None
    data: Any
    eval_data: Any
    class_names: Sequence[str] | None
    eval_fraction: float | None = None  # hold out this fraction of each class of ``data`` as the eval set


@dataclass(frozen=True)
class Records:
    """What learn-stage reads before it builds any model or decodes any image: the run's records
    and the data folders' listings, enough to refuse a learned class or see a drop already learned."""

    manifest: dict[str, Any]
    config: RunConfig  # the run's, before this call's training overrides
    metas: list[dict[str, Any]]  # every stage's stage.json, checked
    learned: dict[str, int]  # class name -> stage, classes the run answers with (not forgotten)
    images: LabelledImages
    eval_images: LabelledImages | None
    eval_data_dir: Path | None
    fingerprint: str  # of ``images``
    run: RunDir
    held_out: dict[str, Any] | None = None  # ``eval_images`` held out of the drop (``StageContext.held_out``)
