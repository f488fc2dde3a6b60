"""Issue 32, first question: does adapting the PTM on stage 1 (RanPAC's phase 1) make the default head better?

    python first_stage.py embed --data DIR --name sketch --seed 1993 --split val --peft adaptformer \
        --loss ce --epochs 20 --lr 0.01 --batch 48 [--kd 0] [--threads 2]
    python first_stage.py score --data DIR --feats F.pt [F2.pt ...] --seed 1993 --split val

``embed`` trains one AdaptFormer adapter set (drlcli's EASE adapters: every block, parallel to the MLP,
r 64, s 0.1, Up zero-init) on the first stage's classes of B0 Inc10 (seed's class order; ``--split val``:
only the fit part of the validation split, as ``drl benchmark --val-fraction 0.2``) with drlcli's own
training loop (``train.train_stage``: cosine classifier, CE or DAS, optional distillation to f_0), then
embeds every train image and the evaluation images (val: the held-out part; test: test.txt) with the
adapted network: the class token after the final norm (f) and the final patch tokens averaged over a
2 x 2 grid (the layout). ``--peft none`` embeds with the frozen PTM (the baseline, same code path).

``score`` replays B0 Inc10 with drl's default head on those features, built from drlcli's ranpac pieces:
ridge on ReLU([f, 0.5 l] R) (M 3000, λ by the 80/20 statistics split) plus 4 · z(class covariances on
f/|f|, shrink 0.3, blend 0.8), the evaluation capped at 10 images per class. Prints Ā / A_T per file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from drlcli.benchmark import class_order, load_data, split_validation, stage_classes
from drlcli.data import ImageDataset, ImageSet, eval_transform
from drlcli.heads.ridge.covariance import ClassMoments, precisions, standardise
from drlcli.heads.ridge.head import expand
from drlcli.heads.ridge.options import RanpacConfig
from drlcli.heads.ridge.statistics import Statistics, choose_lambda, lambda_grid, solve, validation_mask
from drlcli.methods.ease.network import EaseNetwork
from drlcli.methods.ease.options import EaseConfig
from drlcli.metrics import accuracy_report, summarize_history
from drlcli.options import TrainConfig
from drlcli.ptm import backbone
from drlcli.ptm.backbone import PTMSource
from drlcli.stage.train import train_stage

WEIGHTS = Path("/work/shared/data/deit_tiny_patch16_224/deit_tiny_patch16_224.safetensors")
CAP = 10


class Adapted(EaseNetwork):
    """The EASE network with one stage = an adapted PTM; forward_train adds f_0 for distillation."""

    def forward_train(self, images):
        with torch.no_grad():
            ptm_feat = self.ptm.forward_features(images)[:, 0]
            ptm_feat = self.ptm.fc_norm(ptm_feat) if hasattr(self.ptm, "fc_norm") else ptm_feat
        return ptm_feat, self._run(images, self.stages[-1])

    @torch.no_grad()
    def embed(self, images, stages=None, weight: float = 1.0):
        """``read`` without gradients."""
        return self.read(images, stages, weight)

    def read(self, images, stages=None, weight: float = 1.0, dropout: float = 0.0):
        """(B, 1 + 4, d): the class token and the 2 x 2 layout of the final patch tokens, through the
        newest stage's adapters, or through several ``stages`` merged into one stream (every block
        adds ``weight`` times the sum of their outputs); ``dropout`` on the adapters' hidden units."""
        ptm = self.ptm
        if stages is None:
            stages = list(self.stages)[-1:]
        x = backbone.embed_tokens(ptm, images)
        for l, block in enumerate(ptm.blocks):
            if not stages:
                x = block(x)
                continue
            x = x + block.ls1(block.attn(block.norm1(x)))
            added = sum(
                F.dropout(F.relu(x @ s.down[l] + s.down_bias[l]), p=dropout, training=dropout > 0) @ s.up[l]
                + s.up_bias[l]
                for s in stages
            )
            x = x + block.ls2(block.mlp(block.norm2(x))) + self.cfg.scale * weight * added
        return readout(ptm, x)


def readout(ptm, x: torch.Tensor, layout: bool = True) -> torch.Tensor:
    """The last block's tokens (B, N, d) -> (B, 1 + 4, d): the class token after the final norms and
    the 2 x 2 layout of the patch tokens; ``layout`` False: the class token alone, (B, d)."""
    x = ptm.norm(x)
    cls = ptm.fc_norm(x[:, 0])
    if not layout:
        return cls
    patches = x[:, ptm.num_prefix_tokens :]
    b, p, d = patches.shape
    side = int(p**0.5)
    cells = F.adaptive_avg_pool2d(patches.transpose(1, 2).reshape(b, d, side, side), 2).flatten(2).transpose(1, 2)
    return torch.cat([cls[:, None], cells], dim=1)


@torch.no_grad()
def embed_images(net, paths: list[Path], cfg, workers: int, device, batch: int = 256) -> torch.Tensor:
    """(N, 1 + 4, d) float16 on the CPU: ``net.embed`` of these image files, in order, evaluation view."""
    images = ImageSet(Path("."), ("x",), tuple(paths), (0,) * len(paths))
    loader = torch.utils.data.DataLoader(
        ImageDataset(images, eval_transform(cfg)), batch_size=batch, num_workers=workers
    )
    net.eval()
    return torch.cat([net.embed(x.to(device)).half().cpu() for x, _ in loader])


def depth_blocks(text: str) -> list[int]:
    """Block indices: "0-5" -> 0..5; "0-3+8-11": both ranges; "7": one block."""
    out: list[int] = []
    for part in text.split("+"):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def learn_only(stage, blocks: str) -> None:
    """Only these blocks' adapters (``depth_blocks`` syntax) learn: the others' Up gets no gradient, so
    it stays zero and Down's gradient there is zero too."""
    keep = torch.zeros(stage.up.shape[0], device=stage.up.device)
    keep[depth_blocks(blocks)] = 1.0
    stage.up.register_hook(lambda g: g * keep[:, None, None])
    stage.up_bias.register_hook(lambda g: g * keep[:, None])


def plan(data_dir: Path, seed: int, split: str):
    data = load_data(data_dir, skip_classes={"BACKGROUND_Google"})
    if split == "val":
        data = split_validation(data, 0.2, seed)
    order = class_order(list(data.train), seed=seed, shuffle=True)
    return data, stage_classes(order, 0, 10)


def embed(args) -> None:
    torch.set_num_threads(args.threads)
    data, stages = plan(args.data, args.seed, args.split)
    ptm = backbone.create_ptm("deit_tiny_patch16_224", source=PTMSource(weights_path=WEIGHTS))
    net = Adapted(ptm, EaseConfig(adapter_dim=args.rank)).eval()
    cfg = backbone.data_config(ptm)
    info = {"args": {k: str(v) for k, v in vars(args).items()}}
    if args.peft == "adaptformer":
        first = sorted(set().union(*stages[: args.adapt_stages]))  # an oracle beyond stage 1: later classes too
        paths = [p for c in first for p in data.train[c]]
        labels = [i for i, c in enumerate(first) for _ in data.train[c]]
        images = ImageSet(args.data, tuple(first), tuple(paths), tuple(labels))
        net.new_stage(seed=args.seed)
        if args.blocks:
            learn_only(net.stages[-1], args.blocks)
            info["blocks"] = args.blocks
        train = TrainConfig(
            epochs=args.epochs,
            batch_size=args.batch,
            lr=args.lr,
            loss=args.loss,
            kd_weight=args.kd,
            scale_init=args.scale_init,
            seed=args.seed,
        )
        tick = time.time()
        last = [0.0]

        def progress(p):
            if time.time() - last[0] > 30:
                last[0] = time.time()
                print(f"epoch {p.epoch}/{p.epochs} step {p.step}/{p.steps} loss {p.loss:.4f}", flush=True)

        result = train_stage(net, images, train, cfg, progress=progress)
        info["train"] = {"seconds": time.time() - tick, "losses": result.epoch_losses, "images": len(paths)}
        print(f"trained on {len(paths)} images in {time.time() - tick:.0f}s: {result.epoch_losses}", flush=True)
    elif args.adapters:  # trained elsewhere (gpu_adapt.py): {variant: state dict} of this order and split
        net.new_stage(seed=args.seed)
        net.stages[-1].load_state_dict(torch.load(args.adapters)[args.key])
        info["adapters"] = f"{args.adapters}:{args.key}"
    all_paths = sorted({p for part in (data.train, data.test) for ps in part.values() for p in ps})
    images = ImageSet(args.data, ("x",), tuple(all_paths), (0,) * len(all_paths))
    loader = torch.utils.data.DataLoader(ImageDataset(images, eval_transform(cfg)), batch_size=64)
    feats = []
    tick = time.time()
    for step, (batch, _) in enumerate(loader, 1):
        feats.append(net.embed(batch).float())
        if step % 10 == 0:
            print(f"embed {step}/{len(loader)} {step * 64 / (time.time() - tick):.1f} img/s", flush=True)
    torch.save({"paths": [str(p) for p in all_paths], "features": torch.cat(feats), "info": info}, args.out)
    print(f"wrote {args.out}", flush=True)


def replay(
    data, stages, lookup, *, seed: int, cov_weight: float, layout_scale: float, proj_dim: int, cov_token: int = 0
) -> dict:
    """``lookup`` path -> (T, d) tokens: [f, 4 layout cells] per feature file joined (``--concat``); the
    projection reads all T rows (the layout cells weighted), the class covariances token ``cov_token``."""
    cfg = RanpacConfig()
    tokens, d = next(iter(lookup.values())).shape
    projection = torch.randn(tokens * d, proj_dim, generator=torch.Generator().manual_seed(0))
    for t in range(tokens):
        if t % 5:  # a layout cell
            projection[t * d : (t + 1) * d] *= layout_scale
    projection = projection.to(torch.float64)
    stored, moments, reports, stage_of, tests_x, tests_y = [], [], [], [], [], []
    for k, classes in enumerate(stages, 1):
        names = sorted(classes)
        paths = [p for c in names for p in data.train[c]]
        labels = torch.tensor([i for i, c in enumerate(names) for _ in data.train[c]])
        h = torch.stack([lookup[str(p)] for p in paths])  # (N, 5, d)
        val = validation_mask(labels, fraction=cfg.val_fraction, seed=0 + k)
        stored.append(Statistics.of(expand(h.flatten(1), projection), labels, len(names), val))
        total = Statistics.accumulate(stored)
        lam, _ = choose_lambda(total, lambda_grid(cfg))
        weight = solve(total, lam).float()
        x = F.normalize(h[:, cov_token], dim=-1)
        moments.append(ClassMoments.of(x, labels, len(names)))
        means = torch.cat([m.means() for m in moments]).float()
        scat = [m.scatters() for m in moments]
        counts = torch.cat([m.counts for m in moments])
        shared = sum(s.sum(0) for s in scat) / max(float(counts.sum() - len(counts)), 1.0)
        covs = torch.cat(scat) / (counts - 1).clamp_min(1)[:, None, None]
        prec = precisions(covs, shared, shrink=cfg.covariance_shrink, blend=cfg.covariance_blend)
        base = len(stage_of)
        stage_of += [k] * len(names)
        for i, c in enumerate(names):
            chosen = data.test[c][:CAP]
            tests_x.append(torch.stack([lookup[str(p)] for p in chosen]))
            tests_y.append(torch.full((len(chosen),), base + i))
        tx, ty = torch.cat(tests_x), torch.cat(tests_y)
        scores = expand(tx.flatten(1), projection).float() @ weight
        if cov_weight:
            diff = F.normalize(tx[:, cov_token], dim=-1)[:, None] - means
            dist = (torch.einsum("bcd,cde->bce", diff, prec) * diff).sum(-1)
            scores = standardise(scores) - cov_weight * standardise(dist)
        reports.append(accuracy_report(scores.argmax(1), ty, torch.tensor(stage_of), num_stages=k))
    h = summarize_history(reports)
    return {"average": h.average, "last": h.last, "accuracy": h.accuracy, "forgetting": h.mean_forgetting}


def score(args) -> None:
    data, stages = plan(args.data, args.seed, args.split)
    groups = [args.feats] if args.concat else [[path] for path in args.feats]
    for group in groups:
        saved = [torch.load(path) for path in group]
        lookup = {p: torch.cat([s["features"][i] for s in saved]) for i, p in enumerate(saved[0]["paths"])}
        name = "+".join(Path(path).name for path in group)
        for cov in (0.0, 4.0):
            r = replay(
                data,
                stages,
                lookup,
                seed=args.seed,
                cov_weight=cov,
                layout_scale=0.5,
                proj_dim=3000,
                cov_token=args.cov_token,
            )
            acc = " ".join(f"{a:.1f}" for a in r["accuracy"])
            print(
                f"{name} cov {cov:g}@{args.cov_token}: Ā {r['average']:.2f} A_T {r['last']:.2f} F {r['forgetting']:.2f} | {acc}",
                flush=True,
            )
            if args.out:
                with open(args.out, "a") as fh:
                    record = {
                        "feats": name,
                        "split": args.split,
                        "seed": args.seed,
                        "cov": cov,
                        "cov_token": args.cov_token,
                    }
                    fh.write(json.dumps({**record, **r}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("embed")
    e.add_argument("--data", type=Path, required=True)
    e.add_argument("--seed", type=int, default=1993)
    e.add_argument("--split", choices=("val", "test"), default="val")
    e.add_argument("--peft", choices=("none", "adaptformer"), default="adaptformer")
    e.add_argument("--rank", type=int, default=64)
    e.add_argument("--loss", choices=("ce", "das"), default="ce")
    e.add_argument("--kd", type=float, default=0.0)
    e.add_argument("--epochs", type=int, default=20)
    e.add_argument("--lr", type=float, default=0.01)
    e.add_argument("--batch", type=int, default=48)
    e.add_argument("--scale-init", type=float, default=16.0)
    e.add_argument("--threads", type=int, default=2)
    e.add_argument(
        "--adapt-stages", type=int, default=1, help="train on the first K stages' classes (K > 1: an oracle)"
    )
    e.add_argument("--blocks", help="train only these blocks' adapters (depth.py's syntax: 0-5, 0-3+8-11)")
    e.add_argument("--adapters", type=Path, help="with --peft none: embed with gpu_adapt.py's adapters instead")
    e.add_argument("--key", help="the variant in --adapters")
    e.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("score")
    s.add_argument("--data", type=Path, required=True)
    s.add_argument("--feats", type=Path, nargs="+", required=True)
    s.add_argument("--seed", type=int, default=1993)
    s.add_argument("--split", choices=("val", "test"), default="val")
    s.add_argument("--out", type=Path)
    s.add_argument("--concat", action="store_true", help="join the files' tokens per image (one head on all)")
    s.add_argument(
        "--cov-token", type=int, default=0, help="the token the class covariances read (5: the second file's f)"
    )
    args = p.parse_args()
    embed(args) if args.command == "embed" else score(args)


if __name__ == "__main__":
    main()
