"""A run directory is untrusted input (issue 14, items 1, 6, 7, 8), through the public CLI.

Links inside a run are never followed (exit 5), ``init`` never takes over a user's folder or file
(exit 7), no output lands inside a run (exit 2), and leftovers are moved aside, never deleted.
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drlcli import learn_stage
from drlcli.cli import app
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

runner = CliRunner()
TINY_ARGS = ["--ptm", TINY_PTM] + [a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")]
FAST = ["--epochs", "2", "--batch-size", "12", "--device", "cpu"]
RESUME = ["--epochs", "3", "--batch-size", "12", "--device", "cpu"]  # the interrupted stage 3's options
PLANTED = (".staging", ".quarantine")  # names a run uses that a finished run does not hold


def drl(*args):
    return runner.invoke(app, [str(a) for a in args])


class Interrupt(Exception):
    pass


def _stop_at_epoch_3(event):
    if event.phase == "train" and event.epoch == 3:
        raise Interrupt


@dataclass(frozen=True)
class Template:
    run: Path
    manifest_after_stage_1: bytes
    stage_3_data: Path


@pytest.fixture(scope="module")
def template(tmp_path_factory, stage_folders, trains_file) -> Template:
    """Two committed stages and the checkpoint of a stage 3 interrupted after epoch 2 (stages trained)."""
    run = tmp_path_factory.mktemp("hostile") / "run"
    assert drl("init", "--run", run, *TINY_ARGS, "--random-init", "--config", trains_file).exit_code == 0
    after_first = b""
    for train, test in stage_folders[:2]:
        result = drl("learn-stage", "--run", run, "--data", train, "--eval-data", test, *FAST)
        assert result.exit_code == 0, result.stderr
        after_first = after_first or (run / "manifest.json").read_bytes()
    with pytest.raises(Interrupt):
        learn_stage(
            run,
            data_dir=stage_folders[2][0],
            train_overrides={"epochs": 3, "batch_size": 12},
            device="cpu",
            progress=_stop_at_epoch_3,
        )
    assert any((run / ".checkpoint").glob("*.safetensors"))
    return Template(run, after_first, stage_folders[2][0])


def _copy(template: Template, target: Path) -> Path:
    shutil.copytree(template.run, target, symlinks=True)
    return target


def snapshot(path: Path) -> dict[str, bytes | None]:
    """Every file (bytes), folder (None) and link (its target) under ``path``, links not followed."""
    if path.is_symlink() or path.is_file():
        return {".": os.readlink(path).encode() if path.is_symlink() else path.read_bytes()}
    out: dict[str, bytes | None] = {".": None}
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            item = Path(folder, name)
            rel = str(item.relative_to(path))
            if item.is_symlink():
                out[rel] = b"link:" + os.readlink(item).encode()
            else:
                out[rel] = None if item.is_dir() else item.read_bytes()
    return out


def _entries(run: Path) -> list[str]:
    """Every file and folder the run holds, plus the run's own folder names it does not hold now."""
    found = [str(p.relative_to(run)) for p in sorted(run.rglob("*"))]
    return found + [name for name in PLANTED if name not in found]


def _commands(run: Path, out: Path, data: Path, image: Path) -> dict[str, list]:
    return {
        "init": ["init", "--run", run, *TINY_ARGS, "--random-init"],
        "init --allow-nonempty": ["init", "--run", run, *TINY_ARGS, "--random-init", "--allow-nonempty"],
        "learn-stage": ["learn-stage", "--run", run, "--data", data, *RESUME],
        "learn-stage --restart": ["learn-stage", "--run", run, "--data", data, *RESUME, "--restart"],
        "export": ["export", "--run", run, "--out", out / "m.drl"],
        "eval": ["eval", "--run", run, "--all-seen", "--device", "cpu"],
        "predict": ["predict", "--run", run, image, "--device", "cpu"],
        "verify": ["verify", "--run", run],
        "info": ["info", "--run", run],
    }


def _plant_link(run: Path, entry: str, decoy: Path) -> None:
    """Replace ``run/entry`` by a link to ``decoy``, a copy of it outside the run (or a user's folder)."""
    target = run / entry
    if target.is_dir():
        shutil.copytree(target, decoy)
        shutil.rmtree(target)
    elif target.exists():
        shutil.copy2(target, decoy)
        target.unlink()
    else:
        decoy.mkdir()
        (decoy / "user.txt").write_text("the user's own file\n")
    target.symlink_to(decoy)


def test_unchanged_copy_of_the_template_works(template, tmp_path, stage_folders):
    """The control for the walk below: on the run itself, every command does its work."""
    image = next(stage_folders[0][1].rglob("*.png"))
    for name, args in _commands(_copy(template, tmp_path / "run"), tmp_path, template.stage_3_data, image).items():
        result = drl(*args)
        expected = 7 if name.startswith("init") else 0  # init: the folder already holds a run
        assert result.exit_code == expected, (name, result.stderr)
        if name == "learn-stage":
            assert "resumed from the checkpoint after epoch 2" in result.stdout


def test_no_link_in_a_run_is_ever_followed(template, tmp_path, stage_folders):
    """Each file and folder of the run in turn becomes a link to a copy of it outside the run; every
    command leaves that copy byte-identical and refuses the run (exit 5 naming the link; init on a
    run refuses with 7 when the link is below the top level, which it does not look at)."""
    image = next(stage_folders[0][1].rglob("*.png"))
    entries = _entries(template.run)
    assert {".lock", "stages/002/weights.safetensors", ".checkpoint/checkpoint.json", ".staging"} <= set(entries)
    failures = []
    for i, entry in enumerate(entries):
        for name in _commands(template.run, tmp_path, template.stage_3_data, image):
            case = f"{i}-{name.replace(' ', '')}"  # runs at the template's depth: eval data stays found
            run, decoy = _copy(template, tmp_path / f"run-{case}"), tmp_path / f"decoy-{case}"
            _plant_link(run, entry, decoy)
            before = snapshot(decoy)
            result = drl(*_commands(run, tmp_path / f"out-{case}", template.stage_3_data, image)[name])
            top_level = "/" not in entry
            expected = 5 if top_level or not name.startswith("init") else 7
            if snapshot(decoy) != before:
                failures.append(f"{name} on {entry}: the decoy outside the run changed")
            if result.exit_code != expected or (expected == 5 and f"{entry} is a symbolic link" not in result.stderr):
                failures.append(f"{name} on {entry}: exit {result.exit_code} ({result.stderr.strip()[:200]})")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------ item 1: links


@pytest.mark.parametrize("entry", [".lock", "stages", ".checkpoint", ".staging"])
def test_link_in_the_run_is_refused_even_by_a_command_that_then_fails(template, tmp_path, entry):
    run, decoy = _copy(template, tmp_path / "run"), tmp_path / "decoy"
    _plant_link(run, entry, decoy)
    before = snapshot(decoy)
    (tmp_path / "empty").mkdir()
    result = drl("learn-stage", "--run", run, "--data", tmp_path / "empty", *FAST)  # would fail validation (3)
    assert result.exit_code == 5 and f"{run / entry} is a symbolic link" in result.stderr
    assert "replace it with the run's own file or folder" in result.stderr
    assert snapshot(decoy) == before


def test_lock_that_is_a_hard_link_is_refused(template, tmp_path):
    run = _copy(template, tmp_path / "run")
    user_file = tmp_path / "notes.txt"
    user_file.write_text("mine\n")
    (run / ".lock").unlink()
    os.link(user_file, run / ".lock")
    result = drl("learn-stage", "--run", run, "--data", template.stage_3_data, *RESUME)
    assert result.exit_code == 5 and "other hard links" in result.stderr
    assert user_file.read_text() == "mine\n"


def test_cleaning_deletes_only_its_own_names_and_moves_the_rest_aside(template, tmp_path):
    run = _copy(template, tmp_path / "run")
    (run / "stages" / "notes.txt").write_text("user notes\n")
    (run / ".checkpoint" / "mine.bin").write_bytes(b"user bytes")
    debris = run / ".staging" / ("ab" * 16)
    debris.mkdir(parents=True)
    (debris / "manifest.json").write_text("{}")  # an interrupted commit's own staging: deleted
    (tmp_path / "empty").mkdir()
    result = drl("learn-stage", "--run", run, "--data", tmp_path / "empty", *FAST)
    assert result.exit_code == 3  # the empty data folder, after the tidy-up
    moved = {str(p.relative_to(run / ".quarantine")).split("/", 1)[1]: p for p in run.glob(".quarantine/*/*/*")}
    assert set(moved) == {"stages/notes.txt", ".checkpoint/mine.bin"}
    assert moved["stages/notes.txt"].read_text() == "user notes\n"
    assert moved[".checkpoint/mine.bin"].read_bytes() == b"user bytes"
    assert not (run / ".staging").exists() and not (run / "stages" / "notes.txt").exists()
    assert result.stderr.count("warning: ") == 2 and "instead of deleting it" in result.stderr
    assert drl("verify", "--run", run).exit_code == 0  # the checkpoint is kept, the run intact


# ------------------------------------------------------------------------ item 6: init


def test_init_refuses_a_folder_holding_a_users_files(tmp_path, monkeypatch):
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "ptm.safetensors").write_bytes(b"the user's weights")
    monkeypatch.chdir(folder)  # the default --run is the current folder
    result = drl("init", *TINY_ARGS, "--random-init")
    assert result.exit_code == 7 and "ptm.safetensors exists and is not drl's" in result.stderr
    result = drl("init", *TINY_ARGS, "--random-init", "--allow-nonempty")
    assert result.exit_code == 7  # a user's file under a run's own name is never taken over
    assert sorted(os.listdir(folder)) == ["ptm.safetensors"]  # not even a lock file was made
    assert (folder / "ptm.safetensors").read_bytes() == b"the user's weights"


def test_init_in_a_non_empty_folder_needs_allow_nonempty_and_keeps_the_files(tmp_path, stage_folders):
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "notes.txt").write_text("mine\n")
    result = drl("init", "--run", run, *TINY_ARGS, "--random-init")
    assert result.exit_code == 7 and "is not empty (it holds data, notes.txt)" in result.stderr
    assert "--allow-nonempty" in result.stderr and sorted(os.listdir(run)) == ["data", "notes.txt"]
    assert drl("init", "--run", run, *TINY_ARGS, "--random-init", "--allow-nonempty").exit_code == 0
    result = drl("learn-stage", "--run", run, "--data", stage_folders[0][0], *FAST)
    assert result.exit_code == 0 and "warning" not in result.stderr
    assert (run / "notes.txt").read_text() == "mine\n" and (run / "data").is_dir()


def test_init_after_a_failed_init_reuses_its_leftovers(tmp_path):
    """A failed init removes the folder it made (issue 30); in a folder that was there, its lock
    stays, and the next init takes it over."""
    run = tmp_path / "run"
    result = drl("init", "--run", run, *TINY_ARGS, "--ptm-weights", tmp_path / "missing.safetensors")
    assert result.exit_code == 6 and not run.exists()
    run.mkdir()
    result = drl("init", "--run", run, *TINY_ARGS, "--ptm-weights", tmp_path / "missing.safetensors")
    assert result.exit_code == 6 and (run / ".lock").exists()
    assert drl("init", "--run", run, *TINY_ARGS, "--random-init").exit_code == 0


# -------------------------------------------------------------------- item 7: outputs


def test_export_inside_a_run_is_refused(template, tmp_path):
    run = _copy(template, tmp_path / "run")
    other = _copy(template, tmp_path / "other")
    (tmp_path / "into-run").symlink_to(run)
    (tmp_path / "m.drl").symlink_to(run / "manifest.json")
    before = snapshot(run)
    for out in (
        run / "manifest.json",
        run / "stages" / "m.drl",
        tmp_path / "into-run" / "m.drl",  # a link in the out path's parents
        tmp_path / "m.drl",  # a link that resolves into the run
        other / "m.drl",  # any run, not only the one exported
    ):
        result = drl("export", "--run", run, "--out", out)
        assert result.exit_code == 2, (out, result.stderr)
        assert "is inside the drl run directory" in result.stderr and "pick a path outside it" in result.stderr
    result = drl("eval", "--run", run, "--all-seen", "--plot", run / "accuracy.png")
    assert result.exit_code == 2 and "--plot" in result.stderr and "inside the drl run directory" in result.stderr
    assert snapshot(run) == before
    assert drl("verify", "--run", run).exit_code == 0


# ------------------------------------------------------------------- item 8: rollback


def test_failed_writer_after_a_manifest_rollback_moves_the_newer_stage_aside(template, tmp_path):
    run = _copy(template, tmp_path / "run")
    stage_2 = snapshot(run / "stages" / "002")
    (run / "manifest.json").write_bytes(template.manifest_after_stage_1)  # restored from an older backup
    (tmp_path / "empty").mkdir()
    result = drl("learn-stage", "--run", run, "--data", tmp_path / "empty", *FAST)
    assert result.exit_code == 3
    (kept,) = run.glob(".quarantine/*/stages/002")
    assert snapshot(kept) == stage_2 and not (run / "stages" / "002").exists()
    assert f"warning: {run / 'stages' / '002'} is not part of the run (not listed in manifest.json" in result.stderr
    assert str(kept) in result.stderr
    out = json.loads(drl("verify", "--run", run, "--json").stdout)
    # what stage 2's commit superseded (stage 1's running totals) is gone: a manifest restored alone
    # cannot bring it back, and the run says so instead of answering from a partial state
    assert not out["ok"] and "stages/001/totals.safetensors" in json.dumps(out)
