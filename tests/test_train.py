import random

import pytest
import torch

import drlcli.stage.train as train_module
from drlcli.data.images import scan_class_folders
from drlcli.data.loading import ImageDataset, eval_transform
from drlcli.features.ipa import IPAConfig
from drlcli.features.ipa.network import IPANetwork
from drlcli.options import TrainConfig
from drlcli.stage.train import PROGRESS_EVERY, CosineClassifier, initial_class_means, train_stage

CFG = {"input_size": [3, 32, 32], "interpolation": "bicubic", "mean": [0.5] * 3, "std": [0.5] * 3, "crop_pct": 0.875}


def _snapshot(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_training_changes_only_the_new_stage(tiny_ptm, make_folder):
    net = IPANetwork(tiny_ptm, IPAConfig())
    old = net.new_stage(seed=0)
    old.requires_grad_(False)
    net.new_stage(seed=1)
    ptm_before, old_before, new_before = _snapshot(tiny_ptm), _snapshot(old), _snapshot(net.stages[-1])
    images = scan_class_folders(make_folder("d", [0, 1], n=6))
    result = train_stage(net, images, TrainConfig(epochs=2, batch_size=6), CFG)
    assert all(torch.equal(v, tiny_ptm.state_dict()[k]) for k, v in ptm_before.items())  # bit-identical
    assert all(torch.equal(v, old.state_dict()[k]) for k, v in old_before.items())
    assert any(not torch.equal(v, net.stages[-1].state_dict()[k]) for k, v in new_before.items())
    assert len(result.epoch_losses) == 2 and result.steps == 4
    assert not any(p.requires_grad for p in net.stages[-1].parameters())  # frozen once trained


def test_progress_reads_the_loss_every_few_steps_and_the_epoch_loss_is_exact(tiny_ptm, make_folder, monkeypatch):
    """Progress reads the loss (a GPU sync) at the first, every PROGRESS_EVERY-th and the last
    step only; the epoch's loss, summed on the device, is still the mean over every image."""
    net = IPANetwork(tiny_ptm, IPAConfig())
    net.new_stage(seed=0)
    images = scan_class_folders(make_folder("d", [0, 1], n=12))  # 24 images, batch 2: 12 steps
    steps = []
    loss_of_step = train_module.stage_loss

    def recording(logits, targets, *args):
        loss = loss_of_step(logits, targets, *args)
        steps.append((loss.item(), len(targets)))
        return loss

    monkeypatch.setattr(train_module, "stage_loss", recording)
    reports = []
    result = train_stage(net, images, TrainConfig(epochs=1, batch_size=2), CFG, progress=reports.append)
    assert [r.step for r in reports] == [1, PROGRESS_EVERY, 12] and {r.steps for r in reports} == {12}
    assert [r.loss for r in reports] == [steps[0][0], steps[PROGRESS_EVERY - 1][0], steps[-1][0]]
    assert result.epoch_losses == [pytest.approx(sum(v * n for v, n in steps) / 24, rel=1e-12)]


def test_single_class_stage_trains_with_das(tiny_ptm, make_folder):
    net = IPANetwork(tiny_ptm, IPAConfig())
    net.new_stage(seed=0)
    before = _snapshot(net.stages[-1])
    images = scan_class_folders(make_folder("one", [3], n=8))
    result = train_stage(net, images, TrainConfig(epochs=3, batch_size=8, lr=0.05), CFG)
    assert result.epoch_losses[-1] < result.epoch_losses[0]
    assert any(not torch.equal(v, net.stages[-1].state_dict()[k]) for k, v in before.items())


def test_single_class_stage_with_ce_has_zero_loss_and_keeps_its_adapter(tiny_ptm, make_folder):
    # the failure DAS exists to fix: CE over one class gives no gradient to the stage
    net = IPANetwork(tiny_ptm, IPAConfig())
    net.new_stage(seed=0)
    images = scan_class_folders(make_folder("one", [3], n=4))
    result = train_stage(net, images, TrainConfig(epochs=2, batch_size=4, loss="ce", kd_weight=0.0), CFG)
    assert result.epoch_losses == [0.0, 0.0]
    assert torch.count_nonzero(net.stages[-1].up) == 0


def test_cosface_trains_the_stage_and_its_margin_is_read(tiny_ptm, make_folder, monkeypatch):
    """``loss: cosface`` trains the new stage through the classifier's own σ and the config's margin."""
    from drlcli.features import losses

    seen = []
    real = losses.cosface_loss
    monkeypatch.setattr(train_module, "cosface_loss", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    net = IPANetwork(tiny_ptm, IPAConfig())
    net.new_stage(seed=0)
    images = scan_class_folders(make_folder("d", [0, 1], n=6))
    result = train_stage(net, images, TrainConfig(epochs=2, batch_size=6, loss="cosface", margin=0.2, lr=0.05), CFG)
    assert seen and {kw["margin"] for kw in seen} == {0.2} and all(kw["scale"].requires_grad for kw in seen)
    assert all(l > 0 for l in result.epoch_losses) and torch.count_nonzero(net.stages[-1].up) > 0


def test_training_is_reproducible(tiny_ptm, make_folder):
    """Whatever the caller did with Python's ``random`` (timm's crop draws from it) and torch's
    generator, the same seed trains the same stage; the caller's states are given back."""
    images = scan_class_folders(make_folder("d", [0, 1], n=4))
    states = []
    for caller_seed in (1, 2):
        random.seed(caller_seed)
        torch.manual_seed(caller_seed)
        net = IPANetwork(tiny_ptm, IPAConfig())
        net.new_stage(seed=0)
        before = random.getstate()
        train_stage(net, images, TrainConfig(epochs=1, batch_size=4, seed=3), CFG)
        assert random.getstate() == before
        states.append(_snapshot(net.stages[-1]))
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_cosine_classifier_scale_lets_logits_pass_the_anchor():
    clf = CosineClassifier(8, 3, scale_init=16.0)
    feats = clf.weight.detach()[:1] * 5
    assert clf(feats)[0, 0].item() == pytest.approx(16.0, rel=1e-5)


def test_prototype_head_init_starts_at_the_class_means(tiny_ptm, make_folder):
    images = scan_class_folders(make_folder("d", [0, 1, 2], n=6))
    net = IPANetwork(tiny_ptm, IPAConfig())
    net.new_stage(seed=0)
    with torch.no_grad():
        feats = net(torch.stack([_eval_image(images, i) for i in range(len(images))]))[:, -1]
    labels = torch.tensor(images.labels)
    expected = torch.stack([feats[labels == c].mean(0) for c in range(3)])
    assert torch.allclose(initial_class_means(net, images, CFG, batch_size=4), expected, atol=1e-5)
    # starting there, the stage's images are already classified: the first epoch's loss is far
    # below a random head's (lr tiny, so the epoch measures the starting point)
    losses = {}
    for init in ("random", "prototypes"):
        net = IPANetwork(tiny_ptm, IPAConfig())
        net.new_stage(seed=0)
        cfg = TrainConfig(epochs=1, batch_size=18, lr=1e-8, loss="ce", kd_weight=0.0, head_init=init)
        losses[init] = train_stage(net, images, cfg, CFG).epoch_losses[0]
    assert losses["prototypes"] < 0.5 * losses["random"]


def _eval_image(images, index):
    return ImageDataset(images, eval_transform(CFG))[index][0]


def test_weight_decay_covers_the_stage_and_class_weights_but_not_the_scale(tiny_ptm):
    """One place decides the optimiser's groups: decay on the trainable stage parameters and the
    class weights, none on σ; a stage's frozen parameters (gate=sum) are not optimised at all."""
    from drlcli.stage.train import _optimizer

    net = IPANetwork(tiny_ptm, IPAConfig(gate="sum"))
    stage = net.new_stage(seed=0)
    classifier = CosineClassifier(net.width, 3, scale_init=16.0)
    cfg = TrainConfig(weight_decay=1e-3, lr=0.05, momentum=0.8, epochs=4)
    optimizer, schedule, params = _optimizer(stage, classifier, cfg)
    decay, no_decay = optimizer.param_groups
    trainable = [p for p in stage.parameters() if p.requires_grad]
    assert len(trainable) < len(list(stage.parameters()))  # the gate is frozen under gate=sum

    def ids(tensors):
        return [id(t) for t in tensors]

    assert ids(decay["params"]) == ids([*trainable, classifier.weight]) and decay["weight_decay"] == 1e-3
    assert ids(no_decay["params"]) == [id(classifier.scale)] and no_decay["weight_decay"] == 0.0
    assert all(g["lr"] == 0.05 and g["momentum"] == 0.8 for g in optimizer.param_groups)
    assert ids(params) == ids([*trainable, classifier.weight, classifier.scale])  # the checkpoint's momentum.<i> order
    assert schedule.T_max == 4
