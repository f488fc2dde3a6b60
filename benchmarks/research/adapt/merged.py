"""Issue 32, fifth round: per-stage adapters merged into one stream (MOS / TUNA's direction), on the CPU.

``gpu_oracle.py``'s carried schedule trains one adapter set on and on. Here each stage instead trains
a fresh AdaptFormer set (r 64, s 0.1, every block) on the frozen PTM and its own classes only (B0 Inc10,
cross-entropy, a cosine classifier of its own), so no stage's training moves another's adapter. The
stages are then merged into one stream (one ViT pass): every block adds the sum, or the mean, of the
adapters' outputs. Every training image (fit and held-out part of the validation split) is embedded by
the merged network after the last stage (f and the 2 x 2 layout, as ``first_stage.py embed``), and
``../cov_rank/replay.py`` replays the run with every statistic recomputed from those features: an
upper bound for this direction (a run would have to carry its old statistics, ``gram_map.py``).

    python merged.py --data SKETCH --seed 1993 --epochs 5 --out /work/scratch/merged
    python ../cov_rank/replay.py --data SKETCH --feats /work/scratch/merged/sum-1993.pt --split val --seeds 1993 --ranks 16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from first_stage import WEIGHTS, Adapted, plan

from drlcli.data import ImageDataset, ImageSet, eval_transform
from drlcli.methods.ease.options import EaseConfig
from drlcli.options import TrainConfig
from drlcli.ptm import backbone
from drlcli.ptm.backbone import PTMSource
from drlcli.stage.train import train_stage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=1993)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    data, stages = plan(args.data, args.seed, "val")
    ptm = backbone.create_ptm("deit_tiny_patch16_224", source=PTMSource(weights_path=WEIGHTS))
    cfg = backbone.data_config(ptm)
    net = Adapted(ptm, EaseConfig(adapter_dim=64))
    norms = []
    for k, classes in enumerate(stages, 1):
        names = sorted(classes)
        if len(names) < 2:  # cross-entropy over one class is 0: nothing to train
            print(f"stage {k}: one class, no adapter", flush=True)
            continue
        net.new_stage(seed=args.seed + k)
        paths = [p for c in names for p in data.train[c]]
        labels = [i for i, c in enumerate(names) for _ in data.train[c]]
        config = TrainConfig(epochs=args.epochs, batch_size=48, lr=args.lr, loss="ce", kd_weight=0.0, seed=args.seed)
        tick = time.time()
        result = train_stage(net, ImageSet(args.data, tuple(names), tuple(paths), tuple(labels)), config, cfg)
        net.stages[-1].eval()
        for parameter in net.stages[-1].parameters():
            parameter.requires_grad_(False)
        norms.append(float(net.stages[-1].up.norm()))
        print(
            f"stage {k}: {len(paths)} images, {time.time() - tick:.0f} s, losses "
            f"{[round(x, 3) for x in result.epoch_losses]}, ‖Up‖ {norms[-1]:.3f}",
            flush=True,
        )
    torch.save([s.state_dict() for s in net.stages], args.out / f"adapters-{args.seed}.pt")
    all_paths = sorted({p for part in (data.train, data.test) for ps in part.values() for p in ps})
    images = ImageSet(args.data, ("x",), tuple(all_paths), (0,) * len(all_paths))
    net.eval()
    for mode in ("sum", "mean"):
        loader = torch.utils.data.DataLoader(ImageDataset(images, eval_transform(cfg)), batch_size=64)
        tick = time.time()
        weight = 1.0 if mode == "sum" else 1.0 / len(net.stages)
        feats = torch.cat([net.embed(batch, list(net.stages), weight).float() for batch, _ in loader])
        out = args.out / f"{mode}-{args.seed}.pt"
        torch.save({"paths": [str(p) for p in all_paths], "features": feats, "info": {"norms": norms}}, out)
        print(f"{mode}: embedded {len(all_paths)} in {time.time() - tick:.0f} s -> {out}", flush=True)


if __name__ == "__main__":
    main()
