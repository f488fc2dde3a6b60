"""Issue 32, fourteenth round: can a run tell, stage by stage, whether the carried network or the
frozen PTM should answer? Both tracks are replayed through the product's head on ``carry.py``'s tables
(the carried one with the storable class Gaussians, ``stored``; the frozen one exactly). Each class's
validation images are split in two halves: the *signal* half plays the part of the images a stage
holds out of its own training (what a run could score both tracks on when it learns them), the
*score* half measures what the switched run would answer. A rule picks a track after each stage
from the signal half alone; the switched run's A_t is the picked track's on the score half.

Rules (a run keeps no images of earlier stages, so only ``new`` and ``tally`` are storable):

- ``new``: the track with more correct held-out images of the stage's own (new) classes, scored
  among every class seen;
- ``tally``: the same counts summed over every stage so far (each stage's new classes as scored at
  their own stage: a few integers a stage);
- ``mcnemar``: ``tally``'s pairs, the carried track only when the held-out new images it alone
  answers right (b) exceed those the frozen PTM alone does (c) by more than chance would,
  b - c > 1.645 sqrt(b + c) (McNemar's one-sided test at 5 %; two integers a stage);
- ``transfer`` (needs no held-out image): forward transfer. Stage k's own training images, through
  the network as the stage began (trained on stages 1..k-1 only: the carry's "before" pass) and
  through the frozen PTM, each scored by leave-one-out nearest class mean (cosine, f_0) among the
  stage's own classes, which neither has been trained on; b and c count the images only the one or
  only the other answers right, summed over the stages so far (n images), and the carried track
  answers once b - c > 1.645 sqrt(b + c) (McNemar, one-sided 5 %) and (b - c) / n is at least
  ``--gain`` (1 %: a gain below what carrying the earlier classes costs on photos, 0.7 to 1 A_T,
  would not pay for it);
- ``stage1``: stage 1's ``new`` decides for the whole run (``first_session.decide``'s rule);
- ``all-seen``: every seen class's held-out images at this stage (a run would have to keep them);
- ``oracle``: the better track on the score half itself (a bound).

    python switch_signal.py frozen --data /work/scratch/sketch --out sketch-frozen-tables.pt
    python switch_signal.py score --data /work/scratch/sketch --seed 1995 \\
        --carried ninth/b05-ce10-lr05-dist3-1995-tables.pt --frozen sketch-frozen-tables.pt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cov_rank"))
from carry import Carry, replay_carried  # noqa: E402
from first_stage import WEIGHTS, Adapted, embed_images  # noqa: E402
from replay import plan  # noqa: E402

from drlcli.config import RunConfig  # noqa: E402
from drlcli.methods.ease.options import EaseConfig  # noqa: E402
from drlcli.metrics import leave_one_out_right  # noqa: E402
from drlcli.ptm import backbone  # noqa: E402
from drlcli.ptm.backbone import PTMSource  # noqa: E402

RULES = ("carried", "frozen", "new", "tally", "mcnemar", "transfer", "stage1", "all-seen", "oracle")
Z = 1.645  # one-sided 5 %


def frozen_tables(args) -> None:
    """``carry.py embed``'s tables for the frozen PTM, every training image embedded once: the
    frozen features do not depend on the stage, so one table serves every class order."""
    torch.set_num_threads(args.threads)
    data, _ = plan([args.data], 1993, "val")
    paths = sorted(
        {str(p) for c in data.train for p in data.train[c]} | {str(p) for c in data.test for p in data.test[c]}
    )
    ptm = backbone.create_ptm("deit_tiny_patch16_224", source=PTMSource(weights_path=WEIGHTS))
    net = Adapted(ptm, EaseConfig(adapter_dim=64))
    net.new_stage(seed=0)
    with torch.no_grad():
        for name, value in net.stages[-1].named_parameters():
            if name.startswith("up"):
                value.zero_()  # an adapter whose up-projection is zero adds nothing: the frozen PTM
    tick = time.time()
    feats = embed_images(net, [Path(p) for p in paths], backbone.data_config(ptm), args.workers, torch.device("cpu"))
    print(f"{len(paths)} images embedded ({time.time() - tick:.0f} s)", flush=True)
    torch.save({"frozen": dict(zip(paths, feats.float()))}, args.out)


def as_tables(saved: dict, data, stages) -> dict:
    """The frozen table in ``carry.py embed``'s form for one class order (val: the seen classes')."""
    if "frozen" not in saved:
        return saved
    table = saved["frozen"]
    out = {"after": table, "before": table, "val": []}
    seen: list[str] = []
    for classes in stages:
        seen += sorted(classes)
        out["val"].append({str(p): table[str(p)] for c in seen for p in data.test[c]})
    return out


def halves(labels: torch.Tensor, half: int = 0) -> torch.Tensor:
    """True for the signal half: every other validation image of each class, in the data's order
    (``half`` 0: the first, third, ...; 1: the second, fourth, ...)."""
    signal = torch.zeros(len(labels), dtype=torch.bool)
    seen: dict[int, int] = {}
    for i, y in enumerate(labels.tolist()):
        signal[i] = seen.get(y, 0) % 2 == half
        seen[y] = seen.get(y, 0) + 1
    return signal


def transfer_pairs(tables: dict, frozen: dict, data, stages) -> list[tuple[int, int, int]]:
    """Per stage, ``transfer``'s (b, c, n) (module docstring); (0, 0, 0) where there is nothing to
    compare (stage 1, whose network is the frozen PTM, and a stage of one class)."""
    out = [(0, 0, 0)]
    for classes in stages[1:]:
        names = sorted(classes)
        if len(names) < 2:
            out.append((0, 0, 0))
            continue
        paths = [str(p) for c in names for p in data.train[c]]
        y = torch.tensor([i for i, c in enumerate(names) for _ in data.train[c]])
        before = leave_one_out_right(torch.stack([tables["before"][p][0] for p in paths]), y)
        bare = leave_one_out_right(torch.stack([frozen["after"][p][0] for p in paths]), y)
        out.append((int((before & ~bare).sum()), int((bare & ~before).sum()), len(y)))
    return out


def track(tables: dict, data, stages, config: RunConfig, kind: str) -> list[tuple]:
    out: list = []
    replay_carried(tables, data, stages, config, Carry(kind), scored_out=out)
    return out


def switched(carried: list, frozen: list, transfer: list, margin: int, gain: float, half: int = 0) -> dict:
    """Each rule's picks and the switched run's A_t on the score half (full evaluation)."""
    tally = {"carried": 0, "frozen": 0}
    pairs = {"carried": 0, "frozen": 0}  # held-out new images only this track answers right, so far
    moved = [0, 0, 0]  # transfer's b, c and n so far
    picks: dict[str, list[str]] = {r: [] for r in RULES}
    accuracy: dict[str, list[float]] = {r: [] for r in RULES}
    every: dict[str, list[float]] = {r: [] for r in RULES}  # on every validation image (rules that read none)
    held: list[dict] = []
    for k, ((stage_of, sc, labels), (_, sf, labels_f)) in enumerate(zip(carried, frozen), 1):
        assert torch.equal(labels, labels_f)
        signal = halves(labels, half)
        new = stage_of[labels] == k
        right = {"carried": sc.argmax(1) == labels, "frozen": sf.argmax(1) == labels}
        on_new = {t: int((r & signal & new).sum()) for t, r in right.items()}
        # the held-out new images one track answers right and the other wrong (McNemar's pairs)
        only = {t: int((r & ~right[o] & signal & new).sum()) for (t, r), o in zip(right.items(), ("frozen", "carried"))}
        on_all = {t: int((r & signal).sum()) for t, r in right.items()}
        on_score = {t: 100.0 * float(r[~signal].float().mean()) for t, r in right.items()}
        for t in tally:
            tally[t] += on_new[t]
            pairs[t] += only[t]
        b, c = pairs["carried"], pairs["frozen"]
        moved = [m + t for m, t in zip(moved, transfer[k - 1])]
        tb, tc, tn = moved
        transfers = tn > 0 and tb - tc > Z * (tb + tc) ** 0.5 and 100.0 * (tb - tc) / tn >= gain
        on_every = {t: 100.0 * float(r.float().mean()) for t, r in right.items()}  # every validation image

        def better(counts: dict) -> str:
            return "carried" if counts["carried"] > counts["frozen"] + margin else "frozen"

        chosen = {
            "carried": "carried",
            "frozen": "frozen",
            "new": better(on_new),
            "tally": better(tally),
            "mcnemar": "carried" if b - c > Z * (b + c) ** 0.5 else "frozen",
            "transfer": "carried" if transfers else "frozen",
            "stage1": picks["new"][0] if picks["new"] else better(on_new),
            "all-seen": better(on_all),
            "oracle": max(("frozen", "carried"), key=lambda t: on_score[t]),
        }
        for rule, t in chosen.items():
            picks[rule].append(t)
            accuracy[rule].append(on_score[t])
            every[rule].append(on_every[t])
        held.append(
            {
                "stage": k,
                "held_new": int((signal & new).sum()),
                "new_right": on_new,
                "new_only": only,
                "transfer": transfer[k - 1],
                "every": on_every,
                "all_right": on_all,
                "score": on_score,
            }
        )
    out = {}
    for rule in RULES:
        a = accuracy[rule]
        e = every[rule]
        out[rule] = {"average": sum(a) / len(a), "last": a[-1], "picks": "".join(p[0] for p in picks[rule])}
        if rule in ("carried", "frozen", "transfer", "stage1"):
            out[rule] |= {"every_average": sum(e) / len(e), "every_last": e[-1]}
    return {"rules": out, "stages": held}


def score(args) -> None:
    torch.set_num_threads(args.threads)
    data, stages = plan([args.data], args.seed, "val")
    config = RunConfig.for_method("drl", {"ranpac": {"covariance_rank": 0}}, preset="frozen").with_train(seed=args.seed)
    tick = time.time()
    tables, frozen_tables = torch.load(args.carried), as_tables(torch.load(args.frozen), data, stages)
    transfer = transfer_pairs(tables, frozen_tables, data, stages)
    if args.out and args.out.exists():  # the scores of an earlier call: the rules again, without the replays
        saved = torch.load(args.out)
        carried, frozen = saved["carried"], saved["frozen"]
    else:
        carried = track(tables, data, stages, config, "stored")
        frozen = track(frozen_tables, data, stages, config, "stale")
        if args.out:
            torch.save({"carried": carried, "frozen": frozen}, args.out)
    for half in (0, 1):
        report(args, switched(carried, frozen, transfer, args.margin, args.gain, half), half, time.time() - tick)


def report(args, result: dict, half: int, seconds: float) -> None:
    print(f"{args.carried.name} seed {args.seed} margin {args.margin} signal half {half} ({seconds:.0f} s)")
    for s in result["stages"]:
        print(
            f"  stage {s['stage']:2d}: held-out new {s['held_new']:3d}, right carried/frozen "
            f"{s['new_right']['carried']}/{s['new_right']['frozen']} (all seen {s['all_right']['carried']}/"
            f"{s['all_right']['frozen']}); transfer b/c/n {'/'.join(map(str, s['transfer']))}; "
            f"score half {s['score']['carried']:.2f}/{s['score']['frozen']:.2f}"
        )
    for rule, r in result["rules"].items():
        every = f" (every image: Ā {r['every_average']:.2f} A_T {r['every_last']:.2f})" if "every_last" in r else ""
        print(f"  {rule:9s} Ā {r['average']:.2f} A_T {r['last']:.2f} picks {r['picks']}{every}")
    if args.log:
        with open(args.log, "a") as fh:
            fh.write(
                json.dumps(
                    {
                        "carried": args.carried.name,
                        "seed": args.seed,
                        "half": half,
                        "margin": args.margin,
                        "gain": args.gain,
                        **result,
                    }
                )
                + "\n"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("frozen")
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--workers", type=int, default=1)
    s = sub.add_parser("score")
    s.add_argument("--carried", type=Path, required=True, help="carry.py embed's tables of the carried run")
    s.add_argument("--frozen", type=Path, required=True, help="this script's frozen table, or carry.py's tables")
    s.add_argument("--seed", type=int, default=1993)
    s.add_argument("--margin", type=int, default=0, help="images the carried track must win by")
    s.add_argument("--gain", type=float, default=1.0, help="transfer: the least gain, %% of the images compared")
    s.add_argument("--log", type=Path)
    s.add_argument(
        "--out",
        type=Path,
        help="both tracks' scores after every stage, saved (read instead of replaying when it exists)",
    )
    for q in (f, s):
        q.add_argument("--data", type=Path, required=True)
        q.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    (frozen_tables if args.command == "frozen" else score)(args)


if __name__ == "__main__":
    main()
