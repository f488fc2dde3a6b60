"""Which decision score for per-stage thresholds (issue 19): AUROC and rates of
(a) max_c [cos_c - t_stage(c)]  (any class claims),  (b) max cos - t_stage(argmax cos),
(c) plain max cos with one threshold (the mean of the stage thresholds). Test capped, 9 stages known.

    python decision.py caltech|sketch [RATE]
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ptm_heads"))
from ptmheads import auroc, l2n, ordered_split  # noqa: E402


def main():
    name, rate = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
    Xtr, yp, Xe, ye = ordered_split(name, test=True)
    K = 90
    mu = np.stack([Xtr[yp == c].mean(0) for c in range(K)])
    thr = []
    rng = np.random.RandomState(0)
    for s in range(9):
        cls = range(10 * s, 10 * s + 10)
        held, fitmu = [], []
        for c in cls:
            idx = np.where(yp == c)[0]
            k = max(1, round(0.2 * len(idx)))
            h = rng.permutation(idx)[:k]
            held.append(h)
            fitmu.append(Xtr[np.setdiff1d(idx, h)].mean(0))
        H = np.concatenate(held)
        best = (l2n(Xtr[H]) @ l2n(np.stack(fitmu)).T).max(1)
        thr.append(np.quantile(best, rate, method="lower"))
    t = np.repeat(np.array(thr), 10)  # per class
    cos = l2n(Xe) @ l2n(mu).T
    known = ye < K
    scores = {
        "a_any_class_claims": (cos - t).max(1),
        "b_argmax_stage": cos.max(1) - t[cos.argmax(1)],
        "c_one_threshold": cos.max(1) - t.mean(),
    }
    for r, v in scores.items():
        acc = v >= 0
        print(f"{name} rate={rate} {r:20s} auroc={auroc(v[known], v[~known]):.4f} "
              f"known_rejected={100 * (~acc[known]).mean():.2f} unknown_accepted={100 * acc[~known].mean():.2f}")


if __name__ == "__main__":
    main()
