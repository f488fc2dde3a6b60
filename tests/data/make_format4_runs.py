"""Make the run in ``tests/data/format4-runs/`` with the drl of f55ace4, the last commit that wrote
run-directory format 4 (a switched run's frozen track under ``frozen/``, listed in the run's own
manifest), which the format-5 reader must keep loading, evaluating, exporting, forgetting from and
learning::

    git worktree add /tmp/drl-f55ace4 f55ace4
    PYTHONPATH=/tmp/drl-f55ace4 python tests/data/make_format4_runs.py tests/data/format4-runs

``switched``: the default recipe (``drl init`` with no recipe) on the tiny random ViT, two stages of
two generated classes (``tests/data/legacy-runs/data/stage1`` and ``stage2``; ``stage3`` is its next
drop), one epoch; ``answers.json``: its class names, its scores of three fixed images, the track each
stage answered from and its top-1 on ``stage1``, as that commit computed them, and the same (names,
scores) of copies of it after ``drl forget class_02`` (``forget``) and after learning ``stage3``
(``stage3``)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from drlcli import evaluate, forget_class, learn_stage
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.run.load import load_run
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

DATA = Path(__file__).parent / "legacy-runs" / "data"
SMALL = {"ridge": {"proj_dim": 32, "carry_draws": 2, "carry_rank": 2}, "train": {"epochs": 1, "batch_size": 8}}


def main(out: Path) -> None:
    torch.manual_seed(0)
    shutil.rmtree(out, ignore_errors=True)
    run = out / "switched"
    config = RunConfig.for_recipe("default", SMALL)
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    results = [learn_stage(run, data_dir=DATA / f"stage{i}", device="cpu") for i in (1, 2)]
    answers = {
        "switched": {
            **_answers(run),
            "answers": [r.switch["answers"] for r in results],
            "top1_stage1": evaluate(run, data_dir=DATA / "stage1", device="cpu").report.top1,
        }
    }
    for lock in run.rglob(".lock"):
        lock.unlink()
    scratch = out / "scratch"
    forget_class(shutil.copytree(run, scratch / "forget"), "class_02")
    learn_stage(shutil.copytree(run, scratch / "stage3"), data_dir=DATA / "stage3", device="cpu")
    answers["switched"].update({name: _answers(scratch / name) for name in ("forget", "stage3")})
    shutil.rmtree(scratch)
    (out / "answers.json").write_text(json.dumps(answers, indent=1))


def _answers(run: Path) -> dict:
    model = load_run(run, device="cpu").model
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return {"classes": list(model.class_names), "scores": model.classify(images)[0].tolist()}


if __name__ == "__main__":
    main(Path(sys.argv[1]))
