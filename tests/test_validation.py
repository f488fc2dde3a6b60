"""Issue 14, hostile input (items 5, 9, 10, 11): numbers, names, images and output.

Every case goes through the CLI (typer's CliRunner) and asserts the documented exit code, the
one-line message, and that the run is unchanged; docs/reliability.md ("Hostile input") lists them.
"""

import errno
import hashlib
import json
import math
import multiprocessing.process
import os
import re
import shutil
import stat
import struct
import subprocess
import sys

import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load, save
from typer.testing import CliRunner

from drlcli import api, jsonio
from drlcli.cli import app
from drlcli.cli.output import Reporter
from drlcli.data.decode import MAX_DECODE_SIDE, load_rgb
from drlcli.run.checkpoint import seal_checkpoint
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

runner = CliRunner()
TINY_ARGS = ["--ptm", TINY_PTM] + [a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")]
FAST = ["--epochs", "2", "--batch-size", "12", "--device", "cpu"]


def drl(*args):
    return runner.invoke(app, [str(a) for a in args])


def _strict(text):
    """json.loads that refuses NaN/Infinity, as jq or JavaScript would."""

    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, stage_folders, trains_file):
    """A run with one learned stage (3 classes), its eval data registered; it trains its stages."""
    run = tmp_path_factory.mktemp("valid") / "run"
    assert drl("init", "--run", run, *TINY_ARGS, "--random-init", "--config", trains_file).exit_code == 0
    train, test = stage_folders[0]
    result = drl("learn-stage", "--run", run, "--data", train, "--eval-data", test, *FAST)
    assert result.exit_code == 0, result.stderr
    return run


@pytest.fixture
def run(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _state(run):
    """Everything a command could change: the manifest, and whether a checkpoint is left."""
    return (run / "manifest.json").read_bytes(), (run / ".checkpoint").exists()


def _craft(run, name, data: bytes):
    """Replace a run file and make the manifest agree: a self-consistent, crafted run."""
    (run / name).write_bytes(data)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (run / "manifest.json").write_text(json.dumps(manifest))


# ----------------------------------------------------------------- item 5: numbers


@pytest.mark.parametrize("lr", ["inf", "nan", "1e9", "0"])
def test_nonsense_lr_is_refused_before_anything_runs(run, stage_folders, lr):
    before = _state(run)
    result = drl("learn-stage", "--run", run, "--data", stage_folders[1][0], *FAST, "--lr", lr)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "lr" in result.stderr and "error:" in result.stderr
    assert _state(run) == before


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("train: {lr: .inf}", "train.lr must be a finite number"),
        ("score: {beta: .nan}", "score.beta must be a finite number"),
        ("train: {momentum: -0.5}", r"train.momentum must be a number in \[0, 1\)"),
        ("ipa: {adapter_dim: 100000000}", r"ipa.adapter_dim must be a number in \[1, 16384\]"),
    ],
)
def test_init_refuses_nonsense_numbers(tmp_path, yaml_text, message):
    config = tmp_path / "c.yaml"
    config.write_text(yaml_text + "\n")
    result = drl("init", "--run", tmp_path / "run", *TINY_ARGS, "--random-init", "--config", config)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and re.search(message, result.stderr)
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_run_yaml_with_invalid_numbers_is_an_integrity_error(run, stage_folders):
    text = (run / "run.yaml").read_text().replace("momentum: 0.9", "momentum: -0.5")
    _craft(run, "run.yaml", text.encode())
    for args in (["info"], ["eval", "--all-seen", "--device", "cpu"], ["learn-stage", "--data", stage_folders[1][0]]):
        result = drl(*args, "--run", run)
        assert result.exit_code == 5, (args, result.stderr)
        assert "run.yaml is not a valid run config (train.momentum must be a number in" in result.stderr


def _nan_loss_after(monkeypatch, steps):
    """From step ``steps`` + 1 on, the loss is NaN (what a learning rate far too high ends in)."""
    import drlcli.stage.train

    real, calls = drlcli.stage.train.stage_loss, []

    def loss(*args):
        calls.append(1)
        return real(*args) * (math.nan if len(calls) > steps else 1.0)

    monkeypatch.setattr(drlcli.stage.train, "stage_loss", loss)


def test_diverged_training_is_refused_and_leaves_no_checkpoint(run, stage_folders, monkeypatch):
    train = stage_folders[1][0]
    before = _state(run)
    _nan_loss_after(monkeypatch, 3)  # epoch 1 (3 steps of 12 of 36 images) is fine and checkpointed
    result = drl("learn-stage", "--run", run, "--data", train, "--epochs", "3", "--batch-size", "12", "--device", "cpu")
    assert result.exit_code == 3, result.stderr
    assert "training diverged in epoch 2" in result.stderr and "lower --lr (now 0.01)" in result.stderr
    assert _state(run) == before  # nothing committed, the epoch-1 checkpoint discarded
    assert drl("verify", "--run", run).exit_code == 0
    monkeypatch.undo()
    result = drl("learn-stage", "--run", run, "--data", train, *FAST, "--lr", "0.005")  # no --restart needed
    assert result.exit_code == 0, result.stderr


def test_non_finite_stage_tensors_are_refused_before_the_commit(run, stage_folders, monkeypatch):
    before = _state(run)
    from drlcli.stage import fit

    real = fit.class_means
    monkeypatch.setattr(fit, "class_means", lambda *a: real(*a) * math.inf)
    result = drl("learn-stage", "--run", run, "--data", stage_folders[1][0], *FAST, "--json")
    assert result.exit_code == 3
    error = _strict(result.stdout)["error"]
    assert error["kind"] == "diverged" and "prototypes of stage 2 holds NaN or infinite values" in error["message"]
    assert _state(run) == before


# ------------------------------------------- item 9: documented codes instead of exit 1


def test_non_utf8_class_and_file_names_are_bad_data(run, tmp_path):
    data = make_class_folders(tmp_path / "d", [5, 6], images_per_class=4)
    os.rename(os.fsencode(data / "class_05"), os.fsencode(data) + b"/cl\xffss")
    result = drl("learn-stage", "--run", run, "--data", data, *FAST)
    assert result.exit_code == 3 and "'cl\\xffss'" in result.stderr and "is not valid UTF-8; rename it" in result.stderr
    data = make_class_folders(tmp_path / "e", [5, 6], images_per_class=4)
    os.rename(os.fsencode(data / "class_05" / "img_000.png"), os.fsencode(data / "class_05") + b"/im\xe9.png")
    result = drl("learn-stage", "--run", run, "--data", data, *FAST)
    assert result.exit_code == 3 and "class_05/im\\xe9.png" in result.stderr


def _offsets_past_end(data: bytes) -> bytes:
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 10**9
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + size :]


def _yaml_edit(**changes):
    return lambda data: yaml.safe_dump({**yaml.safe_load(data), **changes}).encode()


def _json_edit(**changes):
    return lambda data: json.dumps({**json.loads(data), **changes}).encode()


CRAFTED = {
    "yaml tag": ("run.yaml", lambda data: b"!!python/object/apply:os.system ['true']\n"),
    "config is a list": ("run.yaml", _yaml_edit(config=[1])),
    "ptm is a list": ("run.yaml", _yaml_edit(ptm=[1])),
    "input size of a crafted PTM": (
        "run.yaml",
        lambda data: _yaml_edit(ptm={**yaml.safe_load(data)["ptm"], "data_config": {"input_size": [3, 10**6, 10**6]}})(
            data
        ),
    ),
    "stage.json is a list": ("stages/001/stage.json", lambda data: b"[1, 2]"),
    "classes is a mapping": ("stages/001/stage.json", _json_edit(classes={"a": 1})),
    "metrics are a list": ("stages/001/stage.json", _json_edit(metrics=[])),
    "metrics.train is a list": (
        "stages/001/stage.json",
        lambda data: _json_edit(metrics={**json.loads(data)["metrics"], "train": [1]})(data),
    ),
    "learn seconds beyond any float": (
        "stages/001/stage.json",
        lambda data: _json_edit(metrics={**json.loads(data)["metrics"], "learn_seconds": 10**400})(data),
    ),
    "stage.json not UTF-8": ("stages/001/stage.json", lambda data: b"\xff\xfe{}"),
    "safetensors offsets past the end": ("stages/001/weights.safetensors", _offsets_past_end),
    "weights of another shape": (
        "stages/001/weights.safetensors",
        lambda data: save({"prototypes": torch.zeros(3, 9)}),
    ),
    "NaN weights": (
        "stages/001/weights.safetensors",
        lambda data: save({k: v * math.nan if v.is_floating_point() else v for k, v in load(data).items()}),
    ),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_run_files_are_integrity_errors(run, case):
    name, craft = CRAFTED[case]
    _craft(run, name, craft((run / name).read_bytes()))
    for args in (["eval", "--all-seen", "--device", "cpu"], ["export", "--out", run.parent / "m.drl"]):
        result = drl(*args, "--run", run)
        assert result.exit_code == 5, (case, args, result.stderr)
        assert result.stderr.count("\n") == 1 and "restore it from a backup" in result.stderr


def test_crafted_manifest_is_an_integrity_error(run):
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["files"] = list(manifest["files"])
    (run / "manifest.json").write_text(json.dumps(manifest))
    result = drl("info", "--run", run)
    assert result.exit_code == 5 and "is malformed" in result.stderr


class Interrupt(Exception):
    pass


def _other_shape(meta, tensors):
    name = next(k for k in tensors if k.startswith("stage."))
    tensors[name] = torch.zeros(7, 7)  # a stage of another shape (another drl version, a hand-made file)


def _no_momentum_shape(meta, tensors):
    name = next(k for k in tensors if k.startswith("momentum."))
    tensors[name] = torch.zeros(3)


def _epoch_a_string(meta, tensors):
    meta["epoch"] = "one"


def _no_python_rng(meta, tensors):
    del tensors["rng.python"]  # an older drl's checkpoint: its crops came from torch's generator


def _bad_python_rng(meta, tensors):
    tensors["rng.python"] = torch.full((3,), 2**40, dtype=torch.int64)


@pytest.mark.parametrize(
    "craft, message",
    [
        (_other_shape, "does not fit this stage"),
        (_no_momentum_shape, "does not fit"),
        (_epoch_a_string, "malformed"),
        (_no_python_rng, "does not fit this stage ('rng.python')"),
        (_bad_python_rng, "does not fit this stage"),
    ],
)
def test_a_checkpoint_that_no_longer_fits_says_restart(run, stage_folders, craft, message):
    train = stage_folders[1][0]

    def stop(event):
        if event.phase == "train" and event.epoch == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        api.learn_stage(
            run, data_dir=train, train_overrides={"epochs": 2, "batch_size": 12}, device="cpu", progress=stop
        )
    folder = run / ".checkpoint"
    meta = json.loads((folder / "checkpoint.json").read_text())
    meta.pop("sha256")  # its own checksum: rewritten by seal_checkpoint
    tensors = load((folder / meta["tensors"]["file"]).read_bytes())
    craft(meta, tensors)
    data = save(tensors)
    (folder / meta["tensors"]["file"]).write_bytes(data)
    meta["tensors"]["sha256"] = hashlib.sha256(data).hexdigest()
    (folder / "checkpoint.json").write_bytes(seal_checkpoint(meta))
    before = _state(run)
    result = drl("learn-stage", "--run", run, "--data", train, *FAST)
    assert result.exit_code == 7 and message in result.stderr and "pass --restart" in result.stderr, result.stderr
    assert _state(run) == before and drl("verify", "--run", run).exit_code == 0
    assert drl("learn-stage", "--run", run, "--data", train, *FAST, "--restart").exit_code == 0


def test_workers_beyond_the_limit_or_the_os_are_usage_errors(run, stage_folders, monkeypatch, tmp_path):
    train = stage_folders[1][0]
    result = drl("learn-stage", "--run", run, "--data", train, *FAST, "--workers", "100000")
    assert result.exit_code == 2 and "--workers" in result.stderr
    image = next(train.rglob("*.png"))
    assert drl("predict", "--run", run, image, "--workers", "100000").exit_code == 2

    def refuse(self):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    before = _state(run)
    result = drl("learn-stage", "--run", run, "--data", train, *FAST, "--workers", "2")
    assert result.exit_code == 2
    assert "cannot start 2 data-loading worker processes (Resource temporarily unavailable)" in result.stderr
    assert "pass a smaller --workers" in result.stderr and _state(run)[0] == before[0]


_FULL_DISK_EXPORT = """
import resource, signal, sys
from drlcli.cli import app
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) like a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
sys.argv = ["drl", *sys.argv[1:]]
app()
"""


def test_drl_export_on_a_full_disk_is_a_storage_error(trained, tmp_path):
    out = tmp_path / "m.drl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_EXPORT, "export", "--run", str(trained), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 8, proc.stderr
    assert proc.stderr.startswith("error: cannot write export") and proc.stderr.count("\n") == 1
    assert not out.exists() and not list(tmp_path.glob(".m.drl.tmp-*"))


# --------------------------------------------------------------- item 10: strict JSON


def test_one_encoder_writes_strict_json():
    text = jsonio.dumps({"a": math.nan, "b": [math.inf, -math.inf, 1.5], "c": (1, {"d": math.nan})})
    assert _strict(text) == {"a": None, "b": [None, None, 1.5], "c": [1, {"d": None}]}


def test_json_output_and_run_files_are_strict(run, stage_folders, monkeypatch):
    result = drl("learn-stage", "--run", run, "--data", stage_folders[1][0], *FAST, "--json")
    assert result.exit_code == 0 and _strict(result.stdout)["ok"]
    for path in run.rglob("*.json"):
        _strict(path.read_text())
    real = api.info
    monkeypatch.setattr(api, "info", lambda r: {**real(r), "odd": [math.nan, math.inf]})
    result = drl("info", "--run", run, "--json")
    assert result.exit_code == 0 and _strict(result.stdout)["odd"] == [None, None]


# ---------------------------------------------------------------- item 11: smaller ones


@pytest.mark.parametrize(
    "new_name",
    ["Class_00", " class_00", "class_00 ", "\uff43lass_00"],  # the last starts with a fullwidth c (NFKC: c)
)
def test_class_names_differing_only_by_case_space_or_unicode_are_refused(run, tmp_path, new_name):
    data = make_class_folders(tmp_path / "d", [5, 6], images_per_class=4)
    (data / "class_05").rename(data / new_name)
    before = _state(run)
    result = drl("learn-stage", "--run", run, "--data", data, *FAST)
    assert result.exit_code == 3, result.stderr
    assert f"class {new_name!r} in --data differs from class 'class_00' (learned in stage 1)" in result.stderr
    assert _state(run) == before


def test_near_duplicate_class_folders_within_one_drop_are_refused(run, tmp_path):
    data = make_class_folders(tmp_path / "d", [5, 6], images_per_class=4)
    (data / "class_06").rename(data / "CLASS_05")
    result = drl("learn-stage", "--run", run, "--data", data, *FAST)
    assert result.exit_code == 3 and "'class_05'" in result.stderr and "'CLASS_05'" in result.stderr


_MEASURE = """
import resource, sys
from drlcli.data import load_rgb
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
image = load_rgb(sys.argv[1])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(max(image.size), (after - before) // 1024)
"""


@pytest.mark.parametrize("suffix", [".jpg", ".png"])
def test_huge_images_are_decoded_with_bounded_memory(tmp_path, suffix):
    path = tmp_path / f"big{suffix}"
    Image.new("L", (8000, 8000), 128).save(path)  # 64 megapixels in a small file
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, env=env)
    side, grown_mib = map(int, out.stdout.split())
    assert side == MAX_DECODE_SIDE
    # a full-size RGB decode alone is 183 MiB; the JPEG is drafted at 1/2 scale, the PNG reduced in its own mode
    assert grown_mib < (40 if suffix == ".jpg" else 100), grown_mib


def test_small_images_decode_unchanged(tmp_path):
    path = tmp_path / "small.png"
    pixels = torch.randint(0, 255, (40, 30, 3), dtype=torch.uint8).numpy()
    Image.fromarray(pixels).save(path)
    assert load_rgb(path).tobytes() == pixels.tobytes()


def test_python_warnings_are_one_line_on_stderr(run, monkeypatch):
    import warnings

    real = api.info

    def noisy(r):
        warnings.warn("first line\n  second line of a dependency's warning", UserWarning, stacklevel=1)
        return real(r)

    monkeypatch.setattr(api, "info", noisy)
    result = drl("info", "--run", run)
    assert result.exit_code == 0
    lines = [line for line in result.stderr.splitlines() if "first line" in line]
    assert lines == [lines[0]] and lines[0].startswith("warning: UserWarning: first line second line")
    assert "warnings.warn" not in result.stderr  # no source excerpt


def test_plain_progress_is_one_line_per_interval_plus_the_last(monkeypatch, capsys):
    import logging

    from drlcli import cli

    clock = {"now": 0.0}
    monkeypatch.setattr(cli.time, "monotonic", lambda: clock["now"])
    cli._setup_logging(quiet=False, verbose=False)
    reporter = Reporter(quiet=False, interval=10.0)
    reporter.interactive = False
    epochs, steps = 20, 5
    for epoch in range(1, epochs + 1):  # 100 steps, one per second
        for step in range(1, steps + 1):
            clock["now"] += 1.0
            reporter(api.Progress("train", (epoch - 1) * steps + step, epochs * steps, epoch=epoch, epochs=epochs))
    logging.getLogger("drlcli").handlers.clear()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train ")]
    assert len(lines) <= 1 + 100 // 10 + 1 and lines[-1].startswith("train 100/100")


def test_learn_stage_off_a_terminal_prints_few_progress_lines(run, stage_folders):
    result = drl("learn-stage", "--run", run, "--data", stage_folders[1][0], "--epochs", "6", "--batch-size", "12")
    assert result.exit_code == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("train ")]
    seconds = _strict(drl("info", "--run", run, "--json").stdout)["stages"][-1]["train_seconds"]
    assert len(lines) <= 2 + seconds // 10, lines  # the first line, one per 10 s, the last one
    assert lines[-1].startswith("train 18/18 epoch 6/6")


def test_drl_export_file_mode_follows_the_umask_like_other_files(trained, tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    out = tmp_path / "m.drl"
    assert drl("export", "--run", trained, "--out", out).exit_code == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("line", ["/etc/hostname", "class_00/../../outside.png", "../x/img_000.png"])
def test_benchmark_list_entries_escaping_the_data_folder_are_refused(tmp_path, line):
    root = tmp_path / "cal"
    make_class_folders(root / "Objects", [0, 1], images_per_class=3)
    (root / "train.txt").write_text(f"class_00/img_000.png\n{line}\n")
    (root / "test.txt").write_text("class_00/img_002.png\n")
    result = drl("benchmark", "--data", root, "--out", tmp_path / "out", *TINY_ARGS, "--random-init", "--device", "cpu")
    assert result.exit_code == 3 and "points outside" in result.stderr and repr(line) in result.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.safetensors"))


@pytest.mark.parametrize("command", ["init", "benchmark"])
def test_seeds_out_of_range_are_usage_errors(tmp_path, command):
    args = [command, "--ptm", TINY_PTM, "--random-init", "--seed"]
    for seed in ("-1", str(2**32)):
        extra = ["--run", tmp_path / "run"] if command == "init" else ["--data", tmp_path, "--out", tmp_path / "o"]
        result = drl(*args, seed, *extra)
        assert result.exit_code == 2 and "'--seed'" in result.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "o").exists()


def test_recorded_seconds_must_be_numbers_of_seconds():
    """Every reader of a stage's seconds (info, benchmark rows) gets a checked stage.json: a crafted
    value (huge, non-finite, negative, not a number) is a damaged stage, never an internal error."""
    from drlcli.run.records import _stage_meta_problem

    def meta(train, learn):
        return {
            "stage": 1,
            "classes": ["a"],
            "images_per_class": {"a": 1},
            "data_fingerprint": "x",
            "num_params": 0,
            "metrics": {"eval": None, "train": train, "learn_seconds": learn},
        }

    assert _stage_meta_problem(1, meta({"seconds": 12.345}, 3)) is None
    assert _stage_meta_problem(1, meta(None, None)) is None  # a method that trains nothing; before learn_seconds
    for crafted in (10**400, math.nan, math.inf, -1.0, True, "3", [1]):
        assert (
            _stage_meta_problem(1, meta({"seconds": 1.0}, crafted))
            == "metrics.learn_seconds is not a number of seconds"
        )
        assert (
            _stage_meta_problem(1, meta({"seconds": crafted}, 1.0))
            == "metrics.train.seconds is not a number of seconds"
        )
    assert _stage_meta_problem(1, meta(["not", "a", "mapping"], 1.0)) == "metrics.train is not a mapping"
