"""learn-stage's training phase: a trained method's new stage trained, from the last epoch
checkpoint when one fits the call (same base state, data, options, device type and precision),
each finished epoch checkpointed by rank 0; all ranks must end with bit-identical parameters."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from .. import distributed
from ..device import resolve_device
from ..errors import DivergedError, IntegrityError, RunStateError
from ..options import TrainConfig
from ..progress import Progress, ProgressFn
from ..ptm import backbone
from ..run.directory import RunDir
from ..run.writer import DEFERRED
from .context import StageContext, Trained
from .decide import training_images
from .train import TrainProgress, train_stage
from .train_state import TrainState

log = logging.getLogger(__name__)


def train_or_resume(stage: StageContext, *, restart: bool, paused: bool = False) -> Trained:
    """A trained method's new stage: trained, from the last epoch checkpoint when one fits. Each
    finished epoch is checkpointed (rank 0); a diverged training leaves no checkpoint behind.
    ``paused``: a switched run's carried network, kept as it stands this stage (``Began.paused``)."""
    if not stage.method.trains:
        return Trained(None, None)
    if stage.untrained:  # no stage network at all: neither trained, nor computed, nor stored
        log.debug("stage %d has no network: nothing the run answers reads its subspace", stage.index)
        return Trained(None, None, skipped=True)
    if paused:  # a switched run's carried network, while adapting stalls here: not trained
        log.debug("stage %d: the carried network stays as it is (its forward transfer stalls)", stage.index)
        return Trained(None, None, paused=True)
    network, train = stage.model.network, stage.train
    network.new_stage(seed=train.seed + stage.index)
    key = _checkpoint_key(
        stage.manifest,
        stage.index,
        train,
        stage.fingerprint,
        device_type=resolve_device(stage.device).type,
        precision=stage.train_precision,
    )
    resume = _resume_state(stage, key, restart=restart)

    def epoch_done(state: TrainState) -> None:
        log.debug("epoch %d/%d: loss %.4f (%.1fs)", state.epoch, train.epochs, state.epoch_losses[-1], state.seconds)
        if stage.writer is not None:
            stage.writer.save_checkpoint({**key, **_state_meta(state)}, state.tensors)
        if stage.tracker is not None:  # after the checkpoint: a point is never logged for an epoch that is redone
            stage.tracker.log_epoch(stage.index, state.epoch, loss=state.epoch_losses[-1], lr=state.lr)

    try:
        result = train_stage(
            network,
            training_images(stage),  # the fit part of stage 1's images when deciding (decide.py)
            train,
            stage.model.data_config,
            precision=stage.train_precision,
            progress=train_progress(stage.progress),
            resume=resume,
            on_epoch=epoch_done,
        )
    except DivergedError:
        stage.discard_checkpoint()  # resuming it would diverge again: the re-run starts afresh
        raise
    log.debug("trained %d steps in %.1fs, scale σ %.2f", result.steps, result.seconds, result.scale)
    _check_ranks_agree(network.stages[-1])
    return Trained(result, resume.epoch if resume is not None else None)


def _resume_state(stage: StageContext, key: dict[str, Any], *, restart: bool) -> TrainState | None:
    """The epoch checkpoint to continue from: read by rank 0, sent to every rank. ``restart`` discards it."""
    resume = None
    if stage.writer is not None:
        resume = None if restart else _resumable(stage.run, key)
        if restart:
            stage.writer.discard_checkpoint()
    resume = distributed.broadcast_object(resume)
    if resume is not None:
        stage.say("resume", resume.epoch, stage.train.epochs, "from the last finished epoch")
    return resume


def train_progress(progress: ProgressFn | None) -> Callable[[TrainProgress], None] | None:
    """Training steps as progress counted over the whole stage: one bar, one ETA."""
    if progress is None:
        return None
    return lambda p: progress(
        Progress(
            "train",
            (p.epoch - 1) * p.steps + p.step,
            p.epochs * p.steps,
            epoch=p.epoch,
            epochs=p.epochs,
            loss=p.loss,
            lr=p.lr,
        )
    )


def _check_ranks_agree(stage: torch.nn.Module) -> None:
    """All processes must hold bit-identical stage parameters before rank 0 commits them."""
    if distributed.world_size() == 1:
        return
    digests = distributed.all_gather_objects(backbone.fingerprint(stage))
    if len(set(digests)) != 1:
        raise IntegrityError(
            f"the {len(digests)} processes ended training with different stage parameters; nothing was "
            "committed. Re-run; if it persists, report it with your torchrun command"
        )


def _checkpoint_key(
    manifest: dict[str, Any], stage: int, options: TrainConfig, fingerprint: str, *, device_type: str, precision: str
) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed: base state, stage, data, options, device type
    (kernels and RNG streams differ between CPU and CUDA: a resume across them is not the same run)
    and precision (likewise; fp16's checkpoint also holds its loss scale)."""
    train = asdict(options)  # the stage's epochs; num_workers included: worker seeding changes the augmentations
    del train["precision"]  # the key's own precision is the one it resolved to
    train["world_size"] = distributed.world_size()
    return {
        "generation": manifest["generation"],
        "stage": stage,
        "data_fingerprint": fingerprint,
        "train": train,
        "device": device_type,
        "precision": precision,
    }


def _state_meta(state: TrainState) -> dict[str, Any]:
    return {"epoch": state.epoch, "epoch_losses": state.epoch_losses, "seconds": state.seconds, "steps": state.steps}


def _resumable(run: RunDir, key: dict[str, Any]) -> TrainState | None:
    """The checkpoint to resume, None when there is none; an error when it needs other options."""
    found = run.checkpoint()
    if found is None:
        return None
    meta, tensors = found
    if meta.get("generation") != key["generation"] or meta.get("stage") != key["stage"]:
        return None  # left behind by a stage that no longer applies; the next save replaces it
    if not checkpoint_meta_ok(meta):
        raise RunStateError(
            f"the epoch checkpoint of stage {key['stage']} in {run.path} is malformed; pass --restart to discard it"
        )
    _refuse_other_training(run, key, meta)
    state = {k: v for k, v in tensors.items() if not k.startswith(DEFERRED)}  # a frozen track's stage: not training's
    return TrainState(meta["epoch"], state, list(meta["epoch_losses"]), float(meta["seconds"]), meta["steps"])


def _refuse_other_training(run: RunDir, key: dict[str, Any], meta: dict[str, Any]) -> None:
    """An error when the checkpoint's training is not this call's: another device type, precision, data or options."""
    written_on = meta.get("device", key["device"])  # absent: written before drl recorded it
    if written_on != key["device"]:
        raise RunStateError(
            f"stage {key['stage']} was interrupted after epoch {meta.get('epoch')} on {written_on}, and this run "
            f"is on {key['device']}: a resume across device types would not continue the same training; re-run "
            f"with --device {written_on} to resume, or pass --restart to discard it"
        )
    written_in = meta.get("precision", "fp32")  # absent: written before drl had --precision, in fp32
    if written_in != key["precision"]:
        raise RunStateError(
            f"stage {key['stage']} was interrupted after epoch {meta.get('epoch')} in {written_in}, and this call "
            f"asks for {key['precision']}: a resume across precisions would not continue the same training; re-run "
            f"with --precision {written_in} to resume, or pass --restart to discard it"
        )
    differs = ["--data images"] if meta.get("data_fingerprint") != key["data_fingerprint"] else []
    # an option the checkpoint does not name was written before drl had it: it trained as the option's default
    written = {**asdict(TrainConfig()), **meta.get("train", {})}
    differs += [
        f"{name} {written.get(name)!r} -> {value!r}"
        for name, value in key["train"].items()
        if written.get(name) != value
    ]
    if differs:
        raise RunStateError(
            f"stage {key['stage']} was interrupted after epoch {meta.get('epoch')} with other data or options "
            f"({', '.join(differs)}); re-run with the same ones to resume, or pass --restart to discard it"
        )


_CHECKPOINT_META_TYPES = {"epoch": int, "epoch_losses": list, "seconds": (int, float), "steps": int, "train": dict}


def checkpoint_meta_ok(meta: dict[str, Any]) -> bool:
    """The checkpoint's metadata has the fields and types ``save_checkpoint`` writes."""
    return all(isinstance(meta.get(k), kind) for k, kind in _CHECKPOINT_META_TYPES.items())
