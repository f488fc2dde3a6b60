import pytest

from drlcli.config import RunConfig
from drlcli.errors import UsageError


def test_defaults_are_the_papers():
    cfg = RunConfig()
    assert (cfg.train.epochs, cfg.train.batch_size, cfg.train.lr) == (20, 48, 0.01)
    assert (cfg.train.lambda_pos, cfg.train.lambda_neg, cfg.train.kd_weight) == (3.0, 1.0, 0.5)
    assert (cfg.train.anchor_pos, cfg.train.anchor_neg) == (1.0, 1.0)
    assert cfg.train.scale_init > cfg.train.anchor_pos
    assert (cfg.ipa.gamma, cfg.ipa.gate, cfg.ipa.attention) == (0.9, "adapt", "reuse")
    assert cfg.ipa.resolved_adapter_dim(768) == 48 and cfg.ipa.resolved_adapter_dim(192) == 12


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("method: drl\nipa: {gate: sum, adapter_dim: 16}\ntrain: {epochs: 3, lr: 1}\n")
    cfg = RunConfig.from_yaml(path)
    assert cfg.ipa.gate == "sum" and cfg.ipa.adapter_dim == 16
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "data, message",
    [
        ({"train": {"epoch": 3}}, "unknown config.train key"),
        ({"bogus": {}}, "unknown config key"),
        ({"ipa": {"gate": "extra"}}, "ipa.gate must be one of"),
        ({"train": {"epochs": 0}}, "train.epochs must be > 0"),
        ({"train": {"epochs": "3"}}, "must be int"),
        ({"ipa": {"gamma": 1.5}}, "gamma"),
        ({"method": "ease2"}, "unknown method"),
    ],
)
def test_bad_config_is_refused(data, message):
    with pytest.raises(UsageError, match=message):
        RunConfig.from_dict(data)


def test_with_train_overrides_only_given_values():
    cfg = RunConfig().with_train(epochs=2, lr=None)
    assert cfg.train.epochs == 2 and cfg.train.lr == 0.01
    with pytest.raises(UsageError):
        RunConfig().with_train(batch_size=0)
