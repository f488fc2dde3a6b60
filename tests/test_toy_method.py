"""A recipe's three parts are each added in one place (issues 31 and 60): a toy feature network with
its own option section, registered by one ``METHODS`` entry, goes through init, learn-stage, eval,
export, predict from the export, and forget/restore, with no other change; a schedule is one
``Method.schedule`` and a recipe one ``RECIPES`` entry, which init, info, the card and the benchmark's
variants then take by name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drlcli import methods, recipes
from drlcli.config import RunConfig
from drlcli.methods.base import Method
from drlcli.options import Range, TrainConfig, option
from drlcli.schedule import Schedule
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS


@dataclass(frozen=True)
class ToyConfig:
    """The toy's own section of a run config."""

    rank: int = option(4, within=Range(1, 64))


class ToyStage(nn.Module):
    """One stage: a low-rank residual on the PTM's class token."""

    def __init__(self, width: int, rank: int):
        super().__init__()
        self.down = nn.Parameter(torch.randn(width, rank) * 0.1)
        self.up = nn.Parameter(torch.zeros(rank, width))

    def forward(self, f0: Tensor) -> Tensor:
        return F.layer_norm(f0 + torch.relu(f0 @ self.down) @ self.up, f0.shape[-1:])

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class ToyNetwork(nn.Module):
    """The ``StageNetwork`` protocol: one subspace per stage (no PTM subspace: offset 0)."""

    def __init__(self, ptm: nn.Module, cfg: ToyConfig):
        super().__init__()
        self.ptm, self.cfg = ptm, cfg
        self.width = ptm.embed_dim
        self.stages = nn.ModuleList()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_subspaces(self) -> int:
        return len(self.stages)

    def new_stage(self, *, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        stage = ToyStage(self.width, self.cfg.rank)
        self.stages.append(stage)
        return stage

    def _f0(self, images: Tensor) -> Tensor:
        with torch.no_grad():
            return self.ptm.forward_features(images)[:, 0]

    def forward(self, images: Tensor, stages: int | None = None, layout: int = 0, probes: tuple[int, ...] = ()):
        if layout or probes:
            raise ValueError("the toy network has no PTM subspace")
        f0 = self._f0(images)
        run = list(self.stages)[:stages]
        if not run:
            return images.new_zeros(images.shape[0], 0, self.width)
        return torch.stack([stage(f0) for stage in run], dim=1)

    def forward_train(self, images: Tensor) -> tuple[Tensor | None, Tensor]:
        f0 = self._f0(images)
        return f0, self.stages[-1](f0)


TOY = Method(
    name="toy",
    build=lambda ptm, config: ToyNetwork(ptm, config.toy),
    trains=True,
    offset=0,
    tensor_prefix="toy.",
    sections={"toy": ToyConfig},
    train_defaults=TrainConfig(epochs=1, batch_size=12, kd_weight=0.5),
)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(methods.METHODS, "toy", TOY)  # the one registry line


def test_a_method_registered_in_one_line_goes_through_every_command(toy, tmp_path, stage_folders):
    from drlcli import evaluate, export_run, forget_class, init_run, learn_stage, load_model, restore_class
    from drlcli.api import info, predict_sources

    config = RunConfig.for_method("toy", {"toy": {"rank": 3}})
    assert config.toy.rank == 3 and config.to_dict()["toy"] == {"rank": 3}
    run = tmp_path / "run"
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    for train, test in stage_folders[:2]:
        result = learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu")
        assert result.status == "learned" and result.num_params == 2 * 64 * 3
    report = evaluate(run, all_seen=True, device="cpu").report
    assert report.num_images == 6 * 4 and 0 <= report.top1 <= 100
    stages = info(run)["stages"]
    assert [s["num_params"] for s in stages] == [384, 384]
    assert [s["cumulative_params"] for s in stages] == [384, 768]  # stage networks add up

    exported = export_run(run, tmp_path / "toy.drl")
    images = sorted(str(p) for p in stage_folders[1][1].rglob("*.png"))
    from_run = list(predict_sources(images, run_dir=run, device="cpu"))
    from_file = list(predict_sources(images, model_path=tmp_path / "toy.drl", device="cpu"))
    assert exported.num_classes == 6 and [p.top for p in from_file] == [p.top for p in from_run]
    assert (
        load_model(tmp_path / "toy.drl").class_names
        == info(run)["stages"][0]["classes"] + info(run)["stages"][1]["classes"]
    )

    name = info(run)["stages"][0]["classes"][0]
    forget_class(run, name)
    assert name not in load_model(export_run(run, tmp_path / "after.drl").path).class_names
    restore_class(run, name)
    restored = list(predict_sources(images, run_dir=run, device="cpu"))
    assert [p.top for p in restored] == [p.top for p in from_run]


# a schedule: the toy network trained in stage 1 only; a recipe: that schedule with rank 2
TOY_FIRST = dataclasses.replace(TOY, name="toy-first", schedule=lambda config: Schedule(trained_stages=1))
TOY_RECIPE = recipes.Recipe(
    "toy-rank2", "toy-first", "a low-rank residual", "stage 1 only", "prototypes", {"toy": {"rank": 2}}
)


def test_a_schedule_and_a_recipe_are_each_one_entry(monkeypatch, tmp_path, stage_folders):
    from drlcli import init_run, learn_stage
    from drlcli.api import info
    from drlcli.benchmark.variants import parse_variant
    from drlcli.commands.card import model_card

    monkeypatch.setitem(methods.METHODS, "toy-first", TOY_FIRST)
    monkeypatch.setattr(recipes, "RECIPES", (*recipes.RECIPES, TOY_RECIPE))
    monkeypatch.setitem(recipes.BY_NAME, "toy-rank2", TOY_RECIPE)
    config = RunConfig.for_recipe("toy-rank2")
    assert config.method == "toy-first" and config.toy.rank == 2
    assert parse_variant("toy-rank2/epochs=1").config(epochs=None, seed=0) == config.with_train(epochs=1)
    run = tmp_path / "run"
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    results = [learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu") for train, test in stage_folders[:2]]
    assert [r.num_params for r in results] == [2 * 64 * 2, 0]  # the schedule trains stage 1 alone
    assert info(run)["recipe"] == "toy-rank2"
    card = model_card(run).card
    assert "- Recipe: `toy-rank2`, as shipped" in card, card[card.index("## Recipe") :][:300]
