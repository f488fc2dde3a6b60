"""A drop's evaluation set held out of the drop itself (``learn-stage --eval-fraction F``): a seeded
fraction of each class's images, never trained on. The same drop, fraction and seed always hold out
the same images, so an interrupted call resumes and a repeated one is recognised."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from ..errors import DataError, UsageError
from .images import ImageSet, ImageSubset, LabelledImages


def check_fraction(fraction: float) -> None:
    """``fraction`` is a finite number strictly between 0 and 1 (UsageError otherwise)."""
    ok = isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and math.isfinite(fraction)
    if not ok or not 0 < fraction < 1:
        raise UsageError(f"--eval-fraction must be a number between 0 and 1 (both excluded), got {fraction!r}")


def held_out_indices(labels: Sequence[int], class_names: Sequence[str], fraction: float, seed: int) -> list[int]:
    """The indices held out: of each class of ``n`` images, round(fraction * n) of them, at least 1
    when ``n >= 2`` and always leaving at least 1 to train on (a class of one image keeps it). The
    draw of each class is seeded by ``seed`` and the class name alone, so another class's images
    do not change it."""
    members: dict[int, list[int]] = {}
    for index, label in enumerate(labels):
        members.setdefault(label, []).append(index)
    held: list[int] = []
    for label, indices in members.items():
        if len(indices) < 2:
            continue
        count = min(len(indices) - 1, max(1, round(fraction * len(indices))))
        rng = random.Random(f"{seed}\0{class_names[label]}")
        held.extend(rng.sample(indices, count))
    return sorted(held)


def split_held_out(images: LabelledImages, fraction: float, *, seed: int) -> tuple[LabelledImages, LabelledImages]:
    """(the images to train on, the held-out ones), both under the drop's class names: a folder's
    as ``ImageSet`` listings (so they are decoded, checked and fingerprinted as any folder's), a
    dataset's as ``ImageSubset``. DataError when no class has two images to split."""
    check_fraction(fraction)
    held = held_out_indices(images.labels, images.class_names, fraction, seed)
    if not held:
        raise DataError(
            f"--eval-fraction holds out nothing of {images.origin}: no class has 2 images; "
            "add images or pass --eval-data DIR"
        )
    chosen = set(held)
    kept = [i for i in range(len(images)) if i not in chosen]
    return _subset(images, kept), _subset(images, held)


def _subset(images: LabelledImages, indices: list[int]) -> LabelledImages:
    if isinstance(images, ImageSet):
        paths = tuple(images.paths[i] for i in indices)
        return ImageSet(images.root, images.class_names, paths, tuple(images.labels[i] for i in indices))
    return ImageSubset(images, tuple(indices))
