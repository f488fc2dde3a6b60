"""The EASE baseline: independent per-stage adapters, one ViT pass per stage, shared storage."""

import torch

from drlcli import evaluate, learn_stage
from drlcli.commands.export import export_run
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.data.images import scan_class_folders
from drlcli.features.ease import EaseConfig
from drlcli.features.ease.network import EaseNetwork
from drlcli.model.incremental import embed_images
from drlcli.options import TrainConfig
from drlcli.run.load import load_run
from drlcli.serving.drlfile import load_export
from drlcli.stage.train import train_stage
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

CFG = {"input_size": (3, 32, 32), "interpolation": "bicubic", "mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 1.0}


def _ptm_feature(ptm, images):
    return ptm.forward_head(ptm.forward_features(images), pre_logits=True)


def test_a_new_stage_starts_as_the_ptm(tiny_ptm, images):
    net = EaseNetwork(tiny_ptm.eval(), EaseConfig())
    net.new_stage(seed=0)
    net.stages.eval()
    with torch.no_grad():
        assert torch.allclose(net(images)[:, 0], _ptm_feature(tiny_ptm, images), atol=1e-5)


def test_stages_are_independent_and_only_the_newest_trains(tiny_ptm, images, make_folder):
    net = EaseNetwork(tiny_ptm, EaseConfig())
    net.new_stage(seed=0)
    folder = scan_class_folders(make_folder("a", [0, 1], n=4))
    cfg = TrainConfig(epochs=2, batch_size=4, lr=0.1, loss="ce", kd_weight=0.0, scale_init=1.0)
    train_stage(net, folder, cfg, CFG)
    with torch.no_grad():
        first = net(images)[:, 0].clone()
    assert not torch.allclose(first, _ptm_feature(tiny_ptm, images), atol=1e-4)  # stage 1 learned
    before = {k: v.clone() for k, v in net.stages[0].state_dict().items()}
    net.new_stage(seed=1)
    train_stage(net, scan_class_folders(make_folder("b", [2, 3], n=4)), cfg, CFG)
    assert all(torch.equal(v, net.stages[0].state_dict()[k]) for k, v in before.items())
    with torch.no_grad():
        both = net(images)
    assert both.shape == (3, 2, 64)
    assert torch.allclose(both[:, 0], first, atol=1e-6)  # adding stage 2 left subspace 1 alone


def test_ease_runs_end_to_end_and_exports(tmp_path, stage_folders):
    run = tmp_path / "run"
    config = RunConfig.for_method("ease", {"train": {"epochs": 1, "batch_size": 12}})
    assert config.train.loss == "ce" and config.train.kd_weight == 0.0 and config.train.scale_init == 1.0
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    results = [learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu") for train, test in stage_folders[:2]]
    assert [r.num_params for r in results] == [2 * 4 * 64 * 64 + 4 * (64 + 64)] * 2
    loaded = load_run(run, device="cpu")
    assert loaded.model.offset == 0 and loaded.model.real_prototypes.shape == (6, 2, 64)
    assert evaluate(run, all_seen=True, device="cpu").report.top1 == results[-1].eval.top1
    export_run(run, tmp_path / "m.drl")
    exported = load_export(tmp_path / "m.drl")
    test_dir = scan_class_folders(stage_folders[1][1])
    scores = [
        m.scores(embed_images(m.network, test_dir, m.data_config, batch_size=16)[0]) for m in (exported, loaded.model)
    ]
    assert torch.allclose(scores[0], scores[1], atol=1e-6)
