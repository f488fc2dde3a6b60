"""Issue 32, sixth round: train a small module *after* the frozen PTM, on the five tokens the default
head reads, and feed the head its output.

Every adapter inside the PTM moves the features of every class, so old classes' statistics go stale
(adaptation-bounds.md). A module after the frozen PTM sees the same inputs for an old class at every
stage: a class Gaussian of the PTM's tokens stays exact, and old classes can be replayed as draws
from it when the module is retrained. This asks first what such a module can give at all:

``--fit oracle``: trained once on the fit images of all classes (a run never holds them), then the
default head (ridge on ReLU([f, 0.5 l] R), class covariances of rank 16) replayed over B0 Inc10 by
``../cov_rank/replay.py`` on the module's output. ``--fit first``: trained on stage 1's classes only
(first-session adaptation of the module). ``--fit none``: the frozen features (the baseline). The
oracle never reached the frozen PTM (adaptation-bounds.md, sixth round), so a run's version, which
would retrain the module each stage on draws from old classes' Gaussians, was not built.

The module: per token x' = x + s · U GELU(D LN(x)), bottleneck r, U zero at start (shared by the
five tokens). Training reads the normalised concatenation of the five output tokens through a cosine
classifier (σ 16), cross-entropy or DAS (the product's ``das_loss``), AdamW, Gaussian feature noise.

    python post_ptm.py --data SKETCH --feats sk_all.pt --seed 1993 --fit oracle --loss ce
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cov_rank"))
from replay import plan, stage_scores  # noqa: E402

from drlcli.config import RunConfig  # noqa: E402
from drlcli.metrics import accuracy_report  # noqa: E402
from drlcli.stage.losses import ce_loss, das_loss  # noqa: E402

RANK = 16


class TokenAdapter(nn.Module):
    """x' = x + s · U GELU(D LN(x)) on each of the (N, S, d) tokens."""

    def __init__(self, dim: int, rank: int, scale: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.down = nn.Linear(dim, rank)
        self.up = nn.Linear(rank, dim)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.up(F.gelu(self.down(self.norm(x))))


def read(tokens: torch.Tensor, layout_weight: float = 0.5) -> torch.Tensor:
    """What the classifier reads: [f, 0.5 l], flattened and normalised, as the head's input."""
    w = torch.ones(tokens.shape[1], device=tokens.device)
    w[1:] = layout_weight
    return F.normalize((tokens * w[None, :, None]).flatten(1), dim=1)


def train(module: TokenAdapter, x: torch.Tensor, y: torch.Tensor, num_classes: int, args, protos=None):
    """Trains ``module`` (and a fresh cosine classifier, from class means when ``protos`` is None) on
    rows ``x`` (N, S, d) with labels ``y``."""
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        base = read(module(x))
        means = torch.stack([base[y == c].mean(0) for c in range(num_classes)])
    classifier = nn.Parameter(F.normalize(means, dim=1).clone())
    params = list(module.parameters()) + [classifier]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.wd)
    steps = args.epochs * ((len(x) + args.batch - 1) // args.batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    loss_fn = das_loss if args.loss == "das" else ce_loss
    for _ in range(args.epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), args.batch):
            idx = perm[i : i + args.batch]
            xb = x[idx]
            if args.noise:
                xb = xb + args.noise * xb.norm(dim=-1, keepdim=True) / xb.shape[-1] ** 0.5 * torch.randn(
                    xb.shape, generator=gen
                )
            logits = args.sigma * read(module(xb)) @ F.normalize(classifier, dim=1).T
            loss = loss_fn(logits, y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return float(loss.detach())


def apply(module: TokenAdapter, lookup: dict) -> dict:
    keys = list(lookup)
    with torch.no_grad():
        out = module(torch.stack([lookup[k] for k in keys]))
    return dict(zip(keys, out))


def score(data, stages, lookups, config) -> dict:
    *_, (last, stage_of, scored) = stage_scores(data, stages, lookups, config, [RANK], scored={len(stages)})
    return {
        kind: accuracy_report(scores.argmax(1), labels, stage_of, num_stages=last).top1
        for (_, kind), (scores, labels) in scored.items()
    }


def fit_rows(data, classes) -> tuple[list[str], torch.Tensor]:
    """The fit images of ``classes`` (paths) and their labels, the classes in the given order."""
    paths = [str(p) for c in classes for p in data.train[c]]
    return paths, torch.tensor([i for i, c in enumerate(classes) for _ in data.train[c]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--feats", required=True, help="the frozen PTM's tokens (path -> (5, d))")
    parser.add_argument("--seed", type=int, default=1993)
    parser.add_argument("--fit", choices=("none", "oracle", "first"), default="oracle")
    parser.add_argument("--loss", choices=("ce", "das"), default="ce")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--noise", type=float, default=0.0, help="feature noise, times the token's rms")
    parser.add_argument("--sigma", type=float, default=16.0)
    parser.add_argument("--out", type=Path, help="JSON lines appended here")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    saved = torch.load(args.feats)
    lookup = dict(zip(saved["paths"], saved["features"]))
    data, stages = plan([args.data], args.seed, "val")
    config = RunConfig.for_method("drl", {"ranpac": {"covariance_rank": 0}}, preset="frozen").with_train(seed=args.seed)
    tick = time.perf_counter()
    info = {}
    if args.fit != "none":
        classes = [c for s in stages for c in s] if args.fit == "oracle" else list(stages[0])
        paths, y = fit_rows(data, sorted(classes))
        x = torch.stack([lookup[p] for p in paths])
        module = TokenAdapter(x.shape[-1], args.rank, args.scale)
        info["train_loss"] = train(module, x, y, len(classes), args)
        info["up_norm"] = float(module.up.weight.norm())
        with torch.no_grad():
            info["drift"] = float((module(x) - x).norm(dim=-1).mean() / x.norm(dim=-1).mean())
        lookup = apply(module, lookup)
    result = score(data, stages, lookup, config)
    record = {k: v for k, v in vars(args).items() if k not in ("data", "out")} | info | result
    record["seconds"] = round(time.perf_counter() - tick, 1)
    print(json.dumps(record, default=str), flush=True)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")


if __name__ == "__main__":
    main()
