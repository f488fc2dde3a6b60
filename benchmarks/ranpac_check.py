"""RanPAC and SimpleCIL on B-m Inc-n from one cached PTM feature pass (a check of ``drl benchmark``'s
numbers when the CPU cannot afford the benchmark's per-stage re-evaluation).

``drl benchmark`` embeds every seen test image again at every stage; for the frozen-PTM methods
the features never change, so this script embeds every train and test image once, then replays
the protocol with drlcli's own pieces: the benchmark's data loading, class order and stages, the
stage folders' image order, ``ranpac``'s statistics, validation split, λ choice, solve (earlier
stages' statistics round-tripped through their float32 storage, as in a run) and head, and
``evaluate``'s A_t / Ā / forgetting.

    python benchmarks/ranpac_check.py embed --data DIR --ptm-weights FILE --feats F.pt [--shard i/n]
    python benchmarks/ranpac_check.py score --data DIR --feats F.pt [F2.pt ...] [--seeds 1993,...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from drlcli.benchmark.protocol import class_order, load_data, stage_classes
from drlcli.config import RunConfig
from drlcli.data.images import ImageSet
from drlcli.data.loading import ImageDataset, eval_transform
from drlcli.features.ipa import IPAConfig
from drlcli.features.ipa.network import IPANetwork
from drlcli.heads.ridge.head import RidgeHead, expand, random_projection
from drlcli.heads.ridge.statistics import Statistics, choose_lambda, lambda_grid, solve, validation_mask
from drlcli.metrics import accuracy_report, summarize_history
from drlcli.ptm import backbone
from drlcli.ptm.backbone import PTMSource


def _all_paths(data) -> list[Path]:
    return sorted({p for split in (data.train, data.test) for paths in split.values() for p in paths})


def embed(args: argparse.Namespace) -> None:
    data = load_data(args.data, skip_classes={"BACKGROUND_Google"})
    ptm = backbone.create_ptm(args.ptm, source=PTMSource(weights_path=args.ptm_weights))
    network = IPANetwork(ptm, IPAConfig()).eval()
    paths = _all_paths(data)
    index, count = (int(x) for x in args.shard.split("/"))
    mine = list(range(index, len(paths), count))
    images = ImageSet(args.data, ("x",), tuple(paths), (0,) * len(paths))
    loader = DataLoader(Subset(ImageDataset(images, eval_transform(backbone.data_config(ptm))), mine), batch_size=64)
    feats = []
    with torch.inference_mode():
        for step, (batch, _) in enumerate(loader, 1):
            feats.append(network(batch)[:, 0].float())
            print(f"{step}/{len(loader)}", flush=True)
    torch.save({"paths": [str(paths[i]) for i in mine], "features": torch.cat(feats)}, args.feats)


def replay(data, lookup: dict[str, torch.Tensor], *, seed: int, caps: list[int | None], proj_dim: int) -> dict:
    """Both methods over the stages of ``seed``'s class order, evaluated on the test set at each cap."""
    order = class_order(list(data.train), seed=seed, shuffle=True)
    stages = stage_classes(order, 0, 10)
    cfg = RunConfig.for_method("ranpac", {"ridge": {"proj_dim": proj_dim}, "train": {"seed": seed}})
    projection = random_projection(next(iter(lookup.values())).shape[-1], proj_dim, seed=seed).to(torch.float64)
    stored: list[Statistics] = []
    class_names: list[str] = []
    class_stage: list[int] = []
    tests = {cap: ([], []) for cap in caps}
    reports = {(name, cap): [] for name in ("ranpac", "simplecil") for cap in caps}
    means, lambdas = [], []
    for k, classes in enumerate(stages, 1):
        names = sorted(classes)  # a stage folder's classes, sorted; images in list order
        paths = [p for c in names for p in data.train[c]]
        labels = torch.tensor([i for i, c in enumerate(names) for _ in data.train[c]])
        h = torch.stack([lookup[str(p.resolve())] for p in paths])
        val = validation_mask(labels, fraction=cfg.ridge.val_fraction, seed=seed + k)
        stage = Statistics.of(expand(h, projection), labels, len(names), val)
        total = Statistics.accumulate([*stored, stage])
        lam, _ = choose_lambda(total, lambda_grid(cfg.ridge))
        lambdas.append(lam)
        head = RidgeHead(projection, solve(total, lam))
        stored.append(Statistics.from_tensors(stage.to_tensors()))  # what a later stage reads back
        base = len(class_names)
        class_names += names
        class_stage += [k] * len(names)
        means.append(torch.stack([h[labels == i].mean(0) for i in range(len(names))]))
        stage_of = torch.tensor(class_stage)
        for cap, (feats, targets) in tests.items():
            for i, c in enumerate(names):
                chosen = data.test[c][:cap]
                feats.append(torch.stack([lookup[str(p.resolve())] for p in chosen]))
                targets.append(torch.full((len(chosen),), base + i))
            x, y = torch.cat(feats), torch.cat(targets)
            with torch.no_grad():
                ranpac_scores = head(x[:, None])
            simple_scores = F.normalize(x, dim=-1) @ F.normalize(torch.cat(means), dim=-1).T
            for name, scores in (("ranpac", ranpac_scores), ("simplecil", simple_scores)):
                reports[name, cap].append(accuracy_report(scores.argmax(1), y, stage_of, num_stages=k))
        print(f"seed {seed} stage {k}/{len(stages)}: λ {lam:g}", flush=True)
    out = {}
    for (name, cap), rs in reports.items():
        history = summarize_history(rs)
        out.setdefault(f"test {'capped at ' + str(cap) + '/class' if cap else 'full'}", {})[name] = {
            "accuracy": history.accuracy,
            "average": history.average,
            "last": history.last,
            "mean_forgetting": history.mean_forgetting,
            "test_images": rs[-1].num_images,
            **({"lambdas": lambdas} if name == "ranpac" else {}),
        }
    return out


def score(args: argparse.Namespace) -> None:
    data = load_data(args.data, skip_classes={"BACKGROUND_Google"})
    lookup = {}
    for path in args.feats:
        saved = torch.load(path)
        lookup.update({str(Path(p).resolve()): f for p, f in zip(saved["paths"], saved["features"])})
    results = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        results[str(seed)] = replay(data, lookup, seed=seed, caps=[10, None], proj_dim=args.proj_dim)
        for test, methods in results[str(seed)].items():
            for name, r in methods.items():
                print(
                    f"seed {seed}, {test}, {name}: Ā {r['average']:.2f} A_T {r['last']:.2f} "
                    f"forgetting {r['mean_forgetting']:.2f} ({r['test_images']} test images)",
                    flush=True,
                )
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("embed")
    e.add_argument("--data", type=Path, required=True)
    e.add_argument("--ptm", default="deit_tiny_patch16_224")
    e.add_argument("--ptm-weights", type=Path, required=True)
    e.add_argument("--feats", type=Path, required=True)
    e.add_argument("--shard", default="0/1")
    s = sub.add_parser("score")
    s.add_argument("--data", type=Path, required=True)
    s.add_argument("--feats", type=Path, nargs="+", required=True)
    s.add_argument("--seeds", default="1993")
    s.add_argument("--proj-dim", type=int, default=3000)
    s.add_argument("--out", type=Path)
    args = parser.parse_args()
    embed(args) if args.command == "embed" else score(args)


if __name__ == "__main__":
    main()
