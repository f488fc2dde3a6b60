"""Training one DRL stage (paper §III-C, SPEC §2.2).

Shared by the trained methods (drl; ease with loss ce and no KD). Trainable: the new stage's
parameters (drl: adapters, gates and transfer FFN), and a cosine classifier over the
stage's own classes, z_i = σ·cos(w_i, f_s(x)) with a learnable scale σ. Loss: DAS (or CE for
the ablation) + α·(1 - cos(f_s, f_0)). SGD with momentum, cosine learning-rate schedule over
epochs. The PTM and every older stage stay frozen (they run under no_grad).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from .config import TrainConfig
from .data import ImageDataset, ImageSet, train_transform
from .losses import ce_loss, das_loss, kd_loss


@dataclass(frozen=True)
class TrainProgress:
    """One optimisation step's progress, for progress bars and logs."""

    epoch: int
    epochs: int
    step: int
    steps: int
    loss: float


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


def stage_loss(logits: Tensor, targets: Tensor, feats: Tensor, ptm_feats: Tensor | None, cfg: TrainConfig) -> Tensor:
    if cfg.loss == "das":
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
    network: nn.Module,
    images: ImageSet,
    cfg: TrainConfig,
    data_config: dict[str, Any],
    *,
    progress: Callable[[TrainProgress], None] | None = None,
) -> TrainResult:
    """Train the network's newest stage on ``images`` (labels local to the stage).

    ``network`` is any method's network (``IPANetwork``, ``EaseNetwork``): ``forward_train`` gives
    (PTM feature or None, newest stage's feature) with gradients only for the newest stage.
    """
    num_classes = len(images.class_names)
    # loss ce on a single class is identically 0: the stage then keeps its initialisation, which
    # is what CE-trained methods (EASE) do on such a stage. DAS trains it (SPEC §2.2).
    device = next(network.ptm.parameters()).device
    stage = network.stages[-1]
    generator = torch.Generator().manual_seed(cfg.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        classifier = CosineClassifier(network.width, num_classes, scale_init=cfg.scale_init).to(device)
    dataset = ImageDataset(images, train_transform(data_config, crop_scale_min=cfg.crop_scale_min, hflip=cfg.hflip))
    loader = DataLoader(
        dataset,
        batch_size=min(cfg.batch_size, len(dataset)),
        shuffle=True,
        drop_last=len(dataset) > cfg.batch_size,  # no tiny last batch, unless it is the only one
        num_workers=cfg.num_workers,
        generator=generator,
        worker_init_fn=_seed_worker,
    )
    decay = [p for p in stage.parameters()] + [classifier.weight]
    optimizer = torch.optim.SGD(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": [classifier.scale], "weight_decay": 0.0}],
        lr=cfg.lr,
        momentum=cfg.momentum,
    )
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)
    stage.train()
    start = time.perf_counter()
    epoch_losses: list[float] = []
    steps = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)  # the transforms' randomness
        for epoch in range(1, cfg.epochs + 1):
            total, count = 0.0, 0
            for step, (batch, targets) in enumerate(loader, 1):
                batch, targets = batch.to(device), targets.to(device)
                ptm_feats, feats = network.forward_train(batch)
                loss = stage_loss(classifier(feats), targets, feats, ptm_feats, cfg)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += loss.item() * len(targets)
                count += len(targets)
                steps += 1
                if progress is not None:
                    progress(TrainProgress(epoch, cfg.epochs, step, len(loader), loss.item()))
            schedule.step()
            epoch_losses.append(total / max(count, 1))
    stage.eval()
    stage.requires_grad_(False)
    return TrainResult(epoch_losses, float(classifier.scale.item()), time.perf_counter() - start, steps)


def _seed_worker(worker_id: int) -> None:
    import random

    seed = torch.initial_seed() % 2**32
    random.seed(seed)
