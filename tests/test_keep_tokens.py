"""``train.keep_tokens``: an adapter set's training step reads a share of each layout cell's patch tokens,
drawn afresh for every image (PatchDropout); the hold compares the same tokens; evaluation, the
features and the head read every token; a stage's passes count the share; only an adapter set's
training takes it."""

import pytest
import torch
from test_first_session import moved_since_the_stage_began

from drlcli import learn_stage
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.errors import UsageError
from drlcli.features.adapter import AdapterConfig
from drlcli.features.adapter.network import AdapterNetwork, hold_loss
from drlcli.run.directory import RunDir
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

SIDE = TINY_PTM_KWARGS["img_size"] // TINY_PTM_KWARGS["patch_size"]  # 4 x 4 patches: 2 x 2 cells of 4


def _network(keep: float, *, grid: int = 2, hold: float = 2.0) -> AdapterNetwork:
    """A carried network reopened at stage 2, its set moved since the stage began; blocks 2-3 of the tiny
    PTM's 4 without adapters."""
    adapter = AdapterConfig(dropout=0.0, blocks=0.5)
    return moved_since_the_stage_began(adapter, hold_weight=hold, read_grid=grid, keep_tokens=keep)


def _cell(patch: int, grid: int = 2) -> int:
    row, col = divmod(patch, SIDE)
    return row // (SIDE // grid) * grid + col // (SIDE // grid)


def test_each_image_keeps_the_same_share_of_every_cell_drawn_afresh(images):
    network = _network(0.5)
    kept = network._kept(torch.randn(64, 3, 32, 32))
    assert kept.shape == (64, 4 * 2)  # 2 of each cell's 4 patches
    for row in kept.tolist():
        assert len(set(row)) == 8 and [_cell(p) for p in row] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len({tuple(r) for r in kept.tolist()}) > 1  # drawn for each image
    assert _network(1.0)._kept(images) is None
    assert _network(0.01)._kept(images).shape == (3, 4)  # at least one token of each cell


def test_a_step_passes_only_the_kept_tokens(images, monkeypatch):
    network = _network(0.5)
    last, widths = network.ptm.blocks[-1], []  # a block without an adapter: the PTM's own forward
    real = last.forward
    monkeypatch.setattr(last, "forward", lambda x: widths.append(x.shape[1]) or real(x))
    _, feature, term = network.forward_train(images)
    assert widths == [1 + 8, 1 + 8]  # the class token and 8 of 16 patches, in the set's and the hold's pass
    assert feature.shape == (3, network.width) and term.item() > 0
    with torch.no_grad():
        assert network(images, layout=2).shape == (3, 1 + 1 + 4, network.width)  # evaluation: every token
    assert widths[2:] == [1 + 16]


def test_kept_cells_are_the_layout_cells_when_every_token_is_kept(images, monkeypatch):
    """The cell-ordered tokens' cell means are the head's layout cells: with every token kept the hold is
    the whole-token hold to float precision."""
    network = _network(1.0)
    whole = network.forward_train(images)[2]
    order = sorted(range(SIDE * SIDE), key=_cell)
    monkeypatch.setattr(network, "_kept", lambda x: torch.tensor(order).expand(len(x), -1))
    torch.testing.assert_close(network.forward_train(images)[2], whole, rtol=1e-5, atol=1e-7)


def test_the_hold_reads_the_kept_tokens_of_both_passes(images, monkeypatch):
    network = _network(0.5, hold=1.0)
    network.hold_share = 1.0
    kept = network._kept(images)
    monkeypatch.setattr(network, "_kept", lambda x: kept[: len(x)])
    _, feature, term = network.forward_train(images)
    with torch.no_grad():
        moved, _ = network._pass(images, (), kept=kept)
        start, _ = network._pass(images, (), stage=network.start, kept=kept)
    cells = [t[:, 1:].reshape(3, 4, 2, -1).mean(2) for t in (moved, start)]
    rows = [torch.cat([network.ptm.fc_norm(t[:, :1]), c], 1) for t, c in zip((moved, start), cells)]
    torch.testing.assert_close(term, hold_loss(*rows), rtol=1e-5, atol=1e-7)


def test_a_grid_the_patches_do_not_split_into_is_refused(images):
    with pytest.raises(UsageError, match=r"train.keep_tokens 0.5 needs .* 3 x 3 .*set train.keep_tokens 1"):
        _network(0.5, grid=3).forward_train(images)
    assert _network(0.5, grid=0)._kept(images).shape == (3, 8)  # no layout: half of the whole grid


def test_a_run_whose_grid_cannot_keep_the_share_is_not_made(tmp_path):
    config = RunConfig.for_recipe("default", {"ridge": {"layout_grid": 3}, "train": {"keep_tokens": 0.5}})
    with pytest.raises(UsageError, match=r"needs the PTM's patch grid to split into 3 x 3"):
        init_run(tmp_path / "run", ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    assert not (tmp_path / "run" / "run.yaml").exists()


@pytest.mark.parametrize("recipe", ["frozen", "ranpac", "paper", "ease", "simplecil"])
def test_only_an_adapter_set_s_training_takes_a_share(recipe):
    with pytest.raises(UsageError, match="train.keep_tokens must be 1 for method .* set train.keep_tokens 1"):
        RunConfig.for_recipe(recipe, {"train": {"keep_tokens": 0.5}})
    assert RunConfig.for_recipe("ranpac-published", {"train": {"keep_tokens": 0.5}}).train.keep_tokens == 0.5


def test_a_stage_counts_its_share_and_resumes_to_the_same_set(tmp_path, stage_folders):
    """Two epochs of every image at half the tokens: 2 × 3 × 0.5 passes an image (the classifier starts at
    random); an interrupted stage resumes to the uninterrupted one's weights (the draws are the torch
    generator's, which the checkpoint keeps)."""
    from test_resume import Interrupt, _stop_at_epoch

    sections = {"ridge": {"proj_dim": 96}, "train": {"epochs": 2, "batch_size": 8, "keep_tokens": 0.5}}
    config = RunConfig.for_recipe("ranpac-published", sections)
    runs = [tmp_path / "straight", tmp_path / "resumed"]
    for run in runs:
        init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    train = stage_folders[0][0]
    straight = learn_stage(runs[0], data_dir=train, device="cpu")
    assert straight.passes["training"] == pytest.approx(2 * 3 * 0.5)
    with pytest.raises(Interrupt):
        learn_stage(runs[1], data_dir=train, device="cpu", progress=_stop_at_epoch(2))
    resumed = learn_stage(runs[1], data_dir=train, device="cpu")
    assert resumed.resumed_from_epoch == 1 and resumed.epoch_losses == straight.epoch_losses
    a, b = RunDir(runs[0]).stage(1).tensors, RunDir(runs[1]).stage(1).tensors
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
