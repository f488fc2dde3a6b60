"""Quick AUROC exploration of class-level open-set scores on cached multi-layer features (validation
split: statistics from the fit part, scores on the capped validation part; 90 known classes, 11 unknown).

    python explore.py caltech_ml|sketch_ml [--test]
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ptm_heads"))
from ptmheads import auroc, l2n, ordered_split  # noqa: E402


def blk(k, part=0):
    return slice(384 * k + 192 * part, 384 * k + 192 * (part + 1))


def kmeans(X, k, it=20, seed=0):
    rng = np.random.RandomState(seed)
    C = X[rng.choice(len(X), min(k, len(X)), replace=False)]
    for _ in range(it):
        a = (X @ C.T).argmax(1)
        C = np.stack([l2n(X[a == j].mean(0, keepdims=True))[0] if (a == j).any() else C[j] for j in range(len(C))])
    return C


def main():
    name = sys.argv[1]
    test = "--test" in sys.argv
    Xtr, yp, Xe, ye = ordered_split(name, test)
    K = 90
    m = yp < K
    Xk, yk = Xtr[m], yp[m]
    known = ye < K
    res = {}

    def add(r, s):
        res[r] = auroc(s[known], s[~known])

    def means(F):
        return np.stack([F[yk == c].mean(0) for c in range(K)])

    feat_sets = {
        "f0": [blk(11)], "b11p": [blk(11, 1)], "b10": [blk(10)], "b9": [blk(9)], "b8": [blk(8)], "b7": [blk(7)],
        "f0+b11p": [blk(11), blk(11, 1)], "f0+b9": [blk(11), blk(9)], "f0+b9+b7": [blk(11), blk(9), blk(7)],
        "f0+b10+b9+b8": [blk(11), blk(10), blk(9), blk(8)],
    }
    for fname, sl in feat_sets.items():
        Ftr = np.concatenate([l2n(Xk[:, s]) for s in sl], 1)
        Fe = np.concatenate([l2n(Xe[:, s]) for s in sl], 1)
        mu = means(Ftr)
        cos = l2n(Fe) @ l2n(mu).T
        add(f"maxcos[{fname}]", cos.max(1))
        own = np.array([(l2n(Ftr[yk == c]) @ l2n(mu[c:c + 1]).T).ravel() for c in range(K)], dtype=object)
        mc = np.array([o.mean() for o in own])
        sd = np.array([o.std() + 1e-6 for o in own])
        add(f"zcos[{fname}]", ((cos - mc) / sd).max(1))
        add(f"cos-mean[{fname}]", (cos - mc).max(1))
        add(f"cos/mean[{fname}]", (cos / mc).max(1))
    # multi-centroid on f0
    F0, F0e = l2n(Xk[:, blk(11)]), l2n(Xe[:, blk(11)])
    for k in (2, 3, 5):
        cents = np.concatenate([kmeans(F0[yk == c], k) for c in range(K)])
        add(f"maxcos_kmeans{k}[f0]", (F0e @ cents.T).max(1))
    # per-class diagonal gaussian on l2-normalised f0
    mu = means(F0)
    var = np.stack([F0[yk == c].var(0) for c in range(K)])
    for a in (0.3, 1.0):
        v = var + a * var.mean()
        ll = -(((F0e[:, None, :] - mu[None]) ** 2) / v[None]).sum(2) - np.log(v).sum(1)[None]
        add(f"diag_gauss_a{a}[f0n]", ll.max(1))
    for r, v in sorted(res.items(), key=lambda kv: -kv[1]):
        print(f"{name} {'test' if test else 'val'} {r:32s} {v:.4f}")


if __name__ == "__main__":
    main()
