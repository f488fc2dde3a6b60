"""Open-set AUROC of rules that read the PTM's layout (issue 19, after issue 15's fifth round put the
2 x 2 grid of final patch tokens into the default head). Issue's protocol: B0 Inc10 seed 1993, the
first 9 stages (90 classes) known, the last 11 classes unknown; statistics of the final state.

Features from `ptm_heads/extract_grid.py` (NAME_grid): f_0 = block-11 class token, l_1..l_4 = block-11
patch tokens pooled over a 2 x 2 grid, and the same for block 7. Each part is L2-normalised, then
weighted and concatenated, so a cosine over the concatenation is a weighted mean of the parts' cosines.

    python layoutrules.py caltech_grid|sketch_grid [--val] [--seeds 1993] [--knn] [--specs NAME,...]
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ptm_heads"))
from ptmheads import auroc, l2n, ordered_split  # noqa: E402

K = 90
F0, CELLS, B7, B7CELLS = (0, 192), (192, 960), (960, 1152), (1152, 1920)


def parts(X, spec):
    """Concatenate L2-normalised parts scaled by their weights: spec = [(cols, weight, per_cell)]."""
    out = []
    for (a, b), w, per_cell in spec:
        P = X[:, a:b]
        cells = [l2n(P[:, k:k + 192]) for k in range(0, b - a, 192)] if per_cell else [l2n(P)]
        out.append(w * np.concatenate(cells, 1) / np.sqrt(len(cells)))
    return np.concatenate(out, 1)


def shrink(S, a):
    d = S.shape[0]
    return (1 - a) * S + a * np.trace(S) / d * np.eye(d)


def rules(F, y, E, knn=False):
    mu = np.stack([F[y == c].mean(0) for c in range(K)])
    out = {"maxcos": (l2n(E) @ l2n(mu).T).max(1)}
    if knn:  # a ceiling, not a product rule: it reads every known training image's features
        S = l2n(E) @ l2n(F).T
        for k in (1, 5, 20):
            out[f"kNN{k}"] = np.sort(S, 1)[:, -k:].mean(1)
    n = np.array([(y == c).sum() for c in range(K)])
    Sp = sum(np.cov(F[y == c].T) * (n[c] - 1) for c in range(K)) / (n.sum() - K)
    St = np.cov(F.T)
    gmu = F.mean(0)
    for a in (0.5,):
        P = np.linalg.inv(shrink(Sp, a))
        EP = E @ P
        D = (EP * E).sum(1)[:, None] - 2 * EP @ mu.T + ((mu @ P) * mu).sum(1)[None]
        D0 = E - gmu
        d0 = ((D0 @ np.linalg.inv(shrink(St, a))) * D0).sum(1)
        out[f"rmd a{a}"] = -(D - d0[:, None]).min(1)
    return out


SPECS = {
    "f0": [(F0, 1.0, False)],
    "f0 + cells 0.5 (pooled)": [(F0, 1.0, False), (CELLS, 0.5, False)],
    "f0 + cells 1 (pooled)": [(F0, 1.0, False), (CELLS, 1.0, False)],
    "f0 + cells 0.5 (per cell)": [(F0, 1.0, False), (CELLS, 0.5, True)],
    "f0 + cells 1 (per cell)": [(F0, 1.0, False), (CELLS, 1.0, True)],
    "f0 + b7 0.5": [(F0, 1.0, False), (B7, 0.5, False)],
    "f0 + b7 1": [(F0, 1.0, False), (B7, 1.0, False)],
    "f0 + b7 1.5": [(F0, 1.0, False), (B7, 1.5, False)],
    "f0 + b7 2": [(F0, 1.0, False), (B7, 2.0, False)],
    "b7": [(B7, 1.0, False)],
    "f0 + cells 0.5 + b7 0.5": [(F0, 1.0, False), (CELLS, 0.5, True), (B7, 0.5, False)],
    "f0 + cells 0.5 + b7 cells 0.5": [(F0, 1.0, False), (CELLS, 0.5, True), (B7CELLS, 0.5, True)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--val", action="store_true")
    ap.add_argument("--seeds", default="1993")
    ap.add_argument("--specs", default="", help="comma-separated spec names (all when empty)")
    ap.add_argument("--knn", action="store_true", help="add the k-nearest-training-image cosine (a ceiling)")
    a = ap.parse_args()
    keep = set(a.specs.split(",")) if a.specs else None
    for seed in (int(s) for s in a.seeds.split(",")):
        Xtr, ytr, Xe, ye = ordered_split(a.name, test=not a.val, seed=seed)
        m = ytr < K
        Xtr, ytr = Xtr[m], ytr[m]
        known = ye < K
        for sname, spec in SPECS.items():
            if keep and sname not in keep:
                continue
            res = rules(parts(Xtr, spec), ytr, parts(Xe, spec), knn=a.knn)
            for r, v in res.items():
                print(f"{a.name:12s} {'val' if a.val else 'test'} {seed} {sname:32s} {r:8s} "
                      f"auroc={auroc(v[known], v[~known]):.4f}", flush=True)


if __name__ == "__main__":
    main()
