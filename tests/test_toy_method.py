"""A new method touches one folder and one registry line (issue 31): a toy method, defined here with
its own network and option section and registered by one ``METHODS`` entry, goes through init,
learn-stage, eval, export, predict from the export, and forget/restore, with no other change."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drlcli import methods
from drlcli.config import RunConfig
from drlcli.methods.base import Method
from drlcli.options import Range, TrainConfig, option
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
