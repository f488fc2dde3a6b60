"""Open-set AUROC of the relative Mahalanobis score on f_0 joined with earlier blocks' class tokens
(issue 19, after the calibration round). Issue's protocol: B0 Inc10, the first 9 stages (90 classes)
known, the 11 classes of stages 10-11 unknown; statistics of the final state, shrinkage 0.5.

Features from `ptm_heads/extract_ml.py` (NAME_ml): block b's class token after the final norm in
columns [384 b, 384 b + 192); block 11's is f_0. Each block's token is L2-normalised and weighted,
then concatenated: x = [f_0/|f_0|, w t_b/|t_b|, ...].

    python blockrmd.py caltech_ml|sketch_ml [--val] [--seeds 1993,1994,1995] [--specs "7:2,7+9:1,..."]
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ptm_heads"))
from ptmheads import auroc, l2n, ordered_split  # noqa: E402
from layoutrules import shrink  # noqa: E402

K = 90


def block(X, b):
    return l2n(X[:, 384 * b:384 * b + 192])


def joined(X, blocks, w):
    return np.concatenate([block(X, 11)] + [w * block(X, b) for b in blocks], 1)


def rmd(F, y, E, a=0.5):
    mu = np.stack([F[y == c].mean(0) for c in range(K)])
    n = np.array([(y == c).sum() for c in range(K)])
    Sw = sum((F[y == c] - mu[c]).T @ (F[y == c] - mu[c]) for c in range(K)) / (n.sum() - K)
    St = np.cov(F.T)
    P = np.linalg.inv(shrink(Sw, a))
    EP = E @ P
    D = (EP * E).sum(1)[:, None] - 2 * EP @ mu.T + ((mu @ P) * mu).sum(1)[None]
    Z = E - F.mean(0)
    d0 = ((Z @ np.linalg.inv(shrink(St, a))) * Z).sum(1)
    return -(D - d0[:, None]).min(1)


def parse(spec):
    blocks, w = spec.split(":")
    return ([int(b) for b in blocks.split("+")] if blocks else []), float(w)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--val", action="store_true")
    ap.add_argument("--seeds", default="1993,1994,1995")
    ap.add_argument("--specs", default=":1,7:1,7:2,7:3,8:2,9:2,10:2,6:2,5:2,7+9:1.5,5+7+9:1.5,6+8+10:1.5,7+8+9+10:1")
    a = ap.parse_args()
    specs = a.specs.split(",")
    res = {s: [] for s in specs}
    for seed in (int(s) for s in a.seeds.split(",")):
        Xtr, ytr, Xe, ye = ordered_split(a.name, test=not a.val, seed=seed)
        m = ytr < K
        Xtr, ytr = Xtr[m], ytr[m]
        known = ye < K
        for s in specs:
            blocks, w = parse(s)
            v = rmd(joined(Xtr, blocks, w), ytr, joined(Xe, blocks, w))
            res[s].append(auroc(v[known], v[~known]))
    for s, r in res.items():
        print(f"{a.name} {'val' if a.val else 'test'} {s:14s} " + " ".join(f"{x:.4f}" for x in r) + f"  mean {np.mean(r):.4f}", flush=True)


if __name__ == "__main__":
    main()
