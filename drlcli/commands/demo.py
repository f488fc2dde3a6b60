"""The built-in offline default: generated images, a small random ViT, three stages end to end.

It runs the same library calls as the CLI commands (init, learn-stage, eval, export), so a green
demo means the whole product works on this machine, without weights or downloads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import RunStateError
from ..progress import ProgressFn
from ..run.access import refuse_inside_run
from ..stage import learn_stage
from ..synthetic import TINY_PTM, TINY_PTM_KWARGS, make_stages
from .evaluate import evaluate
from .export import export_run
from .init import init_run


def run_demo(
    out_dir: Path,
    *,
    num_stages: int = 3,
    classes_per_stage: int = 4,
    epochs: int = 3,
    device: str = "auto",
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    out_dir = Path(out_dir)
    run_dir = out_dir / "run"
    refuse_inside_run(out_dir, option="--out")
    if os.path.lexists(out_dir) and (not out_dir.is_dir() or out_dir.is_symlink() or any(out_dir.iterdir())):
        raise RunStateError(
            f"{out_dir} already exists and is not an empty folder; the demo writes only into a new one: pass "
            "another --out or remove it"
        )
    stages = make_stages(out_dir / "data", num_stages=num_stages, classes_per_stage=classes_per_stage, train=24, test=8)
    # the default drl recipe: stage 1 trains the carried adapter set, so the demo checks training too
    config = RunConfig.for_method("drl")
    init_run(run_dir, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    results = []
    for train_dir, test_dir in stages:
        result = learn_stage(
            run_dir,
            data_dir=train_dir,
            eval_data_dir=test_dir,
            train_overrides={"epochs": epochs, "batch_size": 16},
            device=device,
            progress=progress,
        )
        results.append(result.to_dict())
    final = evaluate(run_dir, all_seen=True, device=device, progress=progress)
    exported = export_run(run_dir, out_dir / "model.drl", progress=progress)
    return {
        "run_dir": str(run_dir),
        "data_dir": str(out_dir / "data"),
        "export": exported.to_dict(),
        "stages": [
            {
                "stage": r["stage"],
                "classes": len(r["classes"]),
                "accuracy": r["eval"]["top1"],
                "seconds": r["total_seconds"],
            }
            for r in results
        ],
        **final.to_dict(),
    }
