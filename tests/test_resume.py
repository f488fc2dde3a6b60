"""Resume from epoch checkpoints, --restart, option changes, and the no-op re-run (api level)."""

import pytest
import torch
from conftest import FROZEN, TRAINS

from drlcli import learn_stage
from drlcli.api import verify
from drlcli.config import RunConfig
from drlcli.errors import RunStateError
from drlcli.run.directory import RunDir
from drlcli.run.load import load_run

OPTS = {"epochs": 3, "batch_size": 12}


class Interrupt(Exception):
    pass


def _stop_at_epoch(n):
    def progress(event):
        if event.phase == "train" and event.epoch == n:
            raise Interrupt

    return progress


def _weights(run):
    return RunDir(run).stage(1).tensors


def _interrupted(run, data):
    with pytest.raises(Interrupt):
        learn_stage(run, data_dir=data, train_overrides=OPTS, device="cpu", progress=_stop_at_epoch(3))
    assert RunDir(run).stage_indices() == []  # nothing committed
    assert verify(run).interrupted_stage == {"stage": 1, "epoch": 2, "epochs": 3}


def test_resume_gives_the_same_stage_as_an_uninterrupted_run(tmp_path, stage_folders):
    from drlcli.commands.init import init_run
    from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

    runs = []
    for name in ("straight", "resumed"):
        init_run(
            tmp_path / name,
            ptm=TINY_PTM,
            random_init=True,
            ptm_kwargs=TINY_PTM_KWARGS,
            config=RunConfig.for_method("drl", TRAINS, preset=FROZEN),
        )
        runs.append(tmp_path / name)
    train = stage_folders[0][0]
    straight = learn_stage(runs[0], data_dir=train, train_overrides=OPTS, device="cpu")
    _interrupted(runs[1], train)
    resumed = learn_stage(runs[1], data_dir=train, train_overrides=OPTS, device="cpu")
    assert resumed.resumed_from_epoch == 2 and straight.resumed_from_epoch is None
    assert resumed.epoch_losses == straight.epoch_losses
    a, b = _weights(runs[0]), _weights(runs[1])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (runs[1] / ".checkpoint").exists()  # the commit consumed it


def test_other_options_on_resume_are_refused_and_restart_discards(run_dir, stage_folders):
    train = stage_folders[0][0]
    _interrupted(run_dir, train)
    with pytest.raises(RunStateError, match=r"epochs 3 -> 2.*--restart"):
        learn_stage(run_dir, data_dir=train, train_overrides={**OPTS, "epochs": 2}, device="cpu")
    with pytest.raises(RunStateError, match="--data images"):
        learn_stage(run_dir, data_dir=stage_folders[1][0], train_overrides=OPTS, device="cpu")
    fresh = learn_stage(run_dir, data_dir=train, train_overrides={**OPTS, "epochs": 2}, device="cpu", restart=True)
    assert fresh.resumed_from_epoch is None and len(fresh.epoch_losses) == 2
    assert load_run(run_dir, device="cpu").model.num_stages == 1


def test_damaged_checkpoint_is_ignored_not_trusted(run_dir, stage_folders):
    train = stage_folders[0][0]
    _interrupted(run_dir, train)
    for path in (run_dir / ".checkpoint").glob("*.safetensors"):
        path.write_bytes(path.read_bytes()[:-3])
    assert RunDir(run_dir).checkpoint() is None
    result = learn_stage(run_dir, data_dir=train, train_overrides=OPTS, device="cpu")
    assert result.resumed_from_epoch is None and result.status == "learned"


def test_rerun_of_a_committed_stage_is_a_no_op(run_dir, stage_folders):
    train, test = stage_folders[0]
    first = learn_stage(run_dir, data_dir=train, eval_data_dir=test, train_overrides=OPTS, device="cpu")
    generation = RunDir(run_dir).manifest()["generation"]
    again = learn_stage(run_dir, data_dir=train, eval_data_dir=test, train_overrides=OPTS, device="cpu")
    assert again.status == "unchanged" and again.stage == 1 and again.eval.top1 == first.eval.top1
    assert RunDir(run_dir).manifest()["generation"] == generation


def test_resume_on_another_device_type_is_refused(run_dir, stage_folders):
    """A checkpoint records its device type; resuming it elsewhere is exit 7 naming --restart (issue 18)."""
    import json

    from drlcli.run.checkpoint import seal_checkpoint
    from drlcli.run.layout import CHECKPOINT, CHECKPOINT_META

    train = stage_folders[0][0]
    _interrupted(run_dir, train)
    meta_path = run_dir / CHECKPOINT / CHECKPOINT_META
    meta = json.loads(meta_path.read_text())
    meta.pop("sha256")  # its own checksum: rewritten by seal_checkpoint
    assert meta["device"] == "cpu"
    meta_path.write_bytes(seal_checkpoint({**meta, "device": "cuda"}))  # as if written on a GPU host
    with pytest.raises(
        RunStateError, match=r"interrupted after epoch 2 on cuda.*on cpu.*--device cuda.*--restart"
    ) as e:
        learn_stage(run_dir, data_dir=train, train_overrides=OPTS, device="cpu")
    assert e.value.exit_code == 7
    # written by an older drl: no device, and no option it did not have (keep_tokens: every token, the default's)
    older = {k: v for k, v in meta.items() if k != "device"}
    older["train"] = {k: v for k, v in meta["train"].items() if k != "keep_tokens"}
    meta_path.write_bytes(seal_checkpoint(older))
    resumed = learn_stage(run_dir, data_dir=train, train_overrides=OPTS, device="cpu")
    assert resumed.resumed_from_epoch == 2
