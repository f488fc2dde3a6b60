"""Which images each training epoch reads, in which order: every image of the stage, shuffled, or at
most ``train.epoch_images_per_class`` of each class, drawn afresh every epoch (so a class of 500
images costs what a class of 20 does, and over the epochs still shows most of its images). Under
torchrun every process draws the same order from the same generator and takes its share of each
global batch (``GlobalBatchShard``).

Every draw comes from the loader's generator, whose state an epoch checkpoint keeps: a resumed
stage draws what the uninterrupted one would have.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

from .. import distributed


def epoch_size(labels: Sequence[int], cap: int | None) -> int:
    """How many images an epoch reads: every one, or at most ``cap`` of each class."""
    if cap is None:
        return len(labels)
    return int(torch.bincount(torch.as_tensor(labels, dtype=torch.long)).clamp(max=cap).sum()) if labels else 0


class EpochDraw:
    """One epoch's images in training order, drawn from ``generator``."""

    def __init__(self, labels: Sequence[int], cap: int | None, generator: torch.Generator):
        self.cap, self.generator, self.count = cap, generator, len(labels)
        self.size = epoch_size(labels, cap)
        self.by_class: list[torch.Tensor] = []
        if cap is not None and labels:
            tensor = torch.as_tensor(labels, dtype=torch.long)
            self.by_class = [(tensor == c).nonzero().squeeze(1) for c in range(int(tensor.max()) + 1)]

    def __call__(self) -> list[int]:
        if self.cap is None:
            order = torch.randperm(self.count, generator=self.generator).tolist()
            # torch's RandomSampler draws one more permutation (for its remainder) when exhausted;
            # do the same so the next epoch's order matches one process's (tests/test_distributed.py)
            torch.randperm(self.count, generator=self.generator)
            return order
        drawn = [idx[torch.randperm(len(idx), generator=self.generator)[: self.cap]] for idx in self.by_class]
        chosen = torch.cat(drawn)
        return chosen[torch.randperm(len(chosen), generator=self.generator)].tolist()


class GlobalBatchShard(Sampler[int]):
    """This process's share of the global batches of an epoch's draw (``EpochDraw``).

    Every rank holds the same generator state, so all draw the same order; global batch b is
    order[b·B : (b+1)·B] (full batches only, unless the epoch is one batch) and rank r takes its every
    K-th image. With the gradients averaged over ranks, a step sees the same images as the
    one-process step. In one process (K 1) it is the epoch's draw in full batches.
    """

    def __init__(self, draw: EpochDraw, global_batch: int):
        self.draw, self.global_batch = draw, global_batch
        self.rank, self.world = distributed.rank(), distributed.world_size()

    def __iter__(self) -> Iterator[int]:
        order = self.draw()
        for start in range(0, len(order) - self.global_batch + 1, self.global_batch):
            yield from order[start + self.rank : start + self.global_batch : self.world]

    def __len__(self) -> int:
        return self.draw.size // self.global_batch * (self.global_batch // self.world)


__all__ = ["EpochDraw", "GlobalBatchShard", "epoch_size"]
