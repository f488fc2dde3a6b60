"""Issue 32, sixth round: a CPU test bed for adaptation schedules. Only the PTM's last blocks are
adapted, so their input tokens can be computed once and cached; training and embedding then run the
last blocks alone.

``cache``: the tokens entering block ``--first-block`` (default 10, of 0-11) for every image of the
data folder under the PTM's evaluation transform, and for every training image ``--views`` more
under the training transform of ``drl`` (random resized crop, area 0.08-1, flip), fp16.

``oracle``: one AdaptFormer set (drlcli's EASE adapters, parallel to the MLP, r 64, s 0.1, Up zero)
in the cached blocks, trained on the fit images of all classes (a run never holds them), cosine
classifier, CE or DAS, SGD (momentum 0.9, weight decay 5e-4, cosine schedule), each step on one
random cached view; then every image embedded (class token and 2 x 2 layout) and the default head
replayed over B0 Inc10 (``post_ptm.score``). ``frozen``: the same path with no adapters, checked
against the whole network's frozen features (``--feats``). The oracle ended below the frozen PTM
(adaptation-bounds.md, sixth round), so this test bed cannot stand in for whole-network schedules.

    python last_blocks.py cache --data SKETCH --out sk_b10.pt --views 2
    python last_blocks.py oracle --data SKETCH --cache sk_b10.pt --feats sk_all.pt --seed 1993 --epochs 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cov_rank"))
from first_stage import WEIGHTS, readout  # noqa: E402
from post_ptm import fit_rows, score  # noqa: E402
from replay import plan  # noqa: E402

from drlcli.config import RunConfig  # noqa: E402
from drlcli.data import ImageDataset, ImageSet, eval_transform  # noqa: E402
from drlcli.data.loading import train_transform  # noqa: E402
from drlcli.methods.ease.network import EaseAdapters  # noqa: E402
from drlcli.ptm import backbone  # noqa: E402
from drlcli.ptm.backbone import PTMSource  # noqa: E402
from drlcli.seeding import seeded  # noqa: E402
from drlcli.stage.losses import ce_loss, das_loss  # noqa: E402


def ptm():
    return backbone.create_ptm("deit_tiny_patch16_224", source=PTMSource(weights_path=WEIGHTS)).eval()


@torch.no_grad()
def cache(args) -> None:
    torch.set_num_threads(2)
    net = ptm()
    cfg = backbone.data_config(net)
    data, _ = plan([args.data], 1993, "test")
    every = sorted({p for part in (data.train, data.test) for ps in part.values() for p in ps})
    train = sorted({p for ps in data.train.values() for p in ps})
    out = {"first_block": args.first_block}
    torch.manual_seed(0)
    views = [("eval", every, eval_transform(cfg))] + [
        (f"view{v}", train, train_transform(cfg, crop_scale_min=0.08, hflip=True)) for v in range(args.views)
    ]
    for name, paths, transform in views:
        images = ImageSet(args.data, ("x",), tuple(paths), (0,) * len(paths))
        loader = torch.utils.data.DataLoader(ImageDataset(images, transform), batch_size=64, num_workers=1)
        tokens, tick = [], time.time()
        for step, (batch, _) in enumerate(loader, 1):
            x = backbone.embed_tokens(net, batch)
            for block in net.blocks[: args.first_block]:
                x = block(x)
            tokens.append(x.half())
            if step % 20 == 0:
                print(f"{name} {step}/{len(loader)} {step * 64 / (time.time() - tick):.1f} img/s", flush=True)
        out[name] = torch.cat(tokens)
        out[f"{name}_paths"] = [str(p) for p in paths]
    torch.save(out, args.out)
    print(f"wrote {args.out}", flush=True)


class LastBlocks(torch.nn.Module):
    """The PTM's blocks from ``first`` on, with one AdaptFormer set parallel to each MLP, and its final
    norms; reads cached tokens, returns the class token (f) and the 2 x 2 layout, or f alone."""

    def __init__(self, net, first: int, rank: int = 64, scale: float = 0.1, seed: int = 0):
        super().__init__()
        self.net, self.first, self.scale = net, first, scale
        for p in net.parameters():
            p.requires_grad_(False)
        with seeded(seed):
            self.adapters = EaseAdapters(width=net.embed_dim, depth=len(net.blocks) - first, adapter_dim=rank)

    def forward(self, x: torch.Tensor, layout: bool = True) -> torch.Tensor:
        a = self.adapters
        for j, block in enumerate(self.net.blocks[self.first :]):
            x = x + block.ls1(block.attn(block.norm1(x)))
            added = F.relu(x @ a.down[j] + a.down_bias[j]) @ a.up[j] + a.up_bias[j]
            x = x + block.ls2(block.mlp(block.norm2(x))) + self.scale * added
        return readout(self.net, x, layout)


class Cache:
    def __init__(self, path: Path):
        saved = torch.load(path)
        self.first = saved["first_block"]
        self.eval = dict(zip(saved["eval_paths"], saved["eval"]))
        names = sorted(k for k in saved if k.startswith("view") and not k.endswith("_paths"))
        self.views = [dict(zip(saved[f"{v}_paths"], saved[v])) for v in names]

    def batch(self, paths: list[str], gen: torch.Generator) -> torch.Tensor:
        """One random cached view of each (the evaluation view counts as one)."""
        pick = torch.randint(len(self.views) + 1, (len(paths),), generator=gen).tolist()
        return torch.stack([(self.eval if v == 0 else self.views[v - 1])[p] for p, v in zip(paths, pick)]).float()


def train(model: LastBlocks, store: Cache, paths: list[str], labels: torch.Tensor, args, classifier=None) -> dict:
    """SGD on ``model``'s adapters and a cosine classifier (σ learnt, from 16) over ``paths``."""
    gen = torch.Generator().manual_seed(args.seed)
    num = int(labels.max()) + 1
    with torch.no_grad():
        f = torch.cat([model(store.batch(paths[i : i + 256], gen), layout=False) for i in range(0, len(paths), 256)])
        means = torch.stack([F.normalize(f[labels == c], dim=1).mean(0) for c in range(num)])
    weight = torch.nn.Parameter(F.normalize(means, dim=1).clone())
    sigma = torch.nn.Parameter(torch.tensor(args.sigma))
    adapters = list(model.adapters.parameters())
    opt = torch.optim.SGD(
        [{"params": adapters + [weight], "weight_decay": 5e-4}, {"params": [sigma], "weight_decay": 0.0}],
        lr=args.lr,
        momentum=0.9,
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    loss_fn = das_loss if args.loss == "das" else ce_loss
    losses, tick = [], time.time()
    for epoch in range(args.epochs):
        perm = torch.randperm(len(paths), generator=gen).tolist()
        total = 0.0
        for i in range(0, len(paths), args.batch):
            idx = perm[i : i + args.batch]
            f = model(store.batch([paths[j] for j in idx], gen), layout=False)
            logits = sigma * F.normalize(f, dim=1) @ F.normalize(weight, dim=1).T
            loss = loss_fn(logits, labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        sched.step()
        losses.append(round(total / len(paths), 4))
        print(f"epoch {epoch + 1}/{args.epochs} loss {losses[-1]} {time.time() - tick:.0f}s", flush=True)
    return {"losses": losses, "up_norm": float(model.adapters.up.detach().norm()), "seconds": round(time.time() - tick)}


@torch.no_grad()
def embed(model: LastBlocks, store: Cache) -> dict:
    keys = list(store.eval)
    out = []
    for i in range(0, len(keys), 256):
        out.append(model(torch.stack([store.eval[k] for k in keys[i : i + 256]]).float()))
    return dict(zip(keys, torch.cat(out)))


def run(args) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    store = Cache(args.cache)
    data, stages = plan([args.data], args.seed, "val")
    config = RunConfig.for_method("drl", {"ranpac": {"covariance_rank": 0}}, preset="frozen").with_train(seed=args.seed)
    model = LastBlocks(ptm(), store.first, seed=args.seed)
    record = {k: str(v) for k, v in vars(args).items() if k not in ("data", "out", "func")}
    if args.command == "frozen":
        lookup = embed(model, store)
        if args.feats:  # the cached path must give the frozen features the other rounds used
            saved = torch.load(args.feats)
            ref = dict(zip(saved["paths"], saved["features"]))
            record["max_diff"] = max(float((lookup[k] - ref[k]).abs().max()) for k in list(lookup)[:500])
    else:  # oracle: all classes at once
        paths, labels = fit_rows(data, sorted(c for s in stages for c in s))
        record["train"] = train(model, store, paths, labels, args)
        lookup = embed(model, store)
    record |= score(data, stages, lookup, config)
    print(json.dumps(record), flush=True)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cache")
    c.add_argument("--data", type=Path, required=True)
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--first-block", type=int, default=10)
    c.add_argument("--views", type=int, default=2)
    c.set_defaults(func=cache)
    for name in ("frozen", "oracle"):
        p = sub.add_parser(name)
        p.add_argument("--data", type=Path, required=True)
        p.add_argument("--cache", type=Path, required=True)
        p.add_argument("--feats", help="frozen: the reference features to compare with")
        p.add_argument("--seed", type=int, default=1993)
        p.add_argument("--loss", choices=("ce", "das"), default="ce")
        p.add_argument("--epochs", type=int, default=20)
        p.add_argument("--lr", type=float, default=0.01)
        p.add_argument("--batch", type=int, default=48)
        p.add_argument("--sigma", type=float, default=16.0)
        p.add_argument("--out", type=Path, help="JSON lines appended here")
        p.set_defaults(func=run)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
