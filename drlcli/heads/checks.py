"""What the heads' stage tensors must be whatever file holds them (the run's loader and ``drl verify``
check each file against these; a crafted file that breaks one is damage, never a crash): the dtype
drl writes each head tensor in (``Head.dtypes``), and per-class counts of a class's images
(``PerClass.images``) whole, and at most the images its stage's record says it learned."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import HEADS, PerClass

DTYPES = {name: dtype for head in HEADS.values() for name, dtype in head.dtypes.items()}
FLOATS = (torch.float32, torch.float64)  # "float" in ``Head.dtypes``


def dtype_problem(tensors: dict[str, Tensor]) -> str | None:
    """The first head tensor of one file not in the dtype drl writes it in, said (None: none)."""
    for name, tensor in tensors.items():
        want = DTYPES.get(name)
        fits = want is None or (tensor.dtype in FLOATS if want == "float" else str(tensor.dtype) == f"torch.{want}")
        if not fits:
            return f"tensor {name} is {tensor.dtype}, not the {want} drl writes"
    return None


def recorded_images(meta: dict[str, Any], name: str) -> int | None:
    """The images of class ``name`` its stage's record (stage.json) says it learned (None: no count)."""
    count = meta["images_per_class"].get(name)
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None


def images_problem(piece: Tensor, bound: int | None) -> str | None:
    """What is wrong with one class's slice of a tensor counting its images: counts that are not
    whole and non-negative, or more in all than the ``bound`` its stage recorded (None: nothing)."""
    if bound is None:
        return "counts images of a class whose stage records none"
    values = piece.to(torch.float64)
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()) or bool((values != values.round()).any()):
        return "does not hold counts of images"
    if float(values.sum()) > bound:
        return f"counts {float(values.sum()):.0f} images of a class its stage learned from {bound}"
    return None


def slices_of(spec: PerClass, index: int, classes: dict[int, list[str]]) -> list[tuple[int, str]]:
    """(stage, class) of each slice of ``spec`` in stage ``index``'s file, in order (``classes``:
    each stage's active classes)."""
    if not spec.seen:
        return [(index, name) for name in classes[index]]
    return [(k, name) for k in sorted(classes) if k <= index for name in classes[k]]


def check_stages(stage_tensors: list[dict[str, Tensor]]) -> None:
    """Every head's tensors of a run's stages together (``AnalyticHead.check_stages``; ValueError)."""
    for head in HEADS.values():
        head.load().check_stages(stage_tensors)
