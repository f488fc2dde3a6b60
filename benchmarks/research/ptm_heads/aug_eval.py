"""RanPAC-style ridge with statistics over augmented views of the training images (B0 Inc10 replay).

    python aug_eval.py --data caltech --split val --seeds 1993 --views flip,rrc35_0 --cols c11 [--wv 1]

Every view of an image goes to the image's own side of the 80/20 statistics split (seeded per class on
the source images), so no view of a held-out image informs the fit side when λ is chosen. --wv weighs
each augmented view (the original view has weight 1). Evaluation uses the original (eval-transform)
features only. Prints Ā / A_T / forgetting per evaluation set; appends to results/DATA_SPLIT_aug.jsonl.
"""
import argparse
import json
import math

import numpy as np
import torch
from ptmheads import HERE, Gaussian, Ridge, class_order, l2n, load_feats, metrics, val_split

COLS = {"c7": slice(0, 192), "c11": slice(192, 384)}


def ml_cols(tokens):
    return np.concatenate([np.arange(384 * int(t[1:]), 384 * int(t[1:]) + 192) for t in tokens])


GRID = {"c11": (0, 192), "g11": (192, 960), "c7": (960, 1152), "g7": (1152, 1920)}


def grid_cols(tokens):
    """extract_grid.py's columns: c11 (f_0), g11 (block-11 patch tokens on a 2 x 2 grid), c7, g7."""
    return np.concatenate([np.arange(*GRID[t]) for t in tokens])


class AugRidge(Ridge):
    """ptmheads.Ridge (RanPAC-style, λ by the held-out split, local search) whose ``add`` takes several
    views of the same images; every view goes to its source image's side of the split."""

    def __init__(self, d, M=3000, seed=0):
        super().__init__(M=M, seed=seed)
        g = torch.Generator().manual_seed(seed)
        self.R = torch.randn(d, M, generator=g, dtype=torch.float32).double()
        self.G = torch.zeros(M, M, dtype=torch.float64)
        self.GB = torch.zeros_like(self.G)
        self.Q = torch.zeros(M, 0, dtype=torch.float64)
        self.QB = torch.zeros_like(self.Q)
        self.nB, self.step = 0.0, 1.0

    def add(self, views, weights, y):
        M, C = self.R.shape[1], int(y.max()) + 1
        pad = torch.zeros(M, C - self.Q.shape[1], dtype=torch.float64)
        self.Q, self.QB = torch.cat([self.Q, pad], 1), torch.cat([self.QB, pad.clone()], 1)
        rng = np.random.RandomState(self.seed + 7)
        inB = np.zeros(len(y), bool)
        for c in np.unique(y):
            idx = np.where(y == c)[0]
            inB[rng.permutation(idx)[:max(1, int(round(0.2 * len(idx))))]] = True
        mB = torch.from_numpy(inB)
        Y = torch.zeros(len(y), C, dtype=torch.float64)
        Y[torch.arange(len(y)), torch.from_numpy(y)] = 1
        for X, w in zip(views, weights):
            P = self._phi(X)
            self.G += w * P.T @ P
            self.Q += w * P.T @ Y
            self.GB += w * P[mB].T @ P[mB]
            self.QB += w * P[mB].T @ Y[mB]
            self.nB += w * float(mB.sum())
        lam = self._select(self.G - self.GB, self.Q - self.QB, self.GB, self.QB, self.nB)
        self.lams.append(lam)
        self.W = self._solve(self.G, self.Q, lam)


class FrozenQDA(Gaussian):
    """Gaussian qda whose classes' precisions are computed when their stage is added (the shared
    scatter of the classes seen by then) and never recomputed."""

    def add(self, X, y):
        super().add(X, y)
        self._cache = None
        _, mu, P, ld = self._prep()
        self.frozen = getattr(self, "frozen", None)
        if self.frozen is None:
            self.frozen = (mu, P)
        else:
            k = len(self.frozen[0])
            self.frozen = (np.concatenate([self.frozen[0], mu[k:]]), np.concatenate([self.frozen[1], P[k:]]))
        self._cache = ("qda", self.frozen[0], self.frozen[1], np.zeros(len(self.frozen[0])))


def z(S):
    return (S - S.mean(1, keepdims=True)) / S.std(1, keepdims=True).clip(1e-12)


def load_views(data, views, n):
    d = HERE / "feats" / f"{data}_aug"
    out = {}
    for v in views:
        arr = np.concatenate([np.load(d / f"{v}_{k:04d}.npy") for k in range(math.ceil(n / 256))]).astype(np.float64)
        assert len(arr) == n, (v, len(arr), n)
        out[v] = arr
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--split", choices=["val", "test"], required=True)
    ap.add_argument("--seeds", default="1993")
    ap.add_argument("--views", default="")
    ap.add_argument("--wv", type=float, default=1.0)
    ap.add_argument("--cols", default="c11")
    ap.add_argument("--M", type=int, default=3000)
    ap.add_argument("--grid", type=int, default=0, help="1: read extract_grid.py's cache (columns c11, g11, c7, g7)")
    ap.add_argument("--gscale", type=float, default=1.0, help="with --grid: the g11/g7 columns of the ridge input times this")
    ap.add_argument("--f0", type=int, default=0, help="1: read extract.py's f_0-only cache (full Sketch test); --cols c11")
    ap.add_argument("--qda", default="", help="comma list of weights w: also score z(ridge) + w z(FeCAM-style QDA)")
    ap.add_argument("--qcols", default="", help="QDA feature columns (default: --cols)")
    ap.add_argument("--qshrink", type=float, default=0.3)
    ap.add_argument("--qblend", type=float, default=0.8)
    ap.add_argument("--qfreeze", type=int, default=0)
    ap.add_argument("--rnorm", type=int, default=0, help="1: the ridge's input f_0 L2-normalised (times sqrt d)")
    ap.add_argument("--qprior", type=float, default=0.0, help="add qprior * 2 log n_c to the QDA scores (class prior)")
    ap.add_argument("--max-train", type=int, default=0, help="fit on at most this many images per class (0: all)")
    ap.add_argument("--lamstep", type=float, default=1.0, help="λ grid step in decades")
    a = ap.parse_args()
    torch.set_num_threads(int(__import__("os").environ.get("THREADS", "2")))
    cols = a.cols.split(",")
    feats = load_feats(a.data if a.f0 else f"{a.data}_grid" if a.grid else f"{a.data}_ml")
    if a.grid and a.gscale != 1.0:  # every part's grid columns, so fit and evaluation see the same input
        for x, _, _ in feats["parts"].values():
            for lo, hi in (GRID["g11"], GRID["g7"]):
                x[:, lo:hi] *= a.gscale
    Xtr_ml, ytr, _ = feats["parts"]["train"]
    pick = (lambda tokens: np.arange(192)) if a.f0 else grid_cols if a.grid else ml_cols
    Xtr = Xtr_ml[:, pick(cols)]
    qc = pick(a.qcols.split(",")) if a.qcols else pick(cols)
    Xq = Xtr_ml[:, qc]
    views = [v for v in a.views.split(",") if v]
    aug = {v: np.concatenate([x[:, COLS[c]] for c in cols], 1) for v, x in load_views(a.data, views, len(ytr)).items()}
    for seed in map(int, a.seeds.split(",")):
        pos = class_order(feats["classes"], seed)
        if a.split == "val":
            fit, vcap, vfull = val_split(a.data, feats, seed)
            evalsets = {"valcap": (Xtr[vcap], pos[ytr[vcap]], Xq[vcap]), "valfull": (Xtr[vfull], pos[ytr[vfull]], Xq[vfull])}
        else:
            fit = np.arange(len(ytr))
            parts = feats["parts"]
            Xc, yc = parts["testcap"][0][:, pick(cols)], parts["testcap"][1]
            evalsets = {"testcap": (Xc, pos[yc], parts["testcap"][0][:, qc])}
            if "testrest" in parts and len(parts["testrest"][1]) + len(yc) == 2893:
                evalsets["testfull"] = (np.concatenate([Xc, parts["testrest"][0][:, pick(cols)]]),
                                        pos[np.concatenate([yc, parts["testrest"][1]])],
                                        np.concatenate([parts["testcap"][0][:, qc], parts["testrest"][0][:, qc]]))
        if a.max_train:
            seen_per = {}
            fit = np.array([i for i in fit if seen_per.setdefault(ytr[i], []).append(i) or len(seen_per[ytr[i]]) <= a.max_train])
        yf = pos[ytr[fit]]
        head = AugRidge(Xtr.shape[1], a.M)
        head.step = a.lamstep
        if a.rnorm:
            phi0 = head._phi
            head._phi = lambda X, phi0=phi0: phi0(l2n(X) * np.sqrt(X.shape[1]))
        qws = [float(w) for w in a.qda.split(",") if w]
        qda = (FrozenQDA if a.qfreeze else Gaussian)(kind="qda", norm="l2", shrink=a.qshrink, blend=a.qblend, prior=a.qprior) if qws else None
        names = [(k, w) for k in evalsets for w in [None] + qws]
        rec = {n: {"accs": [], "groups": []} for n in names}
        for t, s in enumerate(range(0, len(pos), 10)):
            m = (yf >= s) & (yf < s + 10)
            head.add([Xtr[fit][m]] + [aug[v][fit][m] for v in views], [1.0] + [a.wv] * len(views), yf[m])
            if qda is not None:
                qda.add(Xq[fit][m], yf[m])
            seen = min(s + 10, len(pos))
            for k, (X, y, XQ) in evalsets.items():
                ms = y < seen
                S = head.scores(X[ms])[:, :seen]
                Sq = qda.scores(XQ[ms])[:, :seen] if qda is not None else None
                g = np.minimum(y[ms] // 10, 10)
                for w in [None] + qws:
                    T = S if w is None else z(S) + w * z(Sq)
                    ok = T.argmax(1) == y[ms]
                    rec[(k, w)]["accs"].append(100.0 * ok.mean())
                    rec[(k, w)]["groups"].append([100.0 * ok[g == j].mean() for j in range(t + 1)])
        res = {(k if w is None else f"{k}+q{w:g}"): metrics(r["groups"], r["accs"]) for (k, w), r in rec.items()}
        msg = " ".join(f"{k}:{r['Abar']:.2f}/{r['AT']:.2f}/F{r['forgetting']:.2f}" for k, r in res.items())
        print(f"{a.data} {a.split} {seed}{f' grid gscale={a.gscale:g}' if a.grid else ''} cols={a.cols} q={a.qcols or a.cols}/{a.qshrink:g}/{a.qblend:g}{'/frozen' if a.qfreeze else ''}{f'/prior{a.qprior:g}' if a.qprior else ''} max_train={a.max_train}{' rnorm' if a.rnorm else ''} views={a.views or '-'} wv={a.wv:g} M={a.M} st={a.lamstep:g} {msg} "
              f"lams={[f'{l:.0e}' for l in head.lams]}", flush=True)
        with open(HERE / "results" / f"{a.data}_{a.split}_aug.jsonl", "a") as f:
            f.write(json.dumps({"seed": seed, "grid": a.grid, "gscale": a.gscale, "cols": a.cols, "qcols": a.qcols, "qshrink": a.qshrink, "qblend": a.qblend, "qfreeze": a.qfreeze, "qprior": a.qprior, "rnorm": a.rnorm, "max_train": a.max_train, "views": a.views, "wv": a.wv, "M": a.M, "lamstep": a.lamstep,
                                "results": res, "lams": head.lams}) + "\n")


if __name__ == "__main__":
    main()
