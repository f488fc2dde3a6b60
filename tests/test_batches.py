"""Which images each training epoch reads (``stage/batches.py``): every image, or at most
``train.epoch_images_per_class`` of each class drawn afresh every epoch; the same batches under
torchrun's shares, through a resume, and in the cost a stage records."""

from collections import Counter

import pytest
import torch
from conftest import new_run
from torch.utils.data import DataLoader

import drlcli.distributed as distributed
from drlcli import learn_stage
from drlcli.run.directory import RunDir
from drlcli.stage.batches import EpochDraw, GlobalBatchShard, epoch_size

LABELS = [0] * 30 + [1] * 5 + [2] * 12  # one large class, one under the cap, one over it


def _draw(cap, seed=0, labels=LABELS):
    return EpochDraw(labels, cap, torch.Generator().manual_seed(seed))


def test_an_epoch_reads_at_most_the_cap_of_each_class_and_every_class():
    assert epoch_size(LABELS, None) == 47 and epoch_size(LABELS, 8) == 8 + 5 + 8 and epoch_size([], 8) == 0
    draw = _draw(8)
    epochs = [draw() for _ in range(6)]
    for order in epochs:
        assert len(order) == len(set(order)) == draw.size == 21
        assert Counter(LABELS[i] for i in order) == {0: 8, 1: 5, 2: 8}
    assert len({tuple(order) for order in epochs}) == 6  # drawn afresh every epoch
    assert len({i for order in epochs for i in order if LABELS[i] == 0}) > 20  # the large class shows most images
    again = _draw(8)
    assert [again() for _ in range(6)] == epochs  # seeded: the same generator draws the same epochs
    assert sorted(_draw(100)()) == list(range(47))  # a cap above every class: every image


def test_without_a_cap_one_process_reads_what_torchs_shuffled_loader_reads():
    """The uncapped draw (used under torchrun) is torch's RandomSampler's, epoch after epoch, in full batches."""
    batch = 10
    mine = _draw(None, seed=5)
    reference = torch.Generator().manual_seed(5)
    theirs = DataLoader(range(47), batch_size=batch, drop_last=True, shuffle=True, generator=reference)
    ours = DataLoader(range(47), batch_size=batch, sampler=GlobalBatchShard(mine, batch), generator=mine.generator)
    for _ in range(3):
        assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]
    assert len(GlobalBatchShard(mine, batch)) == 40


@pytest.mark.parametrize("cap", [None, 8])
def test_k_processes_share_the_global_batches_one_process_reads(monkeypatch, cap):
    batch, world = 6, 3
    one = list(GlobalBatchShard(_draw(cap, seed=2), batch))
    shares = []
    for rank in range(world):
        monkeypatch.setattr(distributed, "rank", lambda rank=rank: rank)
        monkeypatch.setattr(distributed, "world_size", lambda: world)
        shard = GlobalBatchShard(_draw(cap, seed=2), batch)
        shares.append(list(shard))
        assert len(shard) == len(shares[-1])
    rebuilt = [shares[i % world][i // world] for i in range(sum(map(len, shares)))]
    assert rebuilt == one and len(one) % batch == 0


def _train_steps(totals):
    def progress(event):
        if event.phase == "train":
            totals.append(event.total)

    return progress


def test_a_capped_stage_trains_fewer_steps_resumes_exactly_and_counts_what_it_read(tmp_path, stage_folders):
    """Three classes of 12 images, at most 4 each an epoch: 12 images, 3 steps of 4, not 36 in 9; an
    interrupted stage resumes to the uninterrupted one's weights; its passes count the images read."""
    from test_resume import Interrupt, _stop_at_epoch

    train = stage_folders[0][0]
    opts = {"epochs": 3, "batch_size": 4, "epoch_images_per_class": 4}
    totals = []
    straight = learn_stage(
        new_run(tmp_path / "straight"),
        data_dir=train,
        train_overrides=opts,
        device="cpu",
        progress=_train_steps(totals),
    )
    assert totals[-1] == 3 * 3
    assert straight.passes["training"] == pytest.approx(3 * 3 * 12 / 36)  # 3 epochs × 3 passes × 12 of 36 images
    resumed_run = new_run(tmp_path / "resumed")
    with pytest.raises(Interrupt):
        learn_stage(resumed_run, data_dir=train, train_overrides=opts, device="cpu", progress=_stop_at_epoch(3))
    resumed = learn_stage(resumed_run, data_dir=train, train_overrides=opts, device="cpu")
    assert resumed.resumed_from_epoch == 2 and resumed.epoch_losses == straight.epoch_losses
    a, b = RunDir(tmp_path / "straight").stage(1).tensors, RunDir(resumed_run).stage(1).tensors
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    every = {**opts, "epoch_images_per_class": None}
    learn_stage(
        new_run(tmp_path / "every"), data_dir=train, train_overrides=every, device="cpu", progress=_train_steps(totals)
    )
    assert totals[-1] == 3 * 9
