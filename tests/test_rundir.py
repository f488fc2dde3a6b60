import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from drlcli import storage
from drlcli.errors import IntegrityError, RunBusyError, RunStateError, StorageError
from drlcli.run import files as run_files
from drlcli.run import layout
from drlcli.run.directory import RunDir


def _init(path):
    run = RunDir(path)
    with run.writer(create=True) as writer:
        writer.commit(run_files.init_files({"kind": layout.RUN_CONFIG_KIND, "x": 1}, None), manifest=None)
    return run


def _add_stage(run, index):
    import torch

    with run.writer() as writer:
        files = run_files.stage_files(index, {"stage": index}, {"prototypes": torch.ones(2, 1, 4) * index})
        return writer.commit(files, manifest=run.manifest(), new_stage=index)


def test_commit_lists_every_file_with_checksums(tmp_path):
    run = _init(tmp_path / "r")
    manifest = _add_stage(run, 1)
    assert manifest["stages"] == [1] and manifest["generation"] == 2
    assert set(manifest["files"]) == {"run.yaml", "stages/001/stage.json", "stages/001/weights.safetensors"}
    assert run.stage(1).tensors["prototypes"].sum() == 8
    assert run.verify() == []
    assert not (run.path / layout.STAGING).exists()


def test_flipped_byte_is_detected_and_named(tmp_path):
    run = _init(tmp_path / "r")
    _add_stage(run, 1)
    path = run.path / "stages/001/weights.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = run.verify()
    assert len(problems) == 1 and "weights.safetensors is damaged" in problems[0]
    with pytest.raises(IntegrityError, match="checksum"):
        run.stage(1)


def test_truncated_and_missing_files_are_detected(tmp_path):
    run = _init(tmp_path / "r")
    _add_stage(run, 1)
    (run.path / "stages/001/stage.json").write_bytes(b"{")
    (run.path / "run.yaml").unlink()
    problems = " | ".join(run.verify())
    assert "stage.json is damaged" in problems and "run.yaml is missing" in problems


def test_unknown_format_version_is_refused(tmp_path):
    run = _init(tmp_path / "r")
    manifest = json.loads((run.path / "manifest.json").read_text())
    manifest["format_version"] = 99
    (run.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match="format version 99"):
        run.manifest()


def test_not_a_run_directory(tmp_path):
    with pytest.raises(RunStateError, match="not a drl run directory"):
        RunDir(tmp_path).manifest()
    with pytest.raises(RunStateError, match="does not exist"):
        RunDir(tmp_path / "missing").manifest()


def test_second_writer_is_refused_naming_the_holder(tmp_path):
    run = _init(tmp_path / "r")
    with run.writer(), pytest.raises(RunBusyError, match=r"pid \d+ on "), RunDir(run.path).writer():
        pass
    with run.writer():  # released afterwards
        pass


def test_stale_lock_file_from_dead_process_is_taken_over(tmp_path):
    run = _init(tmp_path / "r")
    (run.path / layout.LOCK).write_text(json.dumps({"pid": 999999, "host": "gone", "started": "then"}))
    with run.writer():  # no flock is held by anyone: the file alone does not block
        pass


def test_crash_debris_is_never_trusted_and_moved_aside_not_deleted(tmp_path):
    run = _init(tmp_path / "r")
    _add_stage(run, 1)
    (run.path / layout.STAGING / ("0" * 32)).mkdir(parents=True)  # an interrupted commit's own: deleted
    (run.path / layout.STAGING / "abc").mkdir()
    (run.path / "stages/002").mkdir()  # renamed into place, manifest never replaced
    (run.path / "stages/002/stage.json").write_text("{}")
    assert run.stage_indices() == [1]
    _add_stage(run, 2)
    assert run.stage_indices() == [1, 2] and run.verify() == []
    moved = sorted(str(p.relative_to(p.parents[1])) for p in run.path.glob(".quarantine/*/*/*"))
    assert moved == [".staging/abc", "stages/002"] and not (run.path / layout.STAGING).exists()


def test_failed_commit_takes_back_the_files_it_moved_in(tmp_path, monkeypatch):
    run = _init(tmp_path / "r")
    _add_stage(run, 1)
    write = storage.write_new

    def full_at_manifest(path, data):
        if path.name == "manifest.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, data)

    monkeypatch.setattr(storage, "write_new", full_at_manifest)
    with pytest.raises(StorageError, match="nothing was committed"):
        _add_stage(run, 2)
    monkeypatch.undo()
    assert not (run.path / "stages/002").exists() and not (run.path / layout.STAGING).exists()
    _add_stage(run, 2)
    assert not (run.path / layout.QUARANTINE).exists()  # nothing unexplained was left


def test_failing_write_keeps_previous_state(tmp_path, monkeypatch):
    run = _init(tmp_path / "r")
    _add_stage(run, 1)
    before = (run.path / "manifest.json").read_bytes()

    def disk_full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage, "write_new", disk_full)
    with pytest.raises(StorageError, match="free some disk space"):
        _add_stage(run, 2)
    monkeypatch.undo()
    assert (run.path / "manifest.json").read_bytes() == before
    assert run.verify() == [] and run.stage_indices() == [1]
    _add_stage(run, 2)


def test_manifest_paths_cannot_escape_the_run(tmp_path):
    run = _init(tmp_path / "r")
    manifest = json.loads((run.path / "manifest.json").read_text())
    manifest["files"]["../outside"] = {"sha256": "0", "bytes": 0}
    (run.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match="outside the run"):
        run.read_bytes("../outside")


def test_committed_files_are_never_rewritten(tmp_path):
    run = _init(tmp_path / "r")
    _add_stage(run, 1)
    with pytest.raises(RunStateError, match="already committed"):
        _add_stage(run, 1)


def test_package_imports_without_fcntl_and_writing_refuses(tmp_path):
    """As on Windows: no fcntl module. drlcli imports; writing a run fails with a clear StorageError."""
    code = f"""
import sys
sys.modules["fcntl"] = None  # import fcntl raises ImportError
import drlcli
from drlcli.errors import StorageError
from drlcli.run.directory import RunDir
try:
    with RunDir({str(tmp_path / "run")!r}).writer(create=True):
        pass
except StorageError as exc:
    print("refused:", exc)
"""
    root = str(Path(__file__).resolve().parents[1])  # this checkout's drlcli, whatever is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert "refused: cannot write run" in result.stdout and "fcntl" in result.stdout
    assert not (tmp_path / "run").exists()  # refused before anything was created
