"""Issue 33, item 3: does the low-rank form of the class covariances (``ranpac.covariance_rank`` r) keep
the default head's accuracy? Replays B0 Inc10 offline through the product's own ``fit_stage`` (the
ridge + class-covariance head of the default ``drl``, every stage's tensors and statistics kept in
memory as a run would store them) on cached frozen DeiT-Tiny features, and scores with the head it
returns (rank 0: the dense head) and, for each r > 0, with the same head's class covariances in
rank-r form (``covariance.class_factors`` of each class's covariance and ``LowRankPrecisions``, as a
run with that rank assembles them: the ridge part is the same whatever r is).

    python replay.py --data CALTECH --feats cal_none.pt --split val --seeds 1993,1994,1995 --ranks 0,8,16,32,64
    python replay.py --data CALTECH --feats cal_none.pt --split test --seeds 1993,1994,1995 --ranks 0,16
    python replay.py --data CALTECH,SKETCH --feats cal_all.pt,sk_all.pt --split test --ranks 16   # 202 classes

The features come from ``../adapt/first_stage.py embed --peft none`` (f_0 and the 2 x 2 layout of the
frozen PTM for every training and test image: the rows the default head reads). ``--split val``
holds out 20 % of each class's training images as ``drl benchmark --val-fraction 0.2`` does and
evaluates on them; ``test`` fits on all training images and evaluates on test.txt. Each evaluation is
reported twice: "capped" (the first 10 images per class, as ``--max-test-per-class 10``) and "full".
Rank 0 is the dense (d, d) covariance per class, today's default.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Container
from pathlib import Path

import torch

from drlcli.benchmark import class_order, load_data, split_validation, stage_classes
from drlcli.benchmark.protocol import BenchmarkData
from drlcli.config import RunConfig
from drlcli.heads.base import EarlierStages
from drlcli.heads.ridge import COV_COVARIANCE, COV_MEAN, COV_PARAMS, COV_SHARED
from drlcli.heads.ridge.covariance import LowRankPrecisions, class_factors
from drlcli.heads.ridge.fit import fit_stage
from drlcli.heads.ridge.head import RanpacHead
from drlcli.metrics import accuracy_report, summarize_history

CAP = 10


def plan(data_dirs: list[Path], seed: int, split: str):
    """The B0 Inc10 stages of one data set, or of several side by side (classes named ``i:name``, i
    the data set's place in ``data_dirs``: more classes than any one has)."""
    parts = [load_data(d, skip_classes={"BACKGROUND_Google"}) for d in data_dirs]
    if len(parts) == 1:
        data = parts[0]
    else:
        named = [
            {f"{i}:{c}": v for c, v in getattr(part, kind).items()}
            for kind in ("train", "test")
            for i, part in enumerate(parts)
        ]
        half = len(parts)
        data = BenchmarkData(
            {k: v for d in named[:half] for k, v in d.items()},
            {k: v for d in named[half:] for k, v in d.items()},
            "joined",
        )
    if split == "val":
        data = split_validation(data, 0.2, seed)
    order = class_order(list(data.train), seed=seed, shuffle=True)
    return data, stage_classes(order, 0, 10)


def lowrank_head(dense: RanpacHead, stages: list[dict], counts: torch.Tensor, rank: int) -> RanpacHead:
    """The dense head with its class covariances in rank-``rank`` form."""
    newest = stages[-1]
    _, shrink, blend = newest[COV_PARAMS].tolist()
    covariances = torch.cat([t[COV_COVARIANCE] for t in stages]).double()
    factors, traces = class_factors(covariances * (counts - 1).clamp_min(1)[:, None, None], counts, rank)
    means = torch.cat([t[COV_MEAN] for t in stages])
    low = LowRankPrecisions.of(means, factors, traces, newest[COV_SHARED], shrink=shrink, blend=blend)
    return RanpacHead(
        dense.projection, dense.weight, cov_weight=dense.cov_weight, layout=dense.layout_grid, cov_lowrank=low
    )


def stage_scores(
    data,
    stages,
    lookup,
    config: RunConfig,
    ranks: list[int],
    lambdas: list[float] | None = None,
    *,
    before_stage: Callable[[int, list[dict], list[dict], RanpacHead | None], None] | None = None,
    scored: Container[int] | None = None,
):
    """Every stage fitted by ``fit_stage`` on the earlier stages' stored tensors; after each stage
    (each in ``scored``, when given), yields (stage, each class's stage (tensor), {(rank, kind):
    (scores, labels)}) on the seen classes' test images, capped and full. Each stage's λ is appended
    to ``lambdas`` when given. ``lookup``: path -> features, or a list of them, one per stage
    (features that change with the stages: stage k's images and the test images scored after it are
    read from ``lookup[k - 1]``). ``before_stage(k, weights, statistics, head)`` may edit the earlier
    stages' stored tensors in place before stage k is fitted."""
    weights, statistics, head = [], [], None
    per_stage = lookup if isinstance(lookup, list) else [lookup] * len(stages)
    seen: list[str] = []
    counts: list[float] = []
    for k, classes in enumerate(stages, 1):
        lookup = per_stage[k - 1]
        names = sorted(classes)
        paths = [p for c in names for p in data.train[c]]
        labels = [i for i, c in enumerate(names) for _ in data.train[c]]
        counts += [float(len(data.train[c])) for c in names]
        features = torch.stack([lookup[str(p)] for p in paths])
        if before_stage is not None:
            before_stage(k, weights, statistics, head)
        earlier = EarlierStages(head, list(weights), lambda s=list(statistics): iter(s))
        fit = fit_stage(
            earlier,
            features,
            torch.tensor(labels),
            image_labels=labels,
            indices=None,
            num_classes=len(names),
            config=config,
            stage_index=k,
        )
        weights.append(fit.tensors)
        if lambdas is not None:
            lambdas.append(fit.meta["lambda"])
        statistics.append(fit.statistics)
        head = fit.head
        seen += names
        if scored is not None and k not in scored:
            continue
        stage_of = torch.tensor([j // 10 + 1 for j in range(len(seen))])  # B0 Inc10: class j's stage
        out = {}
        for rank in ranks:
            scorer = head if rank == 0 else lowrank_head(head, weights, torch.tensor(counts, dtype=torch.float64), rank)
            for kind, cap in (("capped", CAP), ("full", None)):
                test_paths, test_labels = [], []
                for j, c in enumerate(seen):
                    chosen = data.test[c][:cap] if cap else data.test[c]
                    test_paths += chosen
                    test_labels += [j] * len(chosen)
                with torch.no_grad():
                    scores = scorer(torch.stack([lookup[str(p)] for p in test_paths]))
                out[rank, kind] = (scores, torch.tensor(test_labels))
        yield k, stage_of, out


def summary(history) -> dict:
    h = summarize_history(history)
    return {"average": h.average, "last": h.last, "forgetting": h.mean_forgetting, "accuracy": h.accuracy}


def summary_line(result: dict) -> str:
    """``summary``'s Ā, A_T and F, capped and full, on one line."""
    return " | ".join(
        f"{kind} Ā {result[kind]['average']:.2f} A_T {result[kind]['last']:.2f} F {result[kind]['forgetting']:.2f}"
        for kind in ("capped", "full")
    )


def replay(data, stages, lookup, config: RunConfig, ranks: list[int], lambdas: list[float] | None = None) -> dict:
    """A_t on the seen test images (capped and full) after each stage, for each rank."""
    reports = {(rank, kind): [] for rank in ranks for kind in ("capped", "full")}
    for k, stage_of, scored in stage_scores(data, stages, lookup, config, ranks, lambdas):
        for key, (scores, labels) in scored.items():
            reports[key].append(accuracy_report(scores.argmax(1), labels, stage_of, num_stages=k))
    out: dict = {}
    for (rank, kind), history in reports.items():
        out.setdefault(rank, {})[kind] = summary(history)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="a data folder, or several joined: A,B")
    parser.add_argument("--feats", required=True, help="its cached features (several: one per folder, A,B)")
    parser.add_argument("--split", choices=("val", "test"), default="val")
    parser.add_argument("--seeds", default="1993,1994,1995")
    parser.add_argument("--ranks", default="0,8,16,32,64")
    parser.add_argument("--out", type=Path, help="JSON lines appended here")
    parser.add_argument("--lambda-classes", type=int, help="ranpac.lambda_classes (default: drl's)")
    args = parser.parse_args()
    lookup = {}
    label = "+".join(Path(f).name for f in args.feats.split(","))
    for feats in args.feats.split(","):  # several: one per --data folder
        saved = torch.load(feats)
        lookup.update(zip(saved["paths"], saved["features"]))
    ranks = [int(r) for r in args.ranks.split(",")]
    for seed in [int(s) for s in args.seeds.split(",")]:
        data, stages = plan([Path(d) for d in args.data.split(",")], seed, args.split)
        dense = {"ranpac": {"covariance_rank": 0}}  # r > 0 is derived from the dense head
        if args.lambda_classes is not None:
            dense["ranpac"]["lambda_classes"] = args.lambda_classes
        config = RunConfig.for_method("drl", dense, preset="frozen").with_train(seed=seed)
        tick = time.perf_counter()
        lambdas: list[float] = []
        results = replay(data, stages, lookup, config, ranks, lambdas)
        print(f"seed {seed}: λ per stage {' '.join(f'{x:g}' for x in lambdas)}", flush=True)
        for rank, result in results.items():
            print(f"{label} {args.split} seed {seed} rank {rank}: {summary_line(result)}", flush=True)
            if args.out:
                record = {"feats": label, "split": args.split, "seed": seed, "rank": rank,
                          "lambda_classes": config.ranpac.lambda_classes, "lambdas": lambdas, **result}  # fmt: skip
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(record) + "\n")
        print(f"({time.perf_counter() - tick:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
