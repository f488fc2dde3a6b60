import torch

from drlcli.data.images import scan_class_folders
from drlcli.features.ipa import IPAConfig
from drlcli.features.ipa.network import IPANetwork
from drlcli.options import TrainConfig
from drlcli.seeding import reseed, seeded
from drlcli.stage.train import train_stage

CFG = {"input_size": [3, 32, 32], "interpolation": "bicubic", "mean": [0.5] * 3, "std": [0.5] * 3, "crop_pct": 0.875}


def test_seeded_gives_the_cpu_generator_back_and_draws_the_same():
    before = torch.get_rng_state()
    with seeded(5):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    reseed(5)
    assert torch.equal(torch.rand(3), first)


def test_training_a_stage_leaves_every_gpu_generator_alone(tiny_ptm, make_folder, monkeypatch):
    """torch.manual_seed would reseed every GPU's generator (at once, or when CUDA starts), which a
    fork of the CPU's does not give back: the caller's CUDA randomness would change under it."""
    touched = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: touched.append(("all", seed)))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: touched.append(("current", seed)))
    before = torch.get_rng_state()
    net = IPANetwork(tiny_ptm, IPAConfig())
    net.new_stage(seed=0)
    images = scan_class_folders(make_folder("d", [0, 1], n=4))
    train_stage(net, images, TrainConfig(epochs=1, batch_size=4, seed=3), CFG)
    assert touched == []
    assert torch.equal(torch.get_rng_state(), before)
