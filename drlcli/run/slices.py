"""One kept slice of a forgotten class (``forgotten.kept_rows``) checked against the live per-class
tensor it was taken from: one class's slice of it, finite, and shaped like one."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..heads import PerClass

if TYPE_CHECKING:
    from .forgotten import ForgetState


def slice_problem(state: ForgetState, key: str, piece: Tensor, where: tuple[int, PerClass] | None) -> str | None:
    """What is wrong with one kept slice (None: nothing)."""
    if where is None:
        return f"{key!r} is not one class's slice of a per-class tensor"
    index, spec = where
    tensor = state.tensors(index, spec.file).get(spec.name)
    narrower = tensor is None and spec.carried  # a carried run's state, kept from a stage whose totals are superseded
    if narrower:
        tensor = state.tensors(state.indices[-1], spec.file).get(spec.name)
    if not _one_slice(piece, tensor, spec):
        return f"{key!r} is not one class's slice of a per-class tensor"
    if not torch.isfinite(piece).all():
        return f"{key} holds NaN or infinite values"
    return _shape_problem(key, piece, tensor, spec, narrower)


def _one_slice(piece: Tensor, tensor: Tensor | None, spec: PerClass) -> bool:
    """Whether ``piece`` is one slice along the spec's axis, of a dtype the live ``tensor`` takes."""
    # integer slices (a carried run's counts and ranks) only where the live tensor holds that dtype
    same_integers = tensor is not None and not tensor.is_floating_point() and piece.dtype == tensor.dtype
    return piece.dim() > spec.axis and piece.shape[spec.axis] == 1 and (piece.is_floating_point() or same_integers)


def _shape_problem(key: str, piece: Tensor, tensor: Tensor | None, spec: PerClass, narrower: bool) -> str | None:
    """A slice shaped unlike one of the live ``tensor`` (None: it fits, or there is no tensor to fit)."""
    expected = None if tensor is None else tensor.shape[: spec.axis] + (1,) + tensor.shape[spec.axis + 1 :]
    fits = expected is None or tuple(piece.shape) == tuple(expected)
    if narrower and expected is not None and piece.dim() == len(expected):  # a Gaussian's directions, fewer then
        fits = all(w <= n for w, n in zip(piece.shape, expected))
    if not fits:
        return f"{key} has shape {tuple(piece.shape)}, expected {tuple(expected)}"
    return None
