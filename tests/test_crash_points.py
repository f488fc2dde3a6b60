"""Crash points: the storage layer fails at call k, for every k of a learn-stage that commits (issue 16).

Whatever single file operation a crash or an I/O error interrupts, the run stays valid (``verify``
passes, it loads) and holds either the previous stages or the new one, never a mix; running the same
``learn-stage`` again then completes the stage, with the weights of an uninterrupted run.

A crash is simulated: from call k on, every storage operation raises ``Crash`` (a BaseException,
which no cleanup handler catches), so nothing after the crash point reaches the disk, as if the
process had died there. An I/O error fails call k alone (the process lives and cleans up). Real
SIGKILLs at random moments: tests/test_fault_injection.py (marked slow).
"""

from __future__ import annotations

import errno
import shutil

import pytest
import torch
from conftest import FROZEN, TRAINS

from drlcli import learn_stage, storage
from drlcli.api import verify
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.errors import StorageError
from drlcli.run.directory import RunDir
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

OPTS = {"epochs": 2, "batch_size": 8}
# every primitive a run writer calls (write_atomic and discard are built from them)
PRIMITIVES = ("write_new", "replace", "rename", "fsync_dir", "make_dir", "remove", "remove_dir_if_empty")


class Crash(BaseException):
    """The process dies here."""


class Interrupt(Exception):
    pass


class FailAt:
    """Counts storage calls; fails call ``k`` (``mode`` "crash": that call and every later one;
    "full": a full disk, every write from call ``k`` on fails with ENOSPC while renames and deletes
    still work)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.k: int | None = None
        self.mode = "crash"
        self.calls: list[str] = []
        for name in PRIMITIVES:
            monkeypatch.setattr(storage, name, self._wrap(name, getattr(storage, name)))

    def arm(self, k: int | None, mode: str = "crash") -> None:
        self.k, self.mode, self.calls = k, mode, []

    def _wrap(self, name, real):
        def call(*args, **kwargs):
            self.calls.append(name)
            n = len(self.calls)
            if self.mode == "full" and self.k is not None and n >= self.k and name in ("write_new", "make_dir"):
                raise OSError(errno.ENOSPC, f"No space left on device (injected at storage call {n}, {name})")
            if self.mode != "full" and self.k is not None and (n == self.k or (self.mode == "crash" and n > self.k)):
                if self.mode == "crash":
                    raise Crash(f"crash at storage call {self.k} ({name})")
                if name == "remove_dir_if_empty":  # it ignores its own errors: the folder just stays
                    return None
                raise OSError(errno.EIO, f"Input/output error (injected at storage call {n}, {name})")
            return real(*args, **kwargs)

        return call


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """Stage 1 committed; stage 2 trained to its last epoch (checkpointed) and interrupted before its
    prototypes, so that each learn-stage below goes straight to prototypes, evaluation and commit."""
    root = tmp_path_factory.mktemp("crash-points")
    data = [make_class_folders(root / f"stage{i}", [2 * i, 2 * i + 1], images_per_class=4) for i in (1, 2)]
    run = root / "run"
    # the default drl recipe (its ridge head writes statistics.safetensors in every commit), with a
    # narrow projection: the storage calls are the same, the solve is instant
    config = RunConfig.for_method("drl", {"ridge": {"proj_dim": 32}, **TRAINS}, preset=FROZEN)
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    learn_stage(run, data_dir=data[0], train_overrides=OPTS, device="cpu")

    def stop_before_prototypes(event):
        if event.phase == "prototypes":
            raise Interrupt

    with pytest.raises(Interrupt):
        learn_stage(run, data_dir=data[1], train_overrides=OPTS, device="cpu", progress=stop_before_prototypes)
    assert verify(run).interrupted_stage == {"stage": 2, "epoch": 2, "epochs": 2}
    return run, data[1]


def _tensors(run, index):
    return RunDir(run).stage(index).tensors


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check_state(run, stage_1, reference) -> list[int]:
    """The run verifies, holding stage 1 as it was and stage 2 whole or not at all (the re-run loads it)."""
    verify(run)  # raises IntegrityError naming any damage
    stages = RunDir(run).stage_indices()
    assert stages in ([1], [1, 2]), stages
    assert _same(_tensors(run, 1), stage_1)
    if stages == [1, 2]:
        assert _same(_tensors(run, 2), reference)
    return stages


@pytest.mark.parametrize("mode", ["crash", "error"])
def test_a_failure_at_any_storage_call_of_a_commit_leaves_a_valid_run(template, tmp_path, monkeypatch, mode):
    source, data = template
    stage_1 = _tensors(source, 1)
    faults = FailAt(monkeypatch)
    straight = shutil.copytree(source, tmp_path / "straight")
    faults.arm(None)
    assert learn_stage(straight, data_dir=data, train_overrides=OPTS, device="cpu").resumed_from_epoch == 2
    reference, num_calls = _tensors(straight, 2), len(faults.calls)
    assert {"write_new", "replace", "fsync_dir", "remove"} <= set(faults.calls), faults.calls
    outcomes = set()
    for k in range(1, num_calls + 1):
        run = shutil.copytree(source, tmp_path / f"k{k:02d}")
        faults.arm(k, mode)
        try:
            learn_stage(run, data_dir=data, train_overrides=OPTS, device="cpu")
        except Crash:
            assert mode == "crash"
        except StorageError as exc:  # an I/O error is reported as one, naming what happened
            assert mode == "error" and "(injected at storage call" in str(exc), (k, exc)
        faults.arm(None)
        stages = _check_state(run, stage_1, reference)
        outcomes.add(len(stages))
        again = learn_stage(run, data_dir=data, train_overrides=OPTS, device="cpu")
        assert again.status == ("unchanged" if stages == [1, 2] else "learned"), (k, again.status)
        assert RunDir(run).stage_indices() == [1, 2] and _same(_tensors(run, 2), reference), k
        verify(run)
        shutil.rmtree(run)
    assert outcomes == {1, 2}  # some crash points come before the commit point, some after
