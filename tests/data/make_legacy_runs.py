"""Make the runs in ``tests/data/legacy-runs/`` with the drl of another commit (the runs the
format-4 reader must keep loading: a switched run kept its frozen track as a run of its own).

    git worktree add /tmp/drl-b4fbb16 b4fbb16
    PYTHONPATH=/tmp/drl-b4fbb16 python tests/data/make_legacy_runs.py tests/data/legacy-runs

Each run: the tiny random ViT, two stages of two generated classes (4 images each, 1 epoch); ``data/stage3``: a third drop;
``answers.json``: each run's class names and its scores of three fixed images, as that release
computed them."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from drlcli import learn_stage
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.run.load import load_run
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

SMALL = {"ranpac": {"proj_dim": 32, "carry_draws": 2, "carry_rank": 2}, "train": {"epochs": 1, "batch_size": 8}}
RUNS = {
    "switched": ("drl", None),
    "frozen": ("drl", "frozen"),
    "paper": ("drl", "paper"),
    "published": ("ranpac", "published"),
}


def main(out: Path) -> None:
    torch.manual_seed(0)
    shutil.rmtree(out, ignore_errors=True)
    data = out / "data"
    stages = [make_class_folders(data / f"stage{i}", [2 * i, 2 * i + 1], images_per_class=4) for i in (1, 2, 3)]
    answers = {}
    for name, (method, preset) in RUNS.items():
        sections = {k: v for k, v in SMALL.items() if k != "ranpac" or method in ("drl", "ranpac")}
        run = out / name
        config = RunConfig.for_method(method, sections, preset=preset)
        init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
        for folder in stages[:2]:
            learn_stage(run, data_dir=folder, device="cpu")
        model = load_run(run, device="cpu").model
        images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        answers[name] = {"classes": list(model.class_names), "scores": model.classify(images)[0].tolist()}
    for run in out.iterdir():
        for lock in run.rglob(".lock"):
            lock.unlink()
    (out / "answers.json").write_text(json.dumps(answers, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
