"""Issue 32: can old classes' statistics follow adapted features, estimated from the newest stage's images alone?

Features read through statistics stored before the adaptation are far worse than the frozen PTM's
(``adaptation-bounds.md``). A run keeps no old images, but it can embed the newest stage's images
with the network before and after the stage's training. This fits a ridge map from the features
before to the features after on those images only, applies it to the old classes' images (what a
run would do to their stored class moments: a linear map moves a Gaussian's mean and covariance
exactly), and replays B0 Inc10 with the product's head: the old classes' statistics from the mapped
features, the newest stage's and every test image's from the adapted network. Prints A_T.

    python drift.py --data SKETCH --before sk_all.pt --after joint-ce20-1993-f32.pt --seed 1993 --fit-stages 10,11
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cov_rank"))
from replay import plan, replay  # noqa: E402

from drlcli.benchmark.protocol import BenchmarkData  # noqa: E402
from drlcli.config import RunConfig  # noqa: E402
from drlcli.heads.linalg import ridge_map  # noqa: E402


def move_tokens(rows: torch.Tensor, x: torch.Tensor, y: torch.Tensor, lam: float) -> torch.Tensor:
    """(n, S, d) ``rows`` moved by one ``ridge_map`` per token, fitted from ``x`` to ``y`` (m, S, d)."""
    moved = torch.empty_like(rows)
    for t in range(rows.shape[1]):
        b_mat, b = ridge_map(x[:, t], y[:, t], lam)
        moved[:, t] = rows[:, t] + rows[:, t] @ b_mat + b
    return moved


def synthesise(x: torch.Tensor, labels: torch.Tensor, draws: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Per class (in ``labels.unique()`` order), ``draws`` times as many draws as it has rows from the
    Gaussian with its rows' mean and covariance (mean + zᵀ X_c / √(n − 1), z ~ N(0, I_n): the same
    first two moments in expectation)."""
    out = []
    flat = x.flatten(1)
    for c in labels.unique():
        rows = (labels == c).nonzero().squeeze(1)
        mean = flat[rows].mean(0)
        centred = flat[rows] - mean
        z = torch.randn(draws * len(rows), len(rows), generator=generator, dtype=x.dtype)
        out.append((mean + z @ centred / max(len(rows) - 1, 1) ** 0.5).view(-1, *x.shape[1:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--before", required=True, help="features before the adaptation (path -> (5, d))")
    parser.add_argument("--after", required=True, help="features after it")
    parser.add_argument("--seed", type=int, default=1993)
    parser.add_argument("--fit-stages", default="10,11", help="the stages whose images estimate the map (1-based)")
    parser.add_argument("--lams", default="0,1,10,100")
    parser.add_argument(
        "--tokens", choices=("joint", "each"), default="each", help="one map over [f, l] or one per token"
    )
    parser.add_argument(
        "--synth",
        action="store_true",
        help="old classes' features replaced by draws from a Gaussian with each class's mean and covariance "
        "(all a run stores of them), as many as it has images",
    )
    parser.add_argument("--draws", type=int, default=1, help="with --synth: this many times as many draws")
    args = parser.parse_args()
    load = lambda f: dict(zip(*[torch.load(f)[k] for k in ("paths", "features")]))  # noqa: E731
    before, after = load(args.before), load(args.after)
    data, stages = plan([args.data], args.seed, "val")
    fit_stages = [int(s) for s in args.fit_stages.split(",")]
    new = {c for s in fit_stages for c in stages[s - 1]}
    fit = [str(p) for c in new for p in data.train[c]]
    old = [str(p) for c in data.train if c not in new for p in data.train[c]]
    labels = torch.tensor([i for i, c in enumerate(data.train) if c not in new for _ in data.train[c]])
    x = torch.stack([before[p] for p in fit]).double()
    y = torch.stack([after[p] for p in fit]).double()
    xo = torch.stack([before[p] for p in old]).double()
    config = RunConfig.for_method("drl", {"ranpac": {"covariance_rank": 0}}, preset="frozen").with_train(seed=args.seed)
    print(f"map fitted on {len(fit)} images of {len(new)} classes; applied to {len(old)} images", flush=True)
    for lam in ["none", *[x for x in args.lams.split(",") if x]]:
        if lam == "none":
            mapped = xo  # the stale statistics
        elif args.tokens == "joint":
            b_mat, b = ridge_map(x.flatten(1), y.flatten(1), float(lam))
            flat = xo.flatten(1)
            mapped = (flat + flat @ b_mat + b).view_as(xo)
        else:
            mapped = move_tokens(xo, x, y, float(lam))
        lookup, fitted = dict(after), data
        truth = torch.stack([after[p] for p in old]).double()
        err = ((mapped - truth).norm() / (xo - truth).norm()).item()
        if args.synth:  # each old class's rows become draws, under names of their own
            train = dict(data.train)
            drawn = synthesise(mapped, labels, args.draws, torch.Generator().manual_seed(args.seed))
            for i, rows in zip(labels.unique().tolist(), drawn):
                name = list(data.train)[i]
                train[name] = [Path(f"{data.train[name][0]}#draw{j}") for j in range(len(rows))]
                lookup.update(zip(map(str, train[name]), rows.float()))
            fitted = BenchmarkData(train, data.test, data.source)
        else:
            lookup.update(zip(old, mapped.float()))
        result = replay(fitted, stages, lookup, config, [16])[16]
        print(
            f"map λ {lam}: old features' error {err:.3f} of the stale one's; "
            f"A_T capped {result['capped']['last']:.2f} full {result['full']['last']:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
