"""The method registry: each method's facts live in its module, and the rest of drl reads them."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from drlcli.config import RunConfig
from drlcli.errors import UsageError
from drlcli.features import StageNetwork
from drlcli.features.ipa import build as build_ipa
from drlcli.methods import METHODS, get_method, method_of, stage_is_read
from drlcli.methods.base import Method
from drlcli.options import TrainConfig


def test_the_registry_is_the_cli_s_list_of_methods():
    assert tuple(METHODS) == ("drl", "simplecil", "ease", "ranpac")
    assert all(name == m.name for name, m in METHODS.items())
    assert method_of(RunConfig.for_method("ease")) is METHODS["ease"]
    with pytest.raises(
        UsageError, match=r"unknown method 'foo'; choose one of \['drl', 'simplecil', 'ease', 'ranpac'\]"
    ):
        get_method("foo")


def test_the_facts_of_each_method():
    facts = {n: (m.trains, m.offset, m.tensor_prefix, m.head is not None) for n, m in METHODS.items()}
    assert facts == {
        "drl": (True, 1, "ipa.", False),
        "simplecil": (False, 1, "", False),
        "ease": (True, 0, "ease.", False),
        "ranpac": (True, 1, "adapt.", True),  # stage 1 alone, with a first session; the head names its own tensors
    }
    differing = {n: m.train_defaults for n, m in METHODS.items() if m.train_defaults != TrainConfig()}
    # what `learn-stage --help` names beside drl's
    assert differing == {"ease": METHODS["ease"].train_defaults, "ranpac": METHODS["ranpac"].train_defaults}
    ease = RunConfig.for_method("ease").train
    assert (ease.loss, ease.kd_weight, ease.scale_init, ease.lr) == ("ce", 0.0, 1.0, 0.025)
    # drl's frozen recipe is TrainConfig's, except that its head reads no stage: none is trained
    assert RunConfig.for_method("drl", preset="frozen").train == dataclasses.replace(TrainConfig(), skip_unread=True)
    assert RunConfig.for_method("drl", preset="paper").train == TrainConfig()
    # its default is the switched schedule: the adapter set trained with cross-entropy, no distillation
    default = RunConfig.for_method("drl")
    assert default == RunConfig.for_method("drl", preset="switched") == RunConfig.for_recipe("default")
    assert default.train == dataclasses.replace(
        TrainConfig(),
        skip_unread=True,
        loss="ce",
        kd_weight=0.0,
        lr=0.05,
        epochs=20,
        batch_size=48,
        scale_init=16.0,
        precision="auto",
    )
    assert (default.adapter.peft, default.schedule.switch, default.schedule.pause) == (
        "adaptformer",
        "transfer",
        "transfer",
    )
    # the recipe measured as ranpac --preset switched: the same run but for the method's name and the
    # carried classes' sums (closed-form means, centred Grams, fewer draws: the twentieth round's; the
    # rows split between the fit and held-out Grams: the twenty-first's)
    same = RunConfig.for_method("ranpac", preset="switched").to_dict()
    mine = default.to_dict()
    assert {k for k in mine if mine[k] != same[k]} == {"method", "score", "train", "ridge", "schedule"}
    # ... and for the default's trial of stage 1 (``stage/trial.py``), which ranpac's preset keeps off
    assert {k for k, v in mine["schedule"].items() if v != same["schedule"][k]} == {
        "trial",
        "trial_answers",
        "trial_answers_small_stage",
        "train_min_classes",
        "later_epochs",  # and for its later stages' 5 epochs in batches of 12
        "later_batch_size",
    }
    assert {k: v for k, v in mine["ridge"].items() if same["ridge"][k] != v} == {
        "carry_mean": "exact",
        "carry_draws": 25,
        "carry_gram_draws": 50_000,
        "carry_grams": "split",
    }
    assert tuple(same["ridge"][k] for k in ("carry_mean", "carry_draws", "carry_gram_draws", "carry_grams")) == (
        "drawn",
        100,
        None,
        "shared",
    )
    assert mine["score"]["head"] == "ridge" and {k: v for k, v in mine["train"].items() if same["train"][k] != v} == {
        "skip_unread": True,  # which a carried network ignores: it trains every stage it does not pause
        "precision": "auto",  # bf16 training where the device computes it natively
    }


@pytest.mark.parametrize("name", list(METHODS))
def test_every_network_follows_the_stage_network_protocol(name, tiny_ptm, images):
    method = METHODS[name]
    network = method.build(tiny_ptm.eval(), RunConfig.for_method(name))
    assert isinstance(network, StageNetwork)
    assert (network.num_stages, network.num_subspaces) == (0, method.offset)
    if method.trains:
        stage = network.new_stage(seed=0)
        assert stage.num_params() > 0 and network.num_subspaces == method.offset + 1
        _, feats = network.forward_train(images)
        assert feats.shape == (len(images), network.width)
    with torch.no_grad():
        assert network(images).shape == (len(images), network.num_subspaces, network.width)


def test_method_rules_are_checked_with_every_config():
    with pytest.raises(UsageError, match="kd_weight must be 0 for method ease"):
        RunConfig.for_method("ease", {"train": {"kd_weight": 0.5}})
    RunConfig.for_method("drl", {"train": {"kd_weight": 0.5}}, preset="frozen")  # the IPA network distils
    with pytest.raises(UsageError, match="kd_weight must be 0 for method drl adapting the PTM"):
        RunConfig.for_method("drl", {"train": {"kd_weight": 0.5}})
    with pytest.raises(UsageError, match="score.head must be ridge for method drl adapting the PTM"):
        RunConfig.for_method("drl", {"score": {"head": "prototypes"}})
    with pytest.raises(UsageError, match="ridge.subspaces must be 1 for method drl adapting the PTM"):
        RunConfig.for_method("drl", {"ridge": {"subspaces": 2}})
    # a method's section rules hold in every config: each run.yaml holds every section
    for name in ("drl", "ranpac"):
        with pytest.raises(UsageError, match="ridge.lambda_min_exp must be <= ridge.lambda_max_exp"):
            RunConfig.for_method(name, {"ridge": {"lambda_min_exp": 2, "lambda_max_exp": 1}})
        with pytest.raises(UsageError, match="ridge.carry_gram_draws needs the closed-form"):
            RunConfig.for_method(name, {"ridge": {"carry_mean": "drawn", "carry_gram_draws": 1000}})
        with pytest.raises(UsageError, match="ridge.carry_grams split needs the closed-form"):
            RunConfig.for_method(
                name, {"ridge": {"carry_mean": "drawn", "carry_gram_draws": None, "carry_grams": "split"}}
            )


def test_a_registered_method_is_known_to_the_config(monkeypatch):
    """Adding a method is its module plus a registry entry: defaults and rules then apply."""

    def rules(cfg):
        if cfg.train.epochs > 5:
            raise UsageError("toy trains 5 epochs at most")

    toy = Method("toy", build_ipa, trains=True, offset=1, tensor_prefix="toy.", train_defaults=TrainConfig(epochs=3))
    monkeypatch.setitem(METHODS, "toy", dataclasses.replace(toy, rules=rules))
    assert RunConfig.for_method("toy").train.epochs == 3
    with pytest.raises(UsageError, match="5 epochs at most"):
        RunConfig.for_method("toy", {"train": {"epochs": 6}})


def test_the_registry_loads_without_torch():
    """``drl --help`` lists the methods: the registry must not pull in torch (networks load when built)."""
    code = "import sys, drlcli.methods as m, drlcli.config; list(m.METHODS); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_a_stage_is_read_by_the_prototype_bank_always_by_the_ridge_head_as_configured():
    drl = RunConfig.for_method("drl", preset="frozen")
    assert [stage_is_read(drl, k) for k in (1, 2)] == [False, False]  # the frozen head reads the PTM
    assert stage_is_read(RunConfig.for_method("drl", preset="paper"), 5)
    with_stage_1 = RunConfig.for_method("drl", {"ridge": {"subspaces": 2}}, preset="frozen")
    assert [stage_is_read(with_stage_1, k) for k in (1, 2)] == [True, False]
    assert stage_is_read(RunConfig.for_method("ease"), 3)


def _learned(path, stages, config):
    from drlcli import learn_stage
    from drlcli.commands.init import init_run
    from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

    init_run(path, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    opts = {"epochs": 2, "batch_size": 12, "lr": 0.05}
    return [learn_stage(path, data_dir=train, train_overrides=opts, device="cpu") for train, _ in stages]


def test_a_stage_nothing_reads_has_no_network_and_changes_no_answer(tmp_path, stage_folders):
    """The frozen drl head reads the PTM only: learn-stage makes no stage network at all (nothing
    trained, computed or stored, issue 32), and every answer (scores, the "unknown" margin) is the
    answer of a run that trained and stored them, up to float rounding: a run that computes stage
    streams writes the PTM's blocks out, one that computes none runs timm's fused blocks, and the
    ridge solve amplifies that rounding in the head's weights (not in its answers)."""
    from drlcli.cli.render import learn_stage as render
    from drlcli.data.decode import load_rgb
    from drlcli.data.images import scan_class_folders
    from drlcli.data.loading import eval_transform
    from drlcli.run.directory import RunDir
    from drlcli.run.load import load_run

    stages = stage_folders[:2]
    skipped = _learned(tmp_path / "skipped", stages, RunConfig.for_method("drl", preset="frozen"))
    trained = _learned(
        tmp_path / "trained", stages, RunConfig.for_method("drl", {"train": {"skip_unread": False}}, preset="frozen")
    )
    assert all(r.training_skipped and r.epoch_losses == [] and r.scale is None for r in skipped)
    assert all(not r.training_skipped and len(r.epoch_losses) == 2 for r in trained)
    assert "no stage adapters" in render(skipped[0].to_dict()) and "training" not in render(skipped[0].to_dict())
    assert "no stage adapters" not in render(trained[0].to_dict())
    a, b = load_run(tmp_path / "skipped", device="cpu"), load_run(tmp_path / "trained", device="cpu")
    assert (
        a.stage_metas[0]["metrics"]["train"]["skipped"] is True
        and "skipped" not in b.stage_metas[0]["metrics"]["train"]
    )
    # nothing of a stage network in the run: no parameters, and prototypes for f_0 alone
    assert a.model.network.num_stages == 0 and b.model.network.num_stages == 2
    for index in (1, 2):
        assert not any(name.startswith("ipa.") for name in RunDir(tmp_path / "skipped").stage(index).tensors)
    assert skipped[0].num_params == skipped[0].to_dict()["num_params"] > 0  # the head's W, solved
    assert skipped[0].stage_bytes < trained[0].stage_bytes
    pa, pb = a.model.real_prototypes, b.model.real_prototypes
    assert pa.shape[1] == 1 and torch.allclose(pa[:, 0], pb[:, 0], atol=1e-5)
    images = scan_class_folders(stages[1][1])
    transform = eval_transform(a.model.data_config)
    batch = torch.stack([transform(load_rgb(path)) for path in images.paths])
    with torch.no_grad():
        fa, fb = a.model.features(batch, open_set=True), b.model.features(batch, open_set=True)
    assert torch.equal(fa, fb)  # neither computes a stream to answer
    (sa, ka), (sb, kb) = a.model.split(fa), b.model.split(fb)
    scores_a, scores_b = a.model.scores(sa), b.model.scores(sb)
    # the ridge solve (1,024 random features, 60 images) amplifies the fused blocks' rounding in the
    # statistics, so the scores agree to a fraction of their scale, not to float precision
    assert (scores_a - scores_b).abs().max() < 0.01 * scores_b.abs().max()
    assert torch.equal(scores_a.argmax(1), scores_b.argmax(1))
    assert torch.allclose(a.model.known(ka), b.model.known(kb), atol=1e-4)


def test_a_stage_the_head_reads_is_trained(tmp_path, stage_folders):
    """ridge.subspaces 2 reads stage 1's subspace: stage 1 is trained, stage 2 is not."""
    from drlcli.run.load import load_run

    config = RunConfig.for_method("drl", {"ridge": {"subspaces": 2}}, preset="frozen")
    first, second = _learned(tmp_path / "run", stage_folders[:2], config)
    assert not first.training_skipped and len(first.epoch_losses) == 2
    assert second.training_skipped and second.epoch_losses == []
    # the second stage has no network: the run holds stage 1's alone, and f_0 and f_1 for every class
    model = load_run(tmp_path / "run", device="cpu").model
    assert model.network.num_stages == 1 and model.real_prototypes.shape[1] == 2
    assert model.real_prototypes[len(first.classes) :].abs().sum(-1).gt(0).all()
