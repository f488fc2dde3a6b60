"""What the default's stage-1 trial (``drlcli/stage/trial.py``) measures on a benchmark's class orders,
without training stage 1 itself: for each order, the trial's move of the other half's margins (in %
of their frozen mean margin), its z and whether stage 1 would train.

    python benchmarks/trial_signal.py --data ../shared/data/caltech101 --weights $W --seeds 1993,1994,1995 \
        [--val-fraction 0.2] [--epochs 10] [--images 32] [--start random] [--split-shift K] [--precision bf16]

Stage 1 of B0 Inc10 (``--split``) over each seed's class order, as ``drl benchmark`` draws it; with
``--val-fraction`` the trial reads only the training part of the validation split (the setting the
trial's budget and floor were chosen in). The trial here is the product's: its class halves, its
capped and relabelled images, its training (``train_stage`` with the classifier started at the class
means) and ``metrics.margin_gain``; only the frozen PTM's f_0 is the adapter network's pass without
its set rather than the frozen track's (the same features up to float rounding). One JSON line per
order on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from drlcli.benchmark.protocol import load_data, parse_seeds, parse_split, plan_stages
from drlcli.config import RunConfig
from drlcli.data.images import ImageSet
from drlcli.evaluation import EVAL_BATCH_SIZE
from drlcli.methods import method_of
from drlcli.metrics import margin_gain
from drlcli.model import embed_images
from drlcli.ptm.backbone import PTMSource, create_ptm, data_config
from drlcli.stage.train import train_stage
from drlcli.stage.trial import FLOOR, MEASURED_IMAGES, ClassSample


def first_stage(data_dir: Path, seed: int, split: str, val_fraction: float | None) -> ImageSet:
    base, inc = parse_split(split)
    data = load_data(data_dir, skip_classes={"BACKGROUND_Google"})
    plan = plan_stages(data, base=base, inc=inc, seed=seed, shuffle=True, val_fraction=val_fraction)
    pairs = [(path, k) for k, name in enumerate(plan.stages[0]) for path in plan.data.train[name]]
    root = Path(pairs[0][0]).parents[1]
    return ImageSet(root, tuple(plan.stages[0]), tuple(p for p, _ in pairs), tuple(k for _, k in pairs))


def trial_of(
    images: ImageSet, weights: Path, epochs: int, per_class: int, start: str, shift: int, precision: str = "fp32"
) -> dict:
    config = RunConfig.for_method("drl")
    ptm = create_ptm("deit_tiny_patch16_224", source=PTMSource(weights_path=weights))
    network, config_data = method_of(config).build(ptm, config), data_config(ptm)
    n, seed = len(images.class_names), config.train.seed + 1 + shift  # stage 1's, as learn-stage seeds it
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    trained = ClassSample(images, tuple(sorted(order[: n // 2])), per_class, seed)
    measured = ClassSample(images, tuple(sorted(order[n // 2 :])), MEASURED_IMAGES, seed)

    def f0() -> torch.Tensor:
        return embed_images(network, measured, config_data, batch_size=EVAL_BATCH_SIZE)[0][:, 0]

    tick = time.perf_counter()
    frozen = f0()
    network.new_stage(seed=seed)
    train = replace(config.train, epochs=epochs, head_init=start)
    train_stage(network, trained, train, config_data, precision=precision)
    gain = margin_gain(f0(), frozen, torch.tensor(measured.labels))
    return {
        "images_trained": len(trained),
        "images_measured": len(measured),
        **gain.to_dict(),
        "trains": gain.moves(FLOOR),
        "seconds": round(time.perf_counter() - tick, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--seeds", default="1993,1994,1995")
    parser.add_argument("--split", default="B0Inc10")
    parser.add_argument("--val-fraction", type=float, default=None)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--images", type=int, default=32)
    # what the trial was chosen against: the classifier's random start, and other class splits (seed + K)
    parser.add_argument("--start", choices=("prototypes", "random"), default="prototypes")
    parser.add_argument("--split-shift", type=int, default=0)
    # the trial's training dtype: the default's train.precision auto is bf16 on a CPU with AMX and on CUDA
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args(argv)
    for seed in parse_seeds(args.seeds):
        images = first_stage(args.data, seed, args.split, args.val_fraction)
        row = {
            "data": args.data.name,
            "seed": seed,
            **trial_of(images, args.weights, args.epochs, args.images, args.start, args.split_shift, args.precision),
        }
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
