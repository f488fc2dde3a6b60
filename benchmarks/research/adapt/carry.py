"""Issue 32, seventh round: one adapter set carried from stage to stage (blocks 0-5, a larger step)
moves the features as far as the oracle; can a run carry its old classes' statistics along with it?

``gpu_oracle.py staged`` saves every stage's adapters (``<name>-stages.pt``). ``embed`` embeds, on the
CPU, what a run would see at each stage k: stage k's fit images through the adapters of stage k - 1
(before; stage 1: the frozen PTM) and of stage k (after), and the held-out images of the classes seen
so far through stage k's. ``replay`` fits the product's own head stage by stage (``fit_stage``), with
the earlier stages' statistics, before each stage:

- ``stale``: left as stored (what a run with no carry does);
- ``rows``: recomputed from the earlier classes' fit rows, each moved stage by stage by ``shift``
  (fitted on that stage's images before and after; a run keeps no rows: the bound of this carry);
- ``gauss``: recomputed as the expectation under each earlier class's Gaussian of those moved rows,
  its covariance cut to ``--gauss-rank`` leading directions and the rest isotropic (``gram_map``'s
  ``gaussian_sums``; a linear map moves a Gaussian exactly, so a run that stores class Gaussians can
  do this), ``--draws`` draws a row at the last stage, ``--mid-draws`` at the others;
- ``stored``: as ``gauss``, but each class's Gaussian is taken once, from its own stage's rows, and
  the Gaussian itself is moved (what a run can store: mean, r directions, σ, and the product of the
  maps' linear parts for its isotropic rest); ``stored-iso``: the rest left isotropic;
- ``final``: every statistic from the last network (the bound; tables from ``embed --freeze-after``).

``embed --freeze-after K --reuse TABLES`` makes the tables of the same run had its adapters stopped
learning after stage K (stages 1..K from TABLES, the rest and the bound through stage K's adapters).

    python carry.py embed --stages-file b05-ce10-lr05-1993-stages.pt --data /work/scratch/sketch \
        --seed 1993 --out ce-embeds.pt                                     # 9 minutes on 2 cores
    python carry.py replay --embeds ce-embeds.pt --data /work/scratch/sketch --seed 1993 --carries stale,rows,gauss
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cov_rank"))
from drift import move_tokens  # noqa: E402
from first_stage import WEIGHTS, Adapted, embed_images  # noqa: E402
from gram_map import StoredGaussian, gaussian_sums  # noqa: E402
from replay import plan, replay, stage_scores, summary, summary_line  # noqa: E402

from drlcli.config import RunConfig  # noqa: E402
from drlcli.heads.ridge import COV_COVARIANCE, COV_MEAN, COV_SCATTER, PROJECTION  # noqa: E402
from drlcli.heads.ridge.carry import TokenMaps  # noqa: E402
from drlcli.heads.ridge.statistics import pack  # noqa: E402
from drlcli.methods.ease.options import EaseConfig  # noqa: E402
from drlcli.metrics import accuracy_report  # noqa: E402
from drlcli.ptm import backbone  # noqa: E402
from drlcli.ptm.backbone import PTMSource  # noqa: E402

RANK = 16


def embed_stages(args) -> None:
    torch.set_num_threads(args.threads)
    data, stages = plan([args.data], args.seed, "val")
    snapshots = torch.load(args.stages_file)
    ptm = backbone.create_ptm("deit_tiny_patch16_224", source=PTMSource(weights_path=WEIGHTS))
    cfg = backbone.data_config(ptm)
    net = Adapted(ptm, EaseConfig(adapter_dim=64))
    net.new_stage(seed=args.seed)
    fit = lambda k: [str(p) for c in sorted(stages[k]) for p in data.train[c]]  # noqa: E731
    tick = time.time()

    def features(k: int, paths: list[str]) -> list[torch.Tensor]:
        """``paths`` through stage k's adapters (k = -1: none, the frozen PTM)."""
        net.stages[-1].load_state_dict({n: v.float() * (k >= 0) for n, v in snapshots[max(k, 0)].items()})
        out = embed_images(net, [Path(p) for p in paths], cfg, args.workers, torch.device("cpu")).float()
        print(f"stage {k + 1}: {len(paths)} images embedded ({time.time() - tick:.0f} s)", flush=True)
        return list(out)

    if args.freeze_after:  # the adapters stop learning after stage K: stages 1..K as in --reuse, the rest at K
        last = args.freeze_after - 1
        out = torch.load(args.reuse)
        out["stages_file"] = f"{args.stages_file}, frozen after stage {args.freeze_after}"
        everything = [p for k in range(len(stages)) for p in fit(k)]
        everything += [str(p) for k in range(len(stages)) for c in sorted(stages[k]) for p in data.test[c]]
        out["final"] = dict(zip(everything, features(last, everything)))  # the bound: every statistic recomputed
        later = [p for k in range(last + 1, len(stages)) for p in fit(k)]
        out["after"].update({p: out["final"][p] for p in later})
        out["before"].update({p: out["final"][p] for p in later})
        seen = [c for k in range(last + 1) for c in sorted(stages[k])]
        del out["val"][last + 1 :]
        for k in range(last + 1, len(stages)):
            seen += sorted(stages[k])
            out["val"].append({str(p): out["final"][str(p)] for c in seen for p in data.test[c]})
        torch.save(out, args.out)
        return
    out = {"after": {}, "before": {}, "val": [], "stages_file": str(args.stages_file)}
    seen: list[str] = []
    for k in range(len(stages)):
        seen += sorted(stages[k])
        val = [str(p) for c in seen for p in data.test[c]]
        if k == 0:
            out["before"].update(zip(fit(0), features(-1, fit(0))))
        after_next = fit(k + 1) if k + 1 < len(stages) else []
        paths = fit(k) + after_next + val
        feats = features(k, paths)
        a, b = len(fit(k)), len(after_next)
        out["after"].update(zip(paths[:a], feats[:a]))
        out["before"].update(zip(paths[a : a + b], feats[a : a + b]))
        out["val"].append(dict(zip(paths[a + b :], feats[a + b :])))
        torch.save(out, args.out)


@dataclass(frozen=True)
class Carry:
    """How the earlier stages' statistics follow the features (the module docstring)."""

    kind: str = "rows"  # stale, rows or gauss
    move: str = "ridge"  # ridge, sdc or both (``shift``)
    lam: float = 1000.0
    sigma: float = 0.1
    rank: int = RANK
    draws: str = "100"
    mid_draws: str = "20"
    draw_seed: int = 0  # gauss: another sample of the draws (0: the seventh round's)

    @property
    def label(self) -> str:
        how = {
            "ridge": f"λ {self.lam:g}",
            "sdc": f"sdc σ² {self.sigma:g}",
            "both": f"λ {self.lam:g} + sdc σ² {self.sigma:g}",
        }
        drawn = self.kind in ("gauss", "stored", "stored-iso")
        gauss = f" rank {self.rank} draws {self.mid_draws}/{self.draws}" if drawn else ""
        gauss += f" draw seed {self.draw_seed}" if drawn and self.draw_seed else ""
        return self.kind + ("" if self.kind in ("stale", "final") else f" {how[self.move]}") + gauss


def shift(rows: torch.Tensor, x: torch.Tensor, y: torch.Tensor, carry: Carry) -> torch.Tensor:
    """(n, S, d) ``rows`` moved by the drift from ``x`` to ``y`` (m, S, d), this stage's images before and
    after: ``ridge``, one linear map per token (``drift.move_tokens``, λ); ``sdc``, each row by the mean
    drift of the images near it, Gaussian weights of bandwidth² σ times the mean squared distance
    (semantic drift compensation, Yu et al. 2020), per token; ``both``: the ridge map, then sdc on
    what it leaves."""
    if carry.move == "ridge":
        return move_tokens(rows, x, y, carry.lam)
    if carry.move == "both":
        fitted = move_tokens(x, x, y, carry.lam)
        return sdc(move_tokens(rows, x, y, carry.lam), fitted, y, carry.sigma)
    return sdc(rows, x, y, carry.sigma)


def sdc(rows: torch.Tensor, x: torch.Tensor, y: torch.Tensor, sigma: float) -> torch.Tensor:
    out = torch.empty_like(rows)
    for t in range(rows.shape[1]):
        d2 = torch.cdist(rows[:, t], x[:, t]) ** 2
        w = torch.softmax(-d2 / (2 * sigma * d2.mean()), dim=1)
        out[:, t] = rows[:, t] + w @ (y[:, t] - x[:, t])
    return out


def replay_carried(saved: dict, data, stages, config: RunConfig, carry: Carry, scored_out: list | None = None) -> dict:
    """B0 Inc10 through ``replay.stage_scores`` as a run would see it (``saved``: ``embed``'s tables,
    keyed by the paths in ``data``), the earlier statistics carried by ``carry`` before each stage:
    Ā, A_T and forgetting, capped and full. ``scored_out``, when given, receives each stage's
    (stage of each class, full-evaluation scores, labels)."""
    lookups = [{**saved["after"], **val} for val in saved["val"]]
    names = [sorted(c) for c in stages]
    moved: dict[str, torch.Tensor] = {}  # class -> its fit rows, moved stage by stage

    def before_stage(k: int, weights: list[dict], statistics: list[dict], head) -> None:
        if k == 1:
            return
        for c in names[k - 2]:  # the previous stage's classes, as it stored them
            moved[c] = torch.stack([saved["after"][str(p)] for p in data.train[c]]).double()
        if carry.kind == "stale":
            return
        own = [str(p) for c in names[k - 1] for p in data.train[c]]
        x, y = (torch.stack([saved[when][p] for p in own]).double() for when in ("before", "after"))
        if carry.kind in ("stored", "stored-iso"):  # the class Gaussians a run could keep, moved stage by stage
            for c in names[k - 2]:
                moved[c] = StoredGaussian.of(moved[c], carry.rank)
            maps = TokenMaps.fit(x, y, carry.lam)
            moved.update({c: g.moved(maps, exact=carry.kind == "stored") for c, g in moved.items()})
        else:
            shifted = shift(torch.cat(list(moved.values())), x, y, carry).split([len(r) for r in moved.values()])
            moved.update(zip(list(moved), shifted))
        draws = "rows" if carry.kind == "rows" else (carry.draws if k == len(stages) else carry.mid_draws)
        projection = weights[0][PROJECTION].double()
        qs, grams, moments, scatter = gaussian_sums(
            data,
            stages,
            config,
            k,
            moved,
            projection,
            head.layout_grid,
            draws,
            config.train.seed + k + 7919 * carry.draw_seed,
            carry.rank,
        )
        for stats, tensors, (means, covariances), q in zip(statistics, weights, moments, qs):
            tensors[COV_MEAN], tensors[COV_COVARIANCE] = means.float(), covariances.float()
            stats[COV_SCATTER] = scatter.float()
            stats["q_fit"], stats["q_val"] = q[0].float(), q[1].float()
            stats["gram_fit"], stats["gram_val"] = pack(grams[0]), pack(grams[1])

    history: dict[str, list] = {"capped": [], "full": []}
    for k, stage_of, scored in stage_scores(data, stages, lookups, config, [RANK], before_stage=before_stage):
        if scored_out is not None:
            scored_out.append((stage_of, *scored[RANK, "full"]))
        for (_, kind), (scores, labels) in scored.items():
            history[kind].append(accuracy_report(scores.argmax(1), labels, stage_of, num_stages=k))
    return {kind: summary(h) for kind, h in history.items()}


def replay_carries(args) -> None:
    saved = torch.load(args.embeds)
    data, stages = plan([args.data], args.seed, "val")
    config = RunConfig.for_method("drl", {"ranpac": {"covariance_rank": 0}}, preset="frozen").with_train(seed=args.seed)
    for kind in args.carries.split(","):
        tick = time.perf_counter()
        carry = Carry(
            kind, args.move, args.lam, args.sigma, args.gauss_rank, args.draws, args.mid_draws, args.draw_seed
        )
        if kind == "final":  # the bound: every statistic from the last network (``embed --freeze-after``)
            result = replay(data, stages, saved["final"], config, [RANK])[RANK]
        else:
            result = replay_carried(saved, data, stages, config, carry)
        print(
            f"{args.embeds.name} seed {args.seed} {carry.label}: {summary_line(result)} ({time.perf_counter() - tick:.0f} s)",
            flush=True,
        )
        if args.log:
            record = {"embeds": args.embeds.name, "carry": carry.label, "seed": args.seed, **result}
            with open(args.log, "a") as fh:
                fh.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("embed")
    e.add_argument("--stages-file", type=Path, required=True, help="gpu_oracle.py staged's <name>-stages.pt")
    e.add_argument("--freeze-after", type=int, default=0, help="K: the adapters of stage K serve every later stage")
    e.add_argument("--reuse", type=Path, help="--freeze-after: the tables of the run that kept learning")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--workers", type=int, default=1)
    r = sub.add_parser("replay")
    r.add_argument("--embeds", type=Path, required=True)
    r.add_argument("--carries", default="stale,rows,gauss")
    r.add_argument("--move", choices=("ridge", "sdc", "both"), default="ridge", help="how rows follow the drift")
    r.add_argument("--lam", type=float, default=1000.0, help="the per-token ridge map's λ (the best stage by stage)")
    r.add_argument("--sigma", type=float, default=0.1, help="sdc: bandwidth² as a share of the mean squared distance")
    r.add_argument("--gauss-rank", type=int, default=RANK)
    r.add_argument("--draws", default="100", help="gauss: draws a row at the last stage")
    r.add_argument("--mid-draws", default="20", help="gauss: draws a row at the others")
    r.add_argument("--draw-seed", type=int, default=0, help="gauss: another sample of the draws")
    r.add_argument("--log", type=Path, help="JSON lines appended here")
    for q in (e, r):
        q.add_argument("--data", type=Path, required=True)
        q.add_argument("--seed", type=int, default=1993)
    args = parser.parse_args()
    (embed_stages if args.command == "embed" else replay_carries)(args)


if __name__ == "__main__":
    main()
