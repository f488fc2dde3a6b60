"""Issue 32: two heads, one on the frozen PTM's features and one on stage-1-adapted features, their
standardised scores summed (z(s_frozen) + w · z(s_adapted)). Replays B0 Inc10 through the product's
``fit_stage`` for each feature file (``../cov_rank/replay.py``'s ``stage_scores``, rank 16).

    python ensemble.py --data SKETCH --frozen sk_all.pt --adapted sk_val_ce20_1993.pt --seed 1993 --split val

w 0 is the frozen head alone; "inf" the adapted head alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from drlcli.config import RunConfig
from drlcli.heads.ridge.covariance import standardise
from drlcli.metrics import accuracy_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cov_rank"))
from replay import plan, stage_scores, summary  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--frozen", type=Path, required=True)
    p.add_argument("--adapted", type=Path, required=True)
    p.add_argument("--seed", type=int, default=1993)
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--weights", default="0,0.5,1,2,inf")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    data, stages = plan(args.data, args.seed, args.split)
    config = RunConfig.for_method("drl", {"ranpac": {"covariance_rank": 0}}, preset="frozen").with_train(seed=args.seed)  # as replay.py
    streams = []
    for path in (args.frozen, args.adapted):
        saved = torch.load(path)
        lookup = dict(zip(saved["paths"], saved["features"]))
        streams.append(stage_scores(data, stages, lookup, config, [16]))
    weights = [float(w) for w in args.weights.split(",")]
    reports = {(w, kind): [] for w in weights for kind in ("capped", "full")}
    for (k, stage_of, frozen), (_, _, adapted) in zip(*streams):
        for kind in ("capped", "full"):
            (a, labels), (b, _) = frozen[16, kind], adapted[16, kind]
            for w in weights:
                scores = b if w == float("inf") else standardise(a) + w * standardise(b)
                reports[w, kind].append(accuracy_report(scores.argmax(1), labels, stage_of, num_stages=k))
    for w in weights:
        result = {kind: summary(reports[w, kind]) for kind in ("capped", "full")}
        line = " | ".join(f"{kind} Ā {result[kind]['average']:.2f} A_T {result[kind]['last']:.2f}" for kind in result)
        print(f"{args.adapted.name} {args.split} seed {args.seed} w {w:g}: {line}", flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                record = {"frozen": args.frozen.name, "adapted": args.adapted.name, "seed": args.seed, "w": w}
                fh.write(json.dumps({**record, "split": args.split, **result}) + "\n")


if __name__ == "__main__":
    main()
