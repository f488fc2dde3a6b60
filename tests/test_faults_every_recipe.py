"""Every recipe under faults, the default first: a crash, an I/O error or a full disk at every
storage call of a ``learn-stage`` and a ``forget`` leaves a run that ``verify``, ``eval`` and
``predict`` accept, answering as before the command or as after it, and the same command run again
completes it. A switched run (the default) commits its frozen track's files with its own, in one
commit (``run/track.py``; format 5: beside its own in its stage folders): no fault leaves the two
tracks apart.

The faults come from ``test_crash_points.FailAt`` (from call k on for a crash and a full disk; call k
alone for an I/O error)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_crash_points import Crash, FailAt

from drlcli import evaluate, forget_class, learn_stage
from drlcli.api import predict_sources, verify
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.errors import StorageError
from drlcli.run.directory import RunDir
from drlcli.run.load import load_run
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

SMALL = {"ridge": {"proj_dim": 32, "carry_draws": 2, "carry_rank": 2}, "train": {"epochs": 1, "batch_size": 8}}
# (method, preset): every recipe a user can name, the default (drl's switched preset) first
RECIPES = [
    ("drl", None),
    ("drl", "frozen"),
    ("drl", "carried"),
    ("drl", "paper"),
    ("ranpac", None),
    ("ranpac", "published"),
    ("ease", None),
    ("simplecil", None),
]
# a full disk (the issue that found two commits a stage) runs in the default suite at every third storage
# call and its last (the sweep's outcomes must still hold both states); every call, and the other
# faults, with the slow tests
MODES = [
    pytest.param("full", 3),
    pytest.param("full", 1, marks=pytest.mark.slow),
    pytest.param("crash", 1, marks=pytest.mark.slow),
    pytest.param("error", 1, marks=pytest.mark.slow),
]


def _config(method: str, preset: str | None) -> RunConfig:
    sections = {k: v for k, v in SMALL.items() if k != "ridge" or method in ("drl", "ranpac")}
    return RunConfig.for_method(method, sections, preset=preset)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults-data")
    stages = [make_class_folders(root / f"stage{i}", [2 * i, 2 * i + 1], images_per_class=4) for i in (1, 2)]
    test = make_class_folders(root / "test", [3], images_per_class=2, seed=7)  # a class every state answers for
    return stages, test


class _Templates(dict):
    """Per recipe, made when first asked for: a run with stage 1 learned (``before``) and the same run
    with stage 2 (``after``)."""

    def __init__(self, root: Path, data):
        super().__init__()
        self.root, self.data = root, data

    def __missing__(self, recipe: tuple[str, str | None]) -> tuple[Path, Path]:
        method, preset = recipe
        before = self.root / f"{method}-{preset}" / "before"
        init_run(before, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=_config(method, preset))
        learn_stage(before, data_dir=self.data[0][0], device="cpu")
        after = Path(shutil.copytree(before, before.parent / "after"))
        learn_stage(after, data_dir=self.data[0][1], device="cpu")
        self[recipe] = before, after
        return before, after


@pytest.fixture(scope="module")
def templates(tmp_path_factory, data):
    return _Templates(tmp_path_factory.mktemp("faults-runs"), data)


def _answers(run: Path, test: Path, *, commands: bool = True) -> tuple[list[str], torch.Tensor]:
    """The run as a user reads it: verify passes, eval and predict answer (``commands``); its
    classes and its scores of three fixed images."""
    verify(run)
    if commands:
        evaluate(run, data_dir=test, device="cpu")
        predictions = list(predict_sources([str(test)], run_dir=run, device="cpu"))
        assert predictions and all(p.error is None for p in predictions)
    model = load_run(run, device="cpu").model
    images = torch.rand(3, 3, *model.data_config["input_size"][1:], generator=torch.Generator().manual_seed(0))
    return list(model.class_names), model.classify(images)[0]


def _same(a, b) -> bool:
    return a[0] == b[0] and torch.allclose(a[1], b[1], atol=1e-5)


def _sweep(
    faults: FailAt, mode: str, source: Path, tmp_path: Path, command, states: list, test: Path, every: int = 1
) -> set[int]:
    """Fail every storage call (with ``every`` k: every k-th and the last) of ``command(run)`` in turn (on a copy of ``source``): each time the run
    verifies and answers as one of ``states`` (its index is returned; a run whose manifest is the
    source's, byte for byte, reads the source's listed files: the first state, once it verifies). Where the outcome changes, and
    at every eighth call tried, ``eval`` and ``predict`` answer too and, where the run is at an earlier
    state, ``command`` run again reaches the last one."""
    faults.arm(None)
    command(Path(shutil.copytree(source, tmp_path / "count")))
    num_calls = len(faults.calls)
    untouched = (source / "manifest.json").read_bytes()
    outcomes: list[int] = []
    for tried, k in enumerate(sorted({*range(1, num_calls + 1, every), num_calls}), start=1):
        run = Path(shutil.copytree(source, tmp_path / f"k{mode}{k:03d}"))
        faults.arm(k, mode)
        try:
            command(run)
        except Crash:
            assert mode == "crash"
        except StorageError as exc:
            assert mode != "crash" and "(injected at storage call" in str(exc), (k, exc)
        faults.arm(None)
        if (run / "manifest.json").read_bytes() == untouched:  # nothing committed: the first state's files
            verify(run)
            matches = [0]
        else:
            found = _answers(run, test, commands=False)
            matches = [i for i, answers in enumerate(states) if _same(found, answers)]
        assert matches, (k, mode, faults.calls[k - 1] if k <= len(faults.calls) else None)
        if not outcomes or matches[0] != outcomes[-1] or tried % 8 == 0 or k == num_calls:
            _answers(run, test)
            if matches[0] != len(states) - 1:  # a command that completed is not run again (forget refuses it)
                command(run)
            assert _same(_answers(run, test, commands=False), states[-1]), k
        outcomes.append(matches[0])
        shutil.rmtree(run)
    return set(outcomes)


@pytest.mark.parametrize(("mode", "every"), MODES)
def test_the_default_survives_a_fault_at_every_storage_call_of_learn_stage(
    templates, data, tmp_path, monkeypatch, mode, every
):
    before, after = templates["drl", None]
    test = data[1]
    states = [_answers(before, test), _answers(after, test)]
    faults = FailAt(monkeypatch)
    learn = lambda run: learn_stage(run, data_dir=data[0][1], device="cpu")  # noqa: E731
    assert _sweep(faults, mode, before, tmp_path, learn, states, test, every) == {0, 1}


@pytest.mark.parametrize(("mode", "every"), MODES)
def test_the_default_survives_a_fault_at_every_storage_call_of_forget(
    templates, data, tmp_path, monkeypatch, mode, every
):
    _, after = templates["drl", None]
    test = data[1]
    forgotten = Path(shutil.copytree(after, tmp_path / "forgotten"))
    forget_class(forgotten, "class_02", purge=mode == "full")
    states = [_answers(after, test), _answers(forgotten, test)]
    faults = FailAt(monkeypatch)

    def forget(run: Path) -> None:
        forget_class(run, "class_02", purge=mode == "full")

    assert _sweep(faults, mode, after, tmp_path, forget, states, test, every) == {0, 1}
    manifest = RunDir(forgotten).manifest()  # the frozen track beside the run's files, in its manifest
    assert manifest["format_version"] == 5 and "forgotten/frozen-log-g000004.json" in manifest["files"]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "preset"), RECIPES[1:])
def test_every_recipe_survives_a_crash_at_every_storage_call_of_learn_stage(
    templates, data, tmp_path, monkeypatch, method, preset
):
    before, after = templates[method, preset]
    test = data[1]
    states = [_answers(before, test), _answers(after, test)]
    faults = FailAt(monkeypatch)
    learn = lambda run: learn_stage(run, data_dir=data[0][1], device="cpu")  # noqa: E731
    assert _sweep(faults, "crash", before, tmp_path, learn, states, test) == {0, 1}
