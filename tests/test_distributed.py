"""torchrun with 2 CPU processes (gloo): the stage commits, ranks agree, and it matches one process."""

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import FROZEN, TRAINS

from drlcli import learn_stage
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.run.directory import RunDir
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

OPTS = ["--epochs", "2", "--batch-size", "12", "--lr", "0.05", "--device", "cpu"]


def _torchrun(*args):
    """Run ``drlcli`` under torchrun with 2 CPU processes. A launch whose workers were killed by
    SIGABRT from inside gloo's transport (seen once in CI, not reproduced in 37 runs here; the
    ranks now leave in step, ``distributed.teardown``) is run once more, with a warning that keeps
    the first launch's rank output, so a second abort still fails the test."""
    done = _launch(args)
    if done.returncode != 0 and "SIGABRT" in done.stderr:
        warnings.warn(f"torchrun workers aborted; ran again. Their output:\n{_rank_lines(done.stderr)}", stacklevel=2)
        done = _launch(args)
    return done


def _launch(args):
    # `python -m torch.distributed.run` is the torchrun command, found wherever torch is installed
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "drlcli",
        *map(str, args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _rank_lines(stderr: str) -> str:
    """What the ranks themselves said, without the launcher's traceback (which only names the signal)."""
    launcher = ("torch/distributed/", 'File "', "raise ", "return ", "^^^", "Traceback")
    return "\n".join(line for line in stderr.splitlines() if not any(m in line for m in launcher))[-3000:]


@pytest.mark.parametrize("cap", [None, 8])  # every image an epoch; at most 8 of each class's 12
def test_two_processes_match_one(tmp_path, stage_folders, cap):
    # deterministic transforms (full-image crops, no flip): the runs then differ only in how the
    # same global batches are split over processes and in float summation order
    train_section = {"crop_scale_min": 1.0, "hflip": False, "skip_unread": False, "epoch_images_per_class": cap}
    config = RunConfig.for_method("drl", {"train": train_section}, preset="frozen")
    runs = {}
    for name in ("one", "two"):
        runs[name] = tmp_path / name
        init_run(runs[name], ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    train, test = stage_folders[0]
    single = learn_stage(
        runs["one"],
        data_dir=train,
        eval_data_dir=test,
        device="cpu",
        train_overrides={"epochs": 2, "batch_size": 12, "lr": 0.05},
    )
    done = _torchrun("learn-stage", "--run-dir", runs["two"], "--data", train, "--eval-data", test, *OPTS, "--json")
    assert done.returncode == 0, _rank_lines(done.stderr)
    out = json.loads(done.stdout)  # rank 0 alone printed: one JSON object
    assert out["ok"] and out["stage"] == 1 and out["num_params"] == single.num_params
    # the commit happened only after every rank's stage parameters were bit-identical
    meta = RunDir(runs["two"]).stage_meta(1)
    assert meta["world_size"] == 2
    # the same global batches in one process: the same stage up to float summation order
    assert out["eval"]["top1"] == single.eval.top1
    assert out["epoch_losses"] == pytest.approx(single.epoch_losses, rel=1e-4)
    a, b = RunDir(runs["one"]).stage(1).tensors, RunDir(runs["two"]).stage(1).tensors
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a), max((a[k] - b[k]).abs().max() for k in a)
    # eval under torchrun reduces counts over ranks: same number of images, same accuracy as one process
    evaluated = _torchrun("eval", "--run-dir", runs["two"], "--all-seen", "--device", "cpu", "--json")
    assert evaluated.returncode == 0, _rank_lines(evaluated.stderr)
    result = json.loads(evaluated.stdout)
    assert result["accuracy"]["num_images"] == out["eval"]["num_images"] == 12
    assert result["accuracy"]["top1"] == out["eval"]["top1"]


def test_two_processes_move_the_earlier_classes_weights_as_one_does(tmp_path):
    """A stage of fewer images than earlier classes, at the λ before (one λ on the grid): under
    torchrun each process moves W by its shard of the images and the moves are summed; the run's W
    is the one process's."""
    from safetensors.torch import load

    from drlcli.synthetic import make_class_folders

    config = RunConfig.for_method(
        "drl", {"ridge": {"proj_dim": 64, "lambda_min_exp": 1, "lambda_max_exp": 1}}, preset="frozen"
    )
    first = make_class_folders(tmp_path / "first", list(range(8)), images_per_class=3)
    small = make_class_folders(tmp_path / "small", [8, 9], images_per_class=2)
    runs = {}
    for name in ("one", "two"):
        runs[name] = tmp_path / name
        init_run(runs[name], ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
        learn_stage(runs[name], data_dir=first, device="cpu")
    learn_stage(runs["one"], data_dir=small, device="cpu")
    done = _torchrun("learn-stage", "--run-dir", runs["two"], "--data", small, "--device", "cpu", "--json")
    assert done.returncode == 0, _rank_lines(done.stderr)
    metas = [RunDir(runs[name]).stage_meta(2)["ridge"] for name in ("one", "two")]
    assert [m["earlier_columns"] for m in metas] == ["moved", "moved"]
    w = [load((runs[name] / "stages/002/totals.safetensors").read_bytes())["ranpac.weight"] for name in ("one", "two")]
    assert w[0].shape == (64, 10) and torch.allclose(w[0], w[1], rtol=1e-4, atol=1e-5 * float(w[0].abs().max()))


def test_a_carried_run_under_torchrun_carries_as_one_process(tmp_path, stage_folders):
    """A carried run (``ranpac --preset carried``) under torchrun: every process trains the set on
    its share of each batch, the first carries the earlier classes from every process's rows, and
    the run's set, Gaussians and W are the one process's (up to float summation order)."""
    from safetensors.torch import load

    sections = {
        "ridge": {"proj_dim": 96, "carry_draws": 4, "carry_rank": 3},
        "first_session": {"dropout": 0.0},  # no random masks: the two runs then differ only in summation order
        "train": {"epochs": 2, "batch_size": 12, "crop_scale_min": 1.0, "hflip": False},
    }
    config = RunConfig.for_method("ranpac", sections, preset="carried")
    runs = {}
    for name in ("one", "two"):
        runs[name] = tmp_path / name
        init_run(runs[name], ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    for train, test in stage_folders[:2]:
        single = learn_stage(runs["one"], data_dir=train, eval_data_dir=test, device="cpu")
        done = _torchrun("learn-stage", "--run-dir", runs["two"], "--data", train, "--eval-data", test, "--json")
        assert done.returncode == 0, _rank_lines(done.stderr)
        out = json.loads(done.stdout)
        assert out["epoch_losses"] == pytest.approx(single.epoch_losses, rel=1e-3)
        assert out["eval"]["top1"] == single.eval.top1
    metas = [RunDir(runs[name]).stage_meta(2) for name in ("one", "two")]
    assert metas[1]["world_size"] == 2 and metas[1]["carry"]["classes"] == metas[0]["carry"]["classes"] == 3
    for moved in ("move", "unknown_move"):
        assert metas[1]["carry"][moved] == pytest.approx(metas[0]["carry"][moved], rel=1e-2)
    one, two = (meta["carry"]["transfer"] for meta in metas)  # counted by the first from every process's rows
    assert two["images"] == one["images"] == 36
    assert abs(two["better"] - one["better"]) <= 1 and abs(two["worse"] - one["worse"]) <= 1
    a, b = (load((runs[name] / "stages/002/totals.safetensors").read_bytes()) for name in ("one", "two"))
    assert set(a) == set(b)
    for key in a:
        scale = float(a[key].double().abs().max()) or 1.0
        assert torch.allclose(a[key].double(), b[key].double(), rtol=1e-3, atol=1e-3 * scale), key


def test_a_switched_run_under_torchrun_learns_both_tracks(tmp_path, stage_folders):
    """A switched run (``ranpac --preset switched``) under torchrun: rank 0 makes the frozen track,
    every rank learns the stage in it and then in the carried network, and the run answers."""
    from drlcli.run.load import load_run

    sections = {"ridge": {"proj_dim": 96, "carry_draws": 4, "carry_rank": 3}, "train": {"epochs": 1, "batch_size": 12}}
    run = tmp_path / "run"
    config = RunConfig.for_method("ranpac", sections, preset="switched")
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    for train, test in stage_folders[:2]:
        done = _torchrun("learn-stage", "--run-dir", run, "--data", train, "--eval-data", test, "--json")
        assert done.returncode == 0, _rank_lines(done.stderr)
        out = json.loads(done.stdout)
        assert out["eval"]["top1"] == out["switch"]["top1"][out["switch"]["answers"]]
    from drlcli.run.track import frozen_track

    own = RunDir(run)
    track = frozen_track(own, own.manifest())
    assert [track.stage_meta(i)["world_size"] for i in (1, 2)] == [2, 2]
    assert load_run(run, device="cpu").model.num_stages == 2


def test_a_failure_fails_every_rank_and_changes_nothing(tmp_path, make_folder):
    run = tmp_path / "run"
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS)
    before = (run / "manifest.json").read_bytes()
    bad = make_folder("bad", [0, 1])
    (bad / "class_00" / "broken.png").write_bytes(b"not an image")
    done = _torchrun("learn-stage", "--run-dir", run, "--data", bad, *OPTS)
    assert done.returncode != 0
    assert "cannot be decoded" in done.stderr
    assert (run / "manifest.json").read_bytes() == before


def test_sum_gate_ablation_trains_under_ddp(tmp_path, stage_folders):
    # its gate parameters get no gradient; DDP must be told, or the second step fails
    run = tmp_path / "run"
    config = RunConfig.for_method("drl", {"ipa": {"gate": "sum"}, **TRAINS}, preset=FROZEN)
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    done = _torchrun("learn-stage", "--run-dir", run, "--data", stage_folders[0][0], *OPTS)
    assert done.returncode == 0, _rank_lines(done.stderr)
    assert RunDir(run).stage_indices() == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_with_nccl_commit_one_stage(tmp_path, stage_folders):
    """torchrun on 2 GPUs (NCCL, one device per rank): the stage commits once, ranks agree, eval runs."""
    run = tmp_path / "run"
    init_run(
        run,
        ptm=TINY_PTM,
        random_init=True,
        ptm_kwargs=TINY_PTM_KWARGS,
        config=RunConfig.for_method("drl", TRAINS, preset=FROZEN),
    )
    train, test = stage_folders[0]
    args = ["--epochs", "2", "--batch-size", "12", "--lr", "0.05", "--device", "cuda"]
    done = _torchrun("learn-stage", "--run-dir", run, "--data", train, "--eval-data", test, *args, "--json")
    assert done.returncode == 0, _rank_lines(done.stderr)
    out = json.loads(done.stdout)
    assert out["ok"] and out["stage"] == 1
    meta = RunDir(run).stage_meta(1)
    assert meta["world_size"] == 2 and meta["device"].startswith("cuda")
    evaluated = _torchrun("eval", "--run-dir", run, "--all-seen", "--device", "cuda", "--json")
    assert evaluated.returncode == 0, _rank_lines(evaluated.stderr)
    assert json.loads(evaluated.stdout)["accuracy"]["num_images"] == out["eval"]["num_images"]


def _leave(rank: int, init: str, marker: str) -> None:
    import torch.distributed as dist

    from drlcli import distributed

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    if rank == 1:
        time.sleep(0.5)
        Path(marker).write_text("rank 1 was still working")
    distributed.teardown(clean=True)
    if rank == 0:  # rank 0 left only after rank 1 got to its own teardown
        assert Path(marker).exists()


def test_ranks_leave_the_process_group_in_step(tmp_path):
    torch.multiprocessing.spawn(_leave, args=(f"file://{tmp_path / 'store'}", str(tmp_path / "marker")), nprocs=2)
