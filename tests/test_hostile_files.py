"""Hostile files (issue 30): writes through planted links, checkpoints and records crafted byte by
byte, documents nested to exhaust the parser, tensors of dtypes drl never writes, special files and
sparse giants where drl reads, PTM shapes no machine holds, and readers racing ``drl forget``.

Each test fails on the release before issue 30 and passes after it.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save
from typer.testing import CliRunner

from drlcli import api, learn_stage, storage
from drlcli.cli import app
from drlcli.commands.forget import forget_class, restore_class
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.errors import IntegrityError, UsageError
from drlcli.run.directory import RunDir
from drlcli.run.layout import CHECKPOINT, CHECKPOINT_META, sha256_bytes
from drlcli.run.trackdir import TrackDir
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

runner = CliRunner()
OPTS = {"epochs": 2, "batch_size": 12}
NESTED = b"[" * 200_000


def drl(*args):
    return runner.invoke(app, [str(a) for a in args])


class Interrupt(Exception):
    pass


def _stop_after_epoch_1(event):
    if event.phase == "train" and event.epoch == 2:
        raise Interrupt


def _interrupted(run_dir: Path, train: Path) -> None:
    with pytest.raises(Interrupt):
        learn_stage(run_dir, data_dir=train, train_overrides=OPTS, device="cpu", progress=_stop_after_epoch_1)


def _relist(run: Path, name: str) -> None:
    """List ``run/name``'s present bytes in the manifest (a crafted run whose checksums agree)."""
    manifest = json.loads((run / "manifest.json").read_text())
    data = (run / name).read_bytes()
    manifest["files"][name] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (run / "manifest.json").write_text(json.dumps(manifest))


# ------------------------------------------------------------------ 1. writes through planted names


def test_a_hard_link_at_the_checkpoint_temporary_name_is_never_written_through(run_dir, stage_folders, tmp_path):
    """Before: learn-stage wrote the checkpoint JSON into a hard link planted at
    .checkpoint/.checkpoint.json.tmp, i.e. into the linked file outside the run."""
    outside = tmp_path / "outside.txt"
    outside.write_text("the user's file\n")
    (run_dir / CHECKPOINT).mkdir()
    os.link(outside, run_dir / CHECKPOINT / f".{CHECKPOINT_META}.tmp")
    _interrupted(run_dir, stage_folders[0][0])  # one epoch checkpointed
    assert outside.read_text() == "the user's file\n"
    assert outside.stat().st_nlink == 1  # the planted name was tidied away (unlinked, never written)


def test_a_fifo_at_the_checkpoint_temporary_name_does_not_hang(run_dir, stage_folders):
    """Before: a FIFO planted there hung learn-stage after epoch 1 while it held the writer lock."""
    (run_dir / CHECKPOINT).mkdir()
    os.mkfifo(run_dir / CHECKPOINT / f".{CHECKPOINT_META}.tmp")
    result = learn_stage(run_dir, data_dir=stage_folders[0][0], train_overrides=OPTS, device="cpu")
    assert result.status == "learned"


def test_write_atomic_never_writes_into_an_existing_file(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    target = tmp_path / "model.drl"
    os.link(outside, tmp_path / "tmp-planted")
    with pytest.raises(IntegrityError, match="already exists"):
        storage.write_atomic(target, b"new", tmp=tmp_path / "tmp-planted")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(IntegrityError, match="already exists"):
        storage.write_atomic(target, b"new", tmp=tmp_path / "fifo")
    assert outside.read_text() == "keep\n" and not target.exists()
    storage.write_atomic(target, b"new")  # the default temporary name is fresh every time
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# --------------------------------------------------------------------- 3. the checkpoint's own bytes


def test_one_changed_byte_in_the_checkpoint_json_is_never_resumed(run_dir, stage_folders, caplog, monkeypatch):
    """Before: "epoch": 1 -> 4 made the next run resume "after epoch 4" and commit an under-trained stage."""
    import logging

    monkeypatch.setattr(logging.getLogger("drlcli"), "propagate", True)  # a CLI test may have turned it off
    train = stage_folders[0][0]
    _interrupted(run_dir, train)
    path = run_dir / CHECKPOINT / CHECKPOINT_META
    text = path.read_text()
    assert '"epoch": 1' in text
    path.write_text(text.replace('"epoch": 1', '"epoch": 4'))
    result = learn_stage(run_dir, data_dir=train, train_overrides=OPTS, device="cpu")
    assert result.resumed_from_epoch is None and len(result.epoch_losses) == OPTS["epochs"]
    assert "does not match its checksum" in caplog.text and "starts over" in caplog.text


# ------------------------------------------------------------------- 4. readers beside drl forget


def _forgetting_run(tmp_path: Path, stage_folders) -> tuple[Path, str]:
    run = tmp_path / "run"
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS)
    for train, _ in stage_folders[:2]:
        learn_stage(run, data_dir=train, train_overrides=OPTS, device="cpu")
    return run, RunDir(run).stage_meta(1)["classes"][0]


def test_a_reader_whose_generation_is_superseded_mid_read_reads_it_whole(tmp_path, stage_folders, monkeypatch):
    """Deterministic: a forget commits (and deletes the files it superseded) right after the reader
    took its manifest. Before: exit 5 "weights-g….safetensors is missing ... restore it from a backup".
    The reader answers from the generation it started with, whole; the next read sees the forget."""
    run, name = _forgetting_run(tmp_path, stage_folders)
    real = RunDir.stage
    fired = []

    def stage_after_a_forget(self, index, manifest=None):
        if not fired:
            fired.append(True)
            forget_class(run, name)  # another process's commit, between this reader's manifest and files
        return real(self, index, manifest)

    monkeypatch.setattr(RunDir, "stage", stage_after_a_forget)
    before = RunDir(run).manifest()["generation"]
    loaded = api.load_run(run, device="cpu")
    assert fired and name in loaded.model.class_names  # the generation it took, whole
    assert RunDir(run).manifest()["generation"] == before + 1
    assert name not in api.load_run(run, device="cpu").model.class_names


def test_a_forget_mid_read_of_the_frozen_track_sends_the_reader_to_the_newer_generation(
    tmp_path, stage_folders, monkeypatch
):
    """Deterministic, a switched run (the default): another process's forget commits (both tracks, one
    commit) right after this reader took the run's manifest and began on the frozen track, deleting
    the track's superseded forget log. The reader reads the whole newer generation instead."""
    run, name = _forgetting_run(tmp_path, stage_folders)
    assert not (run / "frozen").exists()  # format 5: the track's files beside the run's
    forget_class(run, name)
    restore_class(run, name)  # each track now lists a forget log, which the next forget supersedes
    real, fired = RunDir.stage_meta, []

    def stage_meta_after_a_forget(self, index, manifest=None):
        if isinstance(self, TrackDir) and not fired:
            fired.append("forget")
            forget_class(run, name)
        return real(self, index, manifest)

    monkeypatch.setattr(RunDir, "stage_meta", stage_meta_after_a_forget)
    loaded = api.load_run(run, device="cpu")
    assert fired == ["forget"] and name not in loaded.model.class_names


def test_a_file_gone_before_the_reader_opened_it_sends_it_to_the_newer_generation(tmp_path, stage_folders, monkeypatch):
    """The few milliseconds that can still race: the forget commits between the reader's manifest
    and its opening of the generation's files."""
    run, name = _forgetting_run(tmp_path, stage_folders)
    real = RunDir._pinning
    fired = []

    def pinning_after_a_forget(self, manifest):
        if not fired:
            fired.append(True)
            forget_class(run, name)
        return real(self, manifest)

    monkeypatch.setattr(RunDir, "_pinning", pinning_after_a_forget)
    loaded = api.load_run(run, device="cpu")
    assert fired and name not in loaded.model.class_names


def test_readers_beside_alternating_forget_and_restore_never_fail(tmp_path, stage_folders):
    """Stress: load, info and verify in one thread while another forgets and restores a class."""
    run, name = _forgetting_run(tmp_path, stage_folders)
    stop, errors = threading.Event(), []

    def writer():
        try:
            while not stop.is_set():
                forget_class(run, name)
                restore_class(run, name)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(6):
            api.load_run(run, device="cpu")
            api.info(run)
            api.verify(run)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors


# --------------------------------------------------- 5. nested documents, odd dtypes, non-ViT names


@pytest.mark.parametrize("name", ["stages/001/stage.json", "run.yaml"])
def test_listed_records_nested_too_deep_are_damage(learned_run, tmp_path, name):
    run = Path(shutil.copytree(learned_run, tmp_path / "run"))
    (run / name).write_bytes(NESTED)
    _relist(run, name)
    with pytest.raises(IntegrityError, match="nested too deeply"):
        api.load_run(run, device="cpu")
    assert any("nested too deeply" in p for p in RunDir(run).verify())


def test_an_unlisted_record_nested_too_deep_is_damage_or_ignored(learned_run, tmp_path, run_dir, stage_folders):
    run = Path(shutil.copytree(learned_run, tmp_path / "copy"))
    (run / "manifest.json").write_bytes(NESTED)
    with pytest.raises(IntegrityError, match="nested too deeply"):
        RunDir(run).manifest()
    (run / "manifest.json").write_bytes((learned_run / "manifest.json").read_bytes())
    (run / ".lock").write_bytes(NESTED)  # not a drl lock: never parsed into an error, taken over
    api.info(run)
    _interrupted(run_dir, stage_folders[0][0])
    (run_dir / CHECKPOINT / CHECKPOINT_META).write_bytes(NESTED)
    result = learn_stage(run_dir, data_dir=stage_folders[0][0], train_overrides=OPTS, device="cpu")
    assert result.resumed_from_epoch is None  # damaged: not resumed, the stage starts over


def test_config_files_nested_too_deep_or_endless_are_usage_errors(tmp_path):
    (tmp_path / "deep.yaml").write_bytes(NESTED)
    with pytest.raises(UsageError, match="nested too deeply"):
        RunConfig.from_yaml(tmp_path / "deep.yaml")
    with pytest.raises(UsageError, match="character device, not a regular file"):
        RunConfig.from_yaml(Path("/dev/zero"))
    os.mkfifo(tmp_path / "fifo.yaml")
    with pytest.raises(UsageError, match="FIFO"):
        RunConfig.from_yaml(tmp_path / "fifo.yaml")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.complex64])
def test_a_stage_tensor_of_a_dtype_drl_never_writes_is_damage(learned_run, tmp_path, dtype):
    """Before: a float8 prototype bank crashed predict while verify said intact; complex passed the finite check."""
    run = Path(shutil.copytree(learned_run, tmp_path / "run"))
    name = "stages/001/weights.safetensors"
    tensors = load((run / name).read_bytes())
    tensors["prototypes"] = tensors["prototypes"].to(dtype)
    (run / name).write_bytes(save(tensors))
    _relist(run, name)
    with pytest.raises(IntegrityError, match=f"dtype {dtype}"):
        api.load_run(run, device="cpu")
    assert any(str(dtype) in p for p in RunDir(run).verify())


def test_a_run_naming_a_timm_model_that_is_not_a_vit_is_damage(learned_run, tmp_path):
    """Exit 5 (the file is wrong), not 6 (the PTM could not be had), and refused before it is built."""
    import yaml

    run = Path(shutil.copytree(learned_run, tmp_path / "run"))
    record = yaml.safe_load((run / "run.yaml").read_text())
    record["ptm"]["name"] = "resnet18"
    (run / "run.yaml").write_text(yaml.safe_dump(record))
    _relist(run, "run.yaml")
    with pytest.raises(IntegrityError, match="resnet18 is not a timm ViT"):
        api.load_run(run, device="cpu")


# ------------------------------------------------------------- 8. sizes checked before any read


def test_verify_compares_the_size_before_reading_a_sparse_giant(learned_run, tmp_path, monkeypatch):
    run = Path(shutil.copytree(learned_run, tmp_path / "run"))
    name = "stages/001/weights.safetensors"
    with open(run / name, "r+b") as handle:
        handle.truncate(20 * 2**30)  # sparse: 20 GiB, no disk used
    reads = []
    real_read = storage.read_regular

    def counted(path, *, limit, **kwargs):
        reads.append(limit)
        return real_read(path, limit=limit, **kwargs)

    monkeypatch.setattr(storage, "read_regular", counted)
    problems = RunDir(run).verify()
    assert any(f"{name}" in p and "more than" in p for p in problems), problems
    assert max(reads) < 2**30


def test_hub_config_that_is_a_device_or_fifo_is_refused_without_reading(tmp_path):
    from drlcli.errors import PTMError
    from drlcli.ptm.hub import read_config

    link = tmp_path / "config.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(PTMError, match="character device"):
        read_config(link)
    link.unlink()
    os.mkfifo(link)
    with pytest.raises(PTMError, match="FIFO"):
        read_config(link)


# ------------------------------------------------------------------------------------ 9. smaller


def test_the_demo_never_writes_into_a_run_or_a_used_folder(learned_run, tmp_path):
    from drlcli.commands.demo import run_demo

    with pytest.raises(UsageError, match="inside the drl run directory"):
        run_demo(learned_run / "stages")
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine\n")
    from drlcli.errors import RunStateError

    with pytest.raises(RunStateError, match="not an empty folder"):
        run_demo(used)


def test_ptm_shapes_beyond_any_machine_are_refused_before_they_are_built(tmp_path, learned_run):
    huge = {"embed_dim": 8192, "depth": 128, "mlp_ratio": 16.0, "num_heads": 128}
    with pytest.raises(UsageError, match="309.3 B parameters"):
        init_run(tmp_path / "run", ptm="vit_base_patch16_224", random_init=True, ptm_kwargs=huge)
    assert not (tmp_path / "run" / "manifest.json").exists()
    import yaml

    run = Path(shutil.copytree(learned_run, tmp_path / "copy"))
    record = yaml.safe_load((run / "run.yaml").read_text())
    record["ptm"]["kwargs"] = {**record["ptm"]["kwargs"], "img_size": 4096, "patch_size": 8}
    (run / "run.yaml").write_text(yaml.safe_dump(record))
    _relist(run, "run.yaml")
    with pytest.raises(IntegrityError, match="262144 patch tokens"):
        api.load_run(run, device="cpu")


def test_init_with_a_config_file_that_is_a_device_is_exit_2(tmp_path):
    result = drl("init", "--run", tmp_path / "run", "--ptm", TINY_PTM, "--random-init", "--config", "/dev/zero")
    assert result.exit_code == 2 and "not a regular file" in result.stderr, result.output
