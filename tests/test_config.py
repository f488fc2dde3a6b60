import dataclasses
import math
from typing import get_type_hints

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


def test_a_config_file_may_name_its_preset_and_the_option_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: frozen\ntrain: {skip_unread: false}\n")
    cfg = RunConfig.from_yaml(path)
    assert cfg == RunConfig.for_method("drl", {"train": {"skip_unread": False}}, preset="frozen")
    assert RunConfig.from_yaml(path, preset="paper").score.head == "prototypes"  # drl init --preset paper
    assert RunConfig.from_yaml(tmp_path / "c.yaml").adapter.peft == "none"
    path.write_text("train: {epochs: 3}\n")  # no preset: the method's default one
    assert RunConfig.from_yaml(path).schedule.switch == "transfer"
    path.write_text("preset: [frozen]\n")
    with pytest.raises(UsageError, match="preset must be a preset's name"):
        RunConfig.from_yaml(path)
    path.write_text("preset: fast\n")
    with pytest.raises(UsageError, match="method drl has no preset 'fast'"):
        RunConfig.from_yaml(path)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"train": {"epoch": 3}}, "unknown config.train key"),
        ({"bogus": {}}, "unknown config key"),
        ({"ipa": {"gate": "extra"}}, "ipa.gate must be one of"),
        ({"train": {"epochs": 0}}, r"train.epochs must be a number in \[1, 10000\]"),
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


def _numeric_fields():
    """Every int and float option of every section, as (section, name, type)."""
    cfg = RunConfig()
    for section in ("ipa", "ease", "train", "score"):
        hints = get_type_hints(type(getattr(cfg, section)))
        for f in dataclasses.fields(getattr(cfg, section)):
            kinds = getattr(hints[f.name], "__args__", (hints[f.name],))
            if int in kinds or float in kinds:
                yield section, f.name, float if float in kinds else int


@pytest.mark.parametrize("section, name, kind", list(_numeric_fields()))
def test_every_number_is_finite_and_in_range(section, name, kind, tmp_path):
    """Issue 14 item 5: NaN, ±inf and absurd sizes are refused for every option, from a dict and from YAML."""
    bad = [10**12, -(10**12)] + ([math.nan, math.inf, -math.inf] if kind is float else [])
    for value in bad:
        with pytest.raises(UsageError, match=rf"{section}\.{name} must be"):
            RunConfig.from_dict({section: {name: value}})
    path = tmp_path / "c.yaml"
    if kind is float:  # YAML's own spellings of NaN and infinity
        for text in (".nan", ".inf", "-.inf"):
            path.write_text(f"{section}:\n  {name}: {text}\n")
            with pytest.raises(UsageError, match="must be a finite number"):
                RunConfig.from_yaml(path)


@pytest.mark.parametrize(
    "data",
    [
        {"train": {"momentum": -0.5}},
        {"train": {"momentum": 1.0}},
        {"train": {"lr": 0.0}},
        {"train": {"weight_decay": -1e-4}},
        {"score": {"beta": -1.0}},
        {"ipa": {"adapter_dim": 10**8}},
        {"ipa": {"ffn_dim": 0}},
        {"ease": {"adapter_dim": 10**8}},
        {"train": {"num_workers": 100_000}},
        {"train": {"seed": -1}},
    ],
)
def test_nonsensical_numbers_are_refused(data):
    with pytest.raises(UsageError, match="must be a number in"):
        RunConfig.from_dict(data)


def test_drl_defaults_to_the_ridge_head_and_paper_preset_restores_prototype_scoring():
    assert RunConfig.for_method("drl").score.head == "ridge"
    paper = RunConfig.for_method("drl", preset="paper")
    assert paper.score.head == "prototypes"
    # the preset changes the scoring, and so trains every stage it reads
    assert paper.train == dataclasses.replace(RunConfig.for_method("drl", preset="frozen").train, skip_unread=False)
    # a config written before train.skip_unread existed trains every stage, as it did
    old = RunConfig.for_method("drl", preset="frozen").to_dict()  # such configs predate first_session too
    del old["train"]["skip_unread"]
    assert RunConfig.from_dict(old).train.skip_unread is False
    # sections given on top of a preset win over it
    assert RunConfig.for_method("drl", {"score": {"head": "ridge"}}, preset="paper").score.head == "ridge"
    # a config written before score.head existed reads as prototype scoring
    old = RunConfig.for_method("drl", preset="frozen").to_dict()
    del old["score"]["head"]
    assert RunConfig.from_dict(old).score.head == "prototypes"
    for method in ("simplecil", "ease"):
        assert RunConfig.for_method(method).score.head == "prototypes"
    with pytest.raises(UsageError, match="no preset 'fast'.*paper"):
        RunConfig.for_method("drl", preset="fast")
    with pytest.raises(UsageError, match="no preset"):
        RunConfig.for_method("ease", preset="paper")


def test_benchmark_variant_takes_a_preset():
    from drlcli.benchmark.variants import parse_variant

    variant = parse_variant("drl/preset=paper/lr=0.05")
    config = variant.config(epochs=3, seed=1)
    assert config.score.head == "prototypes" and config.train.lr == 0.05 and config.train.epochs == 3
    assert parse_variant("drl").config(epochs=None, seed=0).score.head == "ridge"
    with pytest.raises(UsageError, match="no preset"):
        parse_variant("drl/preset=nope")


def test_rescore_refuses_the_head_option():
    from drlcli.benchmark.variants import parse_score

    assert parse_score("beta=3") == {"beta": 3}
    with pytest.raises(UsageError, match="head is chosen at init"):
        parse_score("head=ridge")


def test_the_section_names_of_earlier_releases_read_as_today_s(tmp_path):
    """Runs, .drl files, config files and benchmark variants of earlier releases name the ridge head's
    section ``ranpac`` and the adapter's and schedule's together ``first_session`` (issue 60)."""
    from drlcli.benchmark.variants import parse_variant

    old = {"ranpac": {"proj_dim": 64}, "first_session": {"peft": "adaptformer", "stages": "all", "hold_weight": 2.0}}
    new = {
        "ridge": {"proj_dim": 64},
        "adapter": {"peft": "adaptformer"},
        "schedule": {"stages": "all", "hold_weight": 2.0},
    }
    assert RunConfig.for_method("ranpac", old) == RunConfig.for_method("ranpac", new)
    assert RunConfig.from_dict({**RunConfig.for_method("ranpac").to_dict(), "ridge": {}}) == RunConfig.for_method(
        "ranpac"
    )
    written = RunConfig.for_method("ranpac", old).to_dict()
    assert "ranpac" not in written and "first_session" not in written and written["schedule"]["hold_weight"] == 2.0
    path = tmp_path / "old.yaml"
    path.write_text("method: ranpac\nfirst_session: {peft: adaptformer}\nranpac: {proj_dim: 64}\n")
    assert RunConfig.from_yaml(path).adapter.peft == "adaptformer" and RunConfig.from_yaml(path).ridge.proj_dim == 64
    assert parse_variant("ranpac/ranpac.proj_dim=64/first_session.blocks=0.5").overrides == {
        "ridge": {"proj_dim": 64},
        "adapter": {"blocks": 0.5},
    }
    with pytest.raises(UsageError, match="config section ranpac is ridge today: give one of them, not both"):
        RunConfig.for_method("drl", {"ranpac": {"proj_dim": 64}, "ridge": {"proj_dim": 32}})
    with pytest.raises(UsageError, match="unknown key 'gate' in config section first_session"):
        RunConfig.for_method("drl", {"first_session": {"gate": "sum"}})


def test_a_recipe_is_named_once_and_reached_by_either_spelling(tmp_path):
    from drlcli.recipes import LISTED, RECIPES, recipe_for

    assert LISTED == ("default", "frozen", "paper", "ranpac", "ranpac-published", "ease", "simplecil")
    for recipe in RECIPES:  # every recipe builds, and its older spelling builds the same config
        config = RunConfig.for_recipe(recipe.name)
        assert config.method == recipe.method and recipe_for(
            recipe.method, recipe.presets[0] if recipe.presets else None
        )
        if recipe.presets:
            assert RunConfig.for_method(recipe.method, preset=recipe.presets[0]) == config
    assert (
        RunConfig.for_method("drl") == RunConfig.for_recipe("default") == RunConfig.for_method("drl", preset="default")
    )
    path = tmp_path / "c.yaml"
    path.write_text("recipe: ranpac-published\ntrain: {epochs: 3}\n")
    assert RunConfig.from_yaml(path) == RunConfig.for_recipe("ranpac-published", {"train": {"epochs": 3}})
    with pytest.raises(UsageError, match="unknown recipe 'fast'; choose one of"):
        RunConfig.for_recipe("fast")


def test_cli_init_takes_a_recipe_and_run_yaml_records_it(tmp_path):
    import json

    from typer.testing import CliRunner

    from drlcli.cli import app
    from drlcli.synthetic import init_args

    runner = CliRunner()
    run = tmp_path / "run"
    result = runner.invoke(app, ["init", "--run", str(run), *init_args(), "--recipe", "ranpac-published", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["recipe"] == "ranpac-published"
    text = (run / "run.yaml").read_text()
    assert "recipe: ranpac-published" in text and "peft: adaptformer" in text and "first_session" not in text
    shown = runner.invoke(app, ["info", "--run", str(run)])
    assert "recipe ranpac-published (method ranpac)" in shown.stdout
    both = runner.invoke(
        app, ["init", "--run", str(tmp_path / "b"), *init_args(), "--recipe", "frozen", "--method", "drl"]
    )
    assert both.exit_code == 2 and "drop --method and --preset" in both.output
    bad = runner.invoke(app, ["init", "--run", str(tmp_path / "c"), *init_args(), "--recipe", "fast"])
    assert bad.exit_code == 2 and not (tmp_path / "c").exists()
    old = runner.invoke(
        app, ["init", "--run", str(tmp_path / "d"), *init_args(), "--method", "drl", "--preset", "frozen"]
    )
    assert old.exit_code == 0 and "recipe: frozen" in (tmp_path / "d" / "run.yaml").read_text()
