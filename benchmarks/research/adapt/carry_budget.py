"""What the carried classes' draws cost and what fewer of them lose (issue 32's scale question).

    python carry_budget.py RUN_DIR --train TRAIN_DIR --weights W [--variants NAME ...] [--seeds 0 1 2]

RUN_DIR is a carried run (``drl --preset carried`` or the default, switched, answering from its
carried network) after its newest stage T, TRAIN_DIR stage T's training folder. The script refits
stage T's head as learn-stage did (``fit_stage`` with the earlier classes carried), from the class
Gaussians stage T drew (its totals keep them, moved by its maps) and stage T's own images embedded
again through the newest network, with the earlier classes' sums drawn each way listed below; then
scores the run's registered evaluation images (A_T on them) and times the draws. Variants:

- ``drawn-K``: E[φ] and the Grams from K draws an image (``ranpac.carry_mean drawn``, the carry of
  runs before the twentieth round, K = ``ranpac.carry_draws``);
- ``centred-K``: E[φ] = m in closed form (``sums.relu_means``), the Grams as E[(φ − m)(φ − m)ᵀ] + m mᵀ
  from K draws an image (``ranpac.carry_mean exact``);
- ``centred-K-gB``: the same, the Grams from about B draws over every class (``ranpac.carry_gram_draws``);
- ``split-K-gB``: the same, each class's rows split between the fit and held-out Grams in proportion
  to its images there (``expected_sums(split_rows=True)``), many classes' rows in one product.

(The ``exact-K`` and ``exact-K-gB`` rows of the research page, E[φ] in closed form but the Grams not
centred, came from this script at commit 86e005b.)

Each variant is drawn with each ``--seeds`` offset added to the tool's generator seed (offset 0 is the
tool's own draws). Prints one JSON line per variant and seed.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import replace
from pathlib import Path

import torch

from drlcli.data import scan_class_folders
from drlcli.evaluation import EVAL_BATCH_SIZE, registered_eval_sets
from drlcli.heads import EarlierStages
from drlcli.heads.ridge import CARRY, PROJECTION
from drlcli.heads.ridge.carried import PARTS, Carried
from drlcli.heads.ridge.carry import ClassGaussians
from drlcli.heads.ridge.sums import expected_sums
from drlcli.heads.ridge.fit import fit_stage
from drlcli.heads.ridge.statistics import STAT_DTYPE
from drlcli.model import embed_images
from drlcli.run.load import load_run

VARIANT = re.compile(r"(drawn|centred|split)-(\d+)(?:-g(\d+))?$")


def first(gaussians: ClassGaussians, count: int) -> ClassGaussians:
    """The first ``count`` classes."""
    return replace(
        gaussians,
        **{f: getattr(gaussians, f)[:count] for f in ("means", "factors", "ranks", "spreads", "counts", "groups")},
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path)
    parser.add_argument("--train", type=Path, required=True)
    parser.add_argument("--weights", type=Path, default=None)
    parser.add_argument("--variants", nargs="+", default=["drawn-100", "centred-100", "centred-100-g50000"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    args = parser.parse_args()
    loaded = load_run(args.run, device="cpu", ptm_weights=args.weights, scoring=False)
    model, config = loaded.model, loaded.config
    stage_index = int(loaded.stage_metas[-1]["stage"])
    totals = loaded.stage_totals[-1]
    gaussians, parts = ClassGaussians.from_tensors(totals, CARRY), totals[PARTS]
    images = scan_class_folders(args.train)
    earlier_classes = len(model.class_names) - len(images.class_names)
    if model.class_names[earlier_classes:] != list(images.class_names):
        raise SystemExit(f"{args.train} is not stage {stage_index}'s training folder")
    feats, local = embed_images(
        model.network, images, model.data_config, batch_size=EVAL_BATCH_SIZE, layout=model.layout_scored
    )
    labels = local + earlier_classes
    # the λ stage T - 1 chose, where stage T's search started (its totals, superseded, keep none)
    lam = float(loaded.stage_metas[-2]["ridge"]["lambda"])
    cfg = config.ranpac
    rank = cfg.covariance_rank if cfg.covariance_weight > 0 else None
    projection = loaded.stage_tensors[0][PROJECTION]
    rows, targets = [], []  # the evaluation images embedded once; each variant's head scores them
    for item in registered_eval_sets(loaded):
        feats_eval, local_eval = embed_images(
            model.network, item.images, model.data_config, batch_size=EVAL_BATCH_SIZE, layout=model.layout_scored
        )
        rows.append(feats_eval)
        targets.append(torch.tensor(item.label_map, dtype=torch.long)[local_eval])
    rows, target = torch.cat(rows), torch.cat(targets)
    old, old_parts = first(gaussians, earlier_classes), parts[:earlier_classes]
    print(json.dumps({"run": str(args.run), "stage": stage_index, "earlier_classes": earlier_classes,
                      "earlier_images": int(old.counts.sum()), "lambda_before": lam,
                      "stored_top1": loaded.stage_metas[-1].get("metrics", {}).get("eval", {}).get("top1")}), flush=True)
    for name in args.variants:
        match = VARIANT.match(name)
        if match is None:
            raise SystemExit(f"unknown variant {name}")
        kind, draws, budget = match.group(1), int(match.group(2)), match.group(3)
        for offset in args.seeds:
            tick = time.perf_counter()
            sums = expected_sums(
                old,
                old_parts,
                projection=projection.to(STAT_DTYPE),
                layout_cells=model.layout_scored**2,
                draws=draws,
                generator=torch.Generator().manual_seed(config.train.seed + stage_index + offset),
                exact_mean=kind != "drawn",
                split_rows=kind == "split",
                gram_draws=int(budget) if budget else None,
            )
            seconds = time.perf_counter() - tick
            earlier = EarlierStages(
                head=model.head,
                tensors=loaded.stage_tensors,  # stage 1's projection; the newest's covariance options
                statistics=lambda: [],
                carried=Carried.of_draws(sums, lam, rank),
            )
            fit = fit_stage(
                earlier,
                feats,
                labels,
                image_labels=labels.tolist(),
                indices=None,
                num_classes=len(model.class_names),
                config=config,
                stage_index=stage_index,
                carries=True,
            )
            model.head = fit.head
            with torch.no_grad():
                top1 = 100 * float((model.scores(rows).argmax(1) == target).double().mean())
            print(json.dumps({"variant": name, "seed_offset": offset, "top1": round(top1, 2),
                              "lambda": fit.meta["lambda"], "draw_seconds": round(seconds, 1)}), flush=True)


if __name__ == "__main__":
    main()
