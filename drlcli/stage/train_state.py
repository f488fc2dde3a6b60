"""Everything needed to continue training after an epoch bit for bit: the stage's and classifier's
parameters, the optimiser's momentum, every random generator (torch's, Python's, the loader's) and
fp16's loss scale, as named tensors for the epoch checkpoint."""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..errors import RunStateError

if TYPE_CHECKING:
    from .train import _Loop


@dataclass(frozen=True)
class TrainState:
    """Everything needed to continue training after ``epoch`` finished epochs, bit for bit."""

    epoch: int
    # stage.*, classifier.*, momentum.<i>, rng.torch, rng.python, rng.loader (+ scaler.* for fp16)
    tensors: dict[str, Tensor]
    epoch_losses: list[float]
    seconds: float
    steps: int
    lr: float | None = None  # the learning rate epoch ``epoch`` ran at (for logs; not kept in checkpoints)


def capture(
    stage: nn.Module, classifier: nn.Module, loop: _Loop, generator: torch.Generator, device: torch.device
) -> dict[str, Tensor]:
    """The tensors of a ``TrainState``: parameters, momentum buffers and RNG states (``restore``'s inverse)."""
    tensors = {f"stage.{k}": v for k, v in stage.state_dict().items()}
    tensors.update({f"classifier.{k}": v for k, v in classifier.state_dict().items()})
    for i, p in enumerate(loop.params):
        if "momentum_buffer" in loop.optimizer.state[p]:
            tensors[f"momentum.{i}"] = loop.optimizer.state[p]["momentum_buffer"]
    tensors["rng.torch"] = torch.get_rng_state()
    if device.type == "cuda":  # EASE's dropout draws on the GPU
        tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    tensors["rng.loader"] = generator.get_state()
    tensors.update(_python_random_state())
    if loop.scaler is not None:  # fp16: resume with the loss scale reached, not the initial one
        state = loop.scaler.state_dict()
        tensors["scaler.scale"] = torch.tensor(state["scale"], dtype=torch.float64)
        tensors["scaler.growth_tracker"] = torch.tensor(state["_growth_tracker"], dtype=torch.int64)
    return tensors


@contextlib.contextmanager
def fork_python_random() -> Iterator[None]:
    """Python's ``random`` state is given back as it was (as ``torch.random.fork_rng`` does for torch's)."""
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)


def _python_random_state() -> dict[str, Tensor]:
    """Python's ``random`` state as tensors: rng.python, its 625 Mersenne Twister words (and
    rng.python_gauss, the cached normal deviate, when there is one)."""
    _, words, gauss = random.getstate()
    out = {"rng.python": torch.tensor(words, dtype=torch.int64)}
    if gauss is not None:
        out["rng.python_gauss"] = torch.tensor([gauss], dtype=torch.float64)
    return out


def _set_python_random_state(tensors: dict[str, Tensor]) -> None:
    gauss = tensors["rng.python_gauss"].item() if "rng.python_gauss" in tensors else None
    random.setstate((3, tuple(int(w) for w in tensors["rng.python"].tolist()), gauss))


def restore(
    resume: TrainState,
    stage: nn.Module,
    classifier: nn.Module,
    loop: _Loop,
    generator: torch.Generator,
    device: torch.device,
) -> None:
    """Put parameters, momentum, schedule and RNG states back as they were after ``resume.epoch``.
    A checkpoint that does not fit (another drl version, a hand-made file) is refused naming --restart."""
    t = resume.tensors
    try:
        stage.load_state_dict({k[6:]: v for k, v in t.items() if k.startswith("stage.")})
        classifier.load_state_dict({k[11:]: v for k, v in t.items() if k.startswith("classifier.")})
        _restore_momentum(t, loop)
        torch.set_rng_state(t["rng.torch"])
        if device.type == "cuda" and "rng.cuda" in t:
            torch.cuda.set_rng_state(t["rng.cuda"], device)
        generator.set_state(t["rng.loader"])
        _set_python_random_state(t)
        if loop.scaler is not None:
            scale, tracker = float(t["scaler.scale"]), int(t["scaler.growth_tracker"])
            loop.scaler.load_state_dict({**loop.scaler.state_dict(), "scale": scale, "_growth_tracker": tracker})
    except (RuntimeError, KeyError, ValueError, TypeError, OverflowError) as exc:
        raise RunStateError(
            f"the epoch checkpoint after epoch {resume.epoch} does not fit this stage ({str(exc).splitlines()[0]}); "
            "pass --restart to discard it"
        ) from exc
    with warnings.catch_warnings():  # replaying the schedule, no optimizer step is due
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(resume.epoch):
            loop.schedule.step()


def _restore_momentum(tensors: dict[str, Tensor], loop: _Loop) -> None:
    """The optimiser's momentum buffers, each of its parameter's shape (ValueError otherwise)."""
    for i, p in enumerate(loop.params):
        buffer = tensors.get(f"momentum.{i}")
        if buffer is None:
            continue
        if buffer.shape != p.shape:
            raise ValueError(f"momentum.{i} has shape {tuple(buffer.shape)}, expected {tuple(p.shape)}")
        loop.optimizer.state[p]["momentum_buffer"] = buffer.to(p.device).clone()
