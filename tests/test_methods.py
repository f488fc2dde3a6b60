"""The method registry: each method's facts live in its module, and the rest of drl reads them."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from drlcli.config import RunConfig, TrainConfig
from drlcli.errors import UsageError
from drlcli.methods import METHODS, Method, StageNetwork, get_method, method_of
from drlcli.methods.drl import build_ipa


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
        "ranpac": (False, 1, "ranpac.", True),
    }
    differing = {n: m.train_defaults for n, m in METHODS.items() if m.train_defaults != TrainConfig()}
    assert differing == {"ease": METHODS["ease"].train_defaults}  # what `learn-stage --help` names beside drl's
    ease = RunConfig.for_method("ease").train
    assert (ease.loss, ease.kd_weight, ease.scale_init, ease.lr) == ("ce", 0.0, 1.0, 0.025)
    assert RunConfig.for_method("drl").train == TrainConfig()


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
    RunConfig.for_method("drl", {"train": {"kd_weight": 0.5}})  # only ease's rule
    # a method's section rules hold in every config: each run.yaml holds every section
    for name in ("drl", "ranpac"):
        with pytest.raises(UsageError, match="ranpac.lambda_min_exp must be <= ranpac.lambda_max_exp"):
            RunConfig.for_method(name, {"ranpac": {"lambda_min_exp": 2, "lambda_max_exp": 1}})


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
