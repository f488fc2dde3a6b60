"""Training one DRL stage (paper §III-C, SPEC §2.2).

Shared by the trained methods (drl; ease with loss ce and no KD). Trainable: the new stage's
parameters (drl: adapters, gates and transfer FFN), and a cosine classifier over the
stage's own classes, z_i = σ·cos(w_i, f_s(x)) with a learnable scale σ. Loss: DAS (or CE or CosFace
for the ablations) + α·(1 - cos(f_s, f_0)). SGD with momentum, cosine learning-rate schedule over
epochs. The PTM and every older stage stay frozen (they run under no_grad). The forward and the
loss run in the call's precision (``precision.py``; fp16 with a loss scale).
"""

from __future__ import annotations

import math
import random
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from .. import distributed
from ..data import ImageDataset, LabelledImages, make_loader, start_workers, train_transform
from ..errors import DivergedError, UsageError
from ..features import StageNetwork
from ..features.losses import ce_loss, cosface_loss, das_loss, kd_loss
from ..model import class_means, embed_images
from ..options import TrainConfig
from ..precision import autocast, grad_scaler
from ..seeding import reseed, seeded
from .batches import EpochDraw, GlobalBatchShard
from .train_state import TrainState, capture, fork_python_random, restore

PROGRESS_EVERY = 10  # training steps between progress reports (the first and last step always report)


@dataclass(frozen=True)
class TrainProgress:
    """One optimisation step's progress, for progress bars and logs: steps 1, every
    ``PROGRESS_EVERY``-th and the epoch's last report."""

    epoch: int
    epochs: int
    step: int
    steps: int
    loss: float  # this step's batch loss
    lr: float  # the learning rate of this epoch (the cosine schedule's)


@dataclass(frozen=True)
class TrainResult:
    epoch_losses: list[float]
    scale: float  # the learned σ of the cosine classifier
    seconds: float
    steps: int


class CosineClassifier(nn.Module):
    """z = σ·cos(w_i, f), σ learnable (initialised where the anchor is reachable: σ > k)."""

    def __init__(self, width: int, num_classes: int, *, scale_init: float):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_classes, width) * 0.02)
        self.scale = nn.Parameter(torch.tensor(float(scale_init)))

    def forward(self, features: Tensor) -> Tensor:
        return self.scale * F.normalize(features, dim=-1) @ F.normalize(self.weight, dim=-1).T


def stage_loss(
    logits: Tensor, targets: Tensor, feats: Tensor, ptm_feats: Tensor | None, cfg: TrainConfig, scale: Tensor
) -> Tensor:
    """The step's loss: ``cfg.loss`` on the logits σ·cos (σ: ``scale``), plus the distillation term."""
    if cfg.loss == "cosface":
        loss = cosface_loss(logits, targets, scale=scale, margin=cfg.margin)
    elif cfg.loss == "das":
        loss = das_loss(
            logits,
            targets,
            anchor_pos=cfg.anchor_pos,
            anchor_neg=cfg.anchor_neg,
            lambda_pos=cfg.lambda_pos,
            lambda_neg=cfg.lambda_neg,
        )
    else:
        loss = ce_loss(logits, targets)
    if cfg.kd_weight and ptm_feats is not None:
        loss = loss + cfg.kd_weight * kd_loss(feats, ptm_feats)
    return loss


def train_stage(
    network: StageNetwork,
    images: LabelledImages,
    cfg: TrainConfig,
    data_config: dict[str, Any],
    *,
    precision: str = "fp32",
    progress: Callable[[TrainProgress], None] | None = None,
    resume: TrainState | None = None,
    on_epoch: Callable[[TrainState], None] | None = None,
) -> TrainResult:
    """Train the network's newest stage on ``images`` (labels local to the stage).

    ``network`` is any method's network (``IPANetwork``, ``EaseNetwork``): ``forward_train`` gives
    (PTM feature or None, newest stage's feature, *loss terms of the network's own, added) with
    gradients only for the newest stage.
    ``on_epoch`` receives the state after each epoch; ``resume`` continues from such a state and
    gives the same parameters as an uninterrupted run. ``precision``: fp32, bf16 or fp16 (see
    ``precision.py``; the caller checks that the device supports it).
    """
    # loss ce on a single class is identically 0: the stage then keeps its initialisation, which
    # is what CE-trained methods (EASE) do on such a stage. DAS trains it (SPEC §2.2).
    device = next(network.ptm.parameters()).device
    stage = network.stages[-1]
    generator = torch.Generator().manual_seed(cfg.seed)  # the loader's order (and its workers' seeds)
    classifier = _classifier(
        network, images, cfg, data_config, device=device, precision=precision, from_prototypes=resume is None
    )
    loader = _loader(images, cfg, data_config, generator, device=device)
    loop = _Loop(
        loader,
        _step_module(network, classifier, cfg, device),
        *_optimizer(stage, classifier, cfg),
        precision=precision,
        scaler=grad_scaler(device, precision),
    )
    stage.train()
    start = time.perf_counter()
    epoch_losses: list[float] = []
    steps, first_epoch, earlier_seconds = 0, 1, 0.0
    # the transforms' randomness (the flip's; EASE's dropout draws on the training device)
    with seeded(cfg.seed, device), fork_python_random():
        random.seed(cfg.seed)  # and timm's random resized crop's
        if resume is not None:
            restore(resume, stage, classifier, loop, generator, device)
            epoch_losses, steps = list(resume.epoch_losses), resume.steps
            first_epoch, earlier_seconds = resume.epoch + 1, resume.seconds
        for epoch in range(first_epoch, cfg.epochs + 1):
            done = _run_epoch(loop, epoch, cfg, device=device, progress=progress)
            epoch_losses.append(done.loss)
            steps += done.steps
            _check_finite(epoch, done.loss, stage, classifier, cfg)  # before a checkpoint can keep it
            if on_epoch is not None:
                tensors = capture(stage, classifier, loop, generator, device)
                elapsed = earlier_seconds + time.perf_counter() - start
                on_epoch(TrainState(epoch, tensors, list(epoch_losses), elapsed, steps, lr=done.lr))
    stage.eval()
    stage.requires_grad_(False)
    seconds = earlier_seconds + time.perf_counter() - start
    return TrainResult(epoch_losses, float(classifier.scale.item()), seconds, steps)


@dataclass(frozen=True)
class _Loop:
    """What every epoch uses: the batches, the step's loss, and the optimiser with its schedule."""

    loader: DataLoader
    step_module: nn.Module  # _StageStep, wrapped in DistributedDataParallel under torchrun
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    params: list[nn.Parameter]  # in the optimiser's order: the checkpoint's momentum.<i>
    precision: str = "fp32"  # the forward's and the loss's (precision.autocast)
    scaler: torch.amp.GradScaler | None = None  # fp16's loss scale; None for fp32 and bf16


@dataclass(frozen=True)
class _Epoch:
    """One finished epoch: its mean loss over every process's images, its steps, its learning rate."""

    loss: float
    steps: int
    lr: float


def _classifier(
    network: StageNetwork,
    images: LabelledImages,
    cfg: TrainConfig,
    data_config: dict[str, Any],
    *,
    device: torch.device,
    precision: str,
    from_prototypes: bool,
) -> CosineClassifier:
    """The stage's cosine classifier, seeded; ``head_init`` prototypes starts it at the class means
    (not when resuming: the checkpoint holds its weights)."""
    with seeded(cfg.seed):
        classifier = CosineClassifier(network.width, len(images.class_names), scale_init=cfg.scale_init).to(device)
    if cfg.head_init == "prototypes" and from_prototypes:
        means = initial_class_means(
            network, images, data_config, batch_size=cfg.batch_size, num_workers=cfg.num_workers, precision=precision
        )
        classifier.weight.data.copy_(means.to(device))
    return classifier


def _loader(
    images: LabelledImages,
    cfg: TrainConfig,
    data_config: dict[str, Any],
    generator: torch.Generator,
    *,
    device: torch.device,
) -> DataLoader:
    """Augmented batches of ``cfg.batch_size`` images, shuffled by ``generator`` (at most
    ``cfg.epoch_images_per_class`` of each class an epoch: ``batches.py``); under torchrun the batch
    is the global one and each process loads its share (``GlobalBatchShard``)."""
    dataset = ImageDataset(images, train_transform(data_config, crop_scale_min=cfg.crop_scale_min, hflip=cfg.hflip))
    world = distributed.world_size()
    draw = EpochDraw(images.labels, cfg.epoch_images_per_class, generator)
    global_batch = min(cfg.batch_size, draw.size)
    drop_last = draw.size > cfg.batch_size  # no tiny last batch, unless it is the only one
    sampler = None
    if world > 1:  # --batch-size is the global batch: each of the K processes takes 1/K of it
        if draw.size < world:
            raise UsageError(
                f"the stage trains {draw.size} images an epoch, fewer than the {world} processes; use fewer"
            )
        global_batch = draw.size // world * world if global_batch == draw.size else global_batch
    if world > 1 or draw.cap is not None:
        sampler = GlobalBatchShard(draw, global_batch)
    return make_loader(
        dataset,
        batch_size=distributed.local_batch_size(global_batch),
        device=device,
        num_workers=cfg.num_workers,
        shuffle=sampler is None,
        sampler=sampler,
        drop_last=drop_last if sampler is None else False,
        generator=generator,  # also draws the workers' base seed, in both modes alike
        worker_init_fn=_seed_worker,
    )


def _step_module(
    network: StageNetwork, classifier: CosineClassifier, cfg: TrainConfig, device: torch.device
) -> nn.Module:
    """One step's loss as a module; under torchrun the trainable parameters' gradients are averaged over ranks."""
    step_module: nn.Module = _StageStep(network, classifier, cfg)
    if distributed.world_size() > 1:
        step_module = DistributedDataParallel(step_module, device_ids=[device.index] if device.type == "cuda" else None)
    return step_module


def _optimizer(
    stage: nn.Module, classifier: CosineClassifier, cfg: TrainConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, list[nn.Parameter]]:
    """SGD with momentum over the stage's trainable parameters and the classifier, and its cosine
    schedule over the epochs. Weight decay on the stage and the class weights, not on the scale σ."""
    decay = [p for p in stage.parameters() if p.requires_grad] + [classifier.weight]
    optimizer = torch.optim.SGD(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": [classifier.scale], "weight_decay": 0.0}],
        lr=cfg.lr,
        momentum=cfg.momentum,
    )
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return optimizer, schedule, params


def _run_epoch(
    loop: _Loop,
    epoch: int,
    cfg: TrainConfig,
    *,
    device: torch.device,
    progress: Callable[[TrainProgress], None] | None,
) -> _Epoch:
    """One epoch of steps, then the schedule's step."""
    world = distributed.world_size()
    if world > 1:  # each process reseeds its augmentations every epoch
        seed = cfg.seed * 1_000_003 + epoch * 1009 + distributed.rank()
        reseed(seed, device)
        random.seed(seed)
    lr = float(loop.optimizer.param_groups[0]["lr"])
    # The loss is summed on the device and read once per epoch: reading it (.item()) waits for the
    # GPU, so a read every step would stall the queue of kernels. Progress reads it every few steps.
    total_on_device = torch.zeros((), dtype=torch.float64, device=device)
    count, steps, last = 0, 0, len(loop.loader)
    for step, (batch, targets) in enumerate(start_workers(loop.loader), 1):
        batch, targets = batch.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast(device, loop.precision):
            loss = loop.step_module(batch, targets)
        loop.optimizer.zero_grad(set_to_none=True)
        _backward_and_step(loop, loss)
        total_on_device += loss.detach().double() * len(targets)
        count += len(targets)
        steps += 1
        if progress is not None and (step == 1 or step % PROGRESS_EVERY == 0 or step == last):
            progress(TrainProgress(epoch, cfg.epochs, step, last, loss.item(), lr))
    total = float(total_on_device)
    with warnings.catch_warnings():
        if loop.scaler is not None:  # fp16's loss scale skipped every step of the epoch (overflow): no misorder
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"), UserWarning)
        loop.schedule.step()
    if world > 1:  # the epoch's loss over every process's images
        total, count = distributed.all_reduce_sum(torch.tensor([total, float(count)], dtype=torch.float64)).tolist()
    return _Epoch(total / max(count, 1), steps, lr)


def _backward_and_step(loop: _Loop, loss: Tensor) -> None:
    """Gradients and the optimiser's step; under fp16 through the loss scale, which skips a step whose
    gradients overflowed and lowers the scale (the gradients are unscaled before the step)."""
    if loop.scaler is None:
        loss.backward()
        loop.optimizer.step()
        return
    loop.scaler.scale(loss).backward()
    loop.scaler.step(loop.optimizer)
    loop.scaler.update()


def _check_finite(epoch: int, loss: float, stage: nn.Module, classifier: nn.Module, cfg: TrainConfig) -> None:
    """Refuse to go on (and to checkpoint) once the loss or a weight is NaN or infinite. Every process
    sees the same summed loss and the same weights, so under torchrun all stop together."""
    weights = [*stage.parameters(), *classifier.parameters()]
    if math.isfinite(loss) and all(torch.isfinite(w).all() for w in weights):
        return
    reason = "a weight is NaN or infinite" if math.isfinite(loss) else f"loss {loss}"
    raise DivergedError(
        f"training diverged in epoch {epoch} ({reason}); nothing was committed: lower --lr (now {cfg.lr:g})"
    )


def initial_class_means(
    network: nn.Module,
    images: LabelledImages,
    data_config: dict[str, Any],
    *,
    batch_size: int,
    num_workers: int = 0,
    precision: str = "fp32",
) -> Tensor:
    """(C, d) mean feature (on the CPU) of each class in the newest (untrained) stage's subspace, eval transform:
    a classifier that starts there already separates the stage's classes, so the first steps
    refine the features instead of chasing random class directions."""
    network.stages[-1].eval()  # no dropout (EASE); train_stage switches it back to training
    feats, labels = embed_images(
        network,
        images,
        data_config,
        batch_size=batch_size,
        num_workers=num_workers,
        precision=precision,
        indices=distributed.shard(len(images)),
    )
    return class_means(feats[:, -1:], labels, len(images.class_names))[:, 0]


class _StageStep(nn.Module):
    """One training step's loss as a module, so DistributedDataParallel can wrap it."""

    def __init__(self, network: nn.Module, classifier: CosineClassifier, cfg: TrainConfig):
        super().__init__()
        self.network, self.classifier, self.cfg = network, classifier, cfg

    def forward(self, images: Tensor, targets: Tensor) -> Tensor:
        ptm_feats, feats, *terms = self.network.forward_train(images)  # terms: the network's own loss terms
        logits = self.classifier(feats)
        return stage_loss(logits, targets, feats, ptm_feats, self.cfg, self.classifier.scale) + sum(terms)


def _seed_worker(worker_id: int) -> None:
    import os

    rank = int(os.environ.get("RANK", "0"))  # under torchrun: different augmentations per process
    if rank:
        reseed(torch.initial_seed() + 7919 * rank)
    random.seed(torch.initial_seed() % 2**32)
