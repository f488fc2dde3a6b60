"""Open-set scoring rules on cached DeiT-Tiny f_0 features (issue 19), B0 Inc10, 9 stages learned,
the classes of the last two stages (11) unknown. Per-stage calibration as the product does it: at stage
s, 20 % of the stage's training images per class are held out, the head is fitted without them, their
open-set scores give the stage's threshold (quantile at the target rate); the final head uses all images.
At test time an image is unknown when its score is below the threshold of the stage of its predicted class.

    python rules.py caltech|sketch [--val] [--rate 0.05]
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ptm_heads"))
from ptmheads import auroc, class_order, l2n, load_feats, val_split  # noqa: E402

GROUPS = {"f0": range(0, 192)}
LAMS = [10.0**e for e in range(-8, 9)]


class State:
    """Class-level statistics of the known classes: sums/counts/scatter of f_0, ridge Gram G and Q."""

    def __init__(self, d, M=3000, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.R = torch.randn(d, M, generator=g, dtype=torch.float32).double()
        self.G = torch.zeros(M, M, dtype=torch.float64)
        self.GB = torch.zeros_like(self.G)
        self.Q = torch.zeros(M, 0, dtype=torch.float64)
        self.QB = torch.zeros_like(self.Q)
        self.nB = 0.0
        self.sums, self.n, self.scat = [], [], np.zeros((d, d))
        self.f0 = slice(None)
        self.cstat, self.cscat = [], []
        self.lam = 1e3

    def phi(self, X):
        return torch.relu(torch.from_numpy(np.ascontiguousarray(X[:, self.f0])) @ self.R)

    def stats(self, X, y, C):
        P = self.phi(X)
        Y = torch.zeros(len(y), C, dtype=torch.float64)
        Y[torch.arange(len(y)), torch.from_numpy(y)] = 1
        return P.T @ P, P.T @ Y

    def add(self, X, y, rng):
        C = int(y.max()) + 1
        self.Q = torch.cat([self.Q, torch.zeros(self.Q.shape[0], C - self.Q.shape[1], dtype=torch.float64)], 1)
        self.QB = torch.cat([self.QB, torch.zeros(self.QB.shape[0], C - self.QB.shape[1], dtype=torch.float64)], 1)
        G, Q = self.stats(X, y, C)
        self.G += G
        self.Q += Q
        inB = np.zeros(len(y), bool)
        for c in np.unique(y):
            idx = np.where(y == c)[0]
            inB[rng.permutation(idx)[: max(1, round(0.2 * len(idx)))]] = True
        GB, QB = self.stats(X[inB], y[inB], C)
        self.GB += GB
        self.QB += QB
        self.nB += inB.sum()
        best = None
        for lam in LAMS:
            W = solve(self.G - self.GB, self.Q - self.QB, lam)
            if W is None:
                continue
            mse = float(self.nB - 2 * (W * self.QB).sum() + (W * (self.GB @ W)).sum())
            if best is None or mse < best[0]:
                best = (mse, lam)
        self.lam = best[1]
        for c in np.unique(y):
            Xc = X[y == c]
            self.sums.append(Xc.sum(0))
            self.n.append(len(Xc))
            self.scat += (Xc - Xc.mean(0)).T @ (Xc - Xc.mean(0))
            f = Xc[:, self.f0]
            cs = l2n(f) @ l2n(f.mean(0, keepdims=True)).T
            self.cstat.append((cs.mean(), cs.std() + 1e-6))
            self.cscat.append((f - f.mean(0)).T @ (f - f.mean(0)) / max(len(f) - 1, 1))

    def head(self, drop=None):
        """Scoring model; drop=(X, y) removes those images' statistics (calibration without them)."""
        G, Q = self.G, self.Q
        sums, n, scat = np.array(self.sums), np.array(self.n, float), self.scat.copy()
        if drop is not None:
            X, y = drop
            Gd, Qd = self.stats(X, y, Q.shape[1])
            G, Q = G - Gd, Q - Qd
            # means/scatter without the dropped images
            for c in np.unique(y):
                full_mu = sums[c] / n[c]
                Xd = X[y == c]
                sums[c] = sums[c] - Xd.sum(0)
                n[c] -= len(Xd)
                # scatter of the class recomputed around the new mean is not available from sums alone;
                # approximate by removing the dropped images' scatter around the old mean (exact enough)
                scat -= (Xd - full_mu).T @ (Xd - full_mu)
        N = n.sum()
        gmu = sums.sum(0) / N
        # total scatter = within + between (class-level statistics only)
        mu = sums / n[:, None]
        tot = scat + ((mu - gmu).T * n) @ (mu - gmu)
        return Head(self, G, Q, mu, scat / max(N - len(n), 1), gmu, tot / (N - 1))


def solve(G, Q, lam):
    A = G + lam * torch.eye(G.shape[0], dtype=G.dtype)
    L, info = torch.linalg.cholesky_ex(A)
    return None if int(info) else torch.cholesky_solve(Q, L)


class Head:
    def __init__(self, st, G, Q, mu, Sw, gmu, St):
        self.st = st
        A = G + st.lam * torch.eye(G.shape[0], dtype=G.dtype)
        self.L = torch.linalg.cholesky(A)
        self.W = torch.cholesky_solve(Q, self.L)
        self.mu, self.gmu = mu, gmu
        f0 = st.f0
        self.Sw0 = Sw[f0, f0]
        self.prec = {}
        for gname, cols in GROUPS.items():
            sl = np.r_[cols]
            d = len(sl)
            for a in (0.1, 0.5):
                S = Sw[np.ix_(sl, sl)]
                S = (1 - a) * S + a * np.trace(S) / d * np.eye(d)
                T = St[np.ix_(sl, sl)]
                T = (1 - a) * T + a * np.trace(T) / d * np.eye(d)
                self.prec[(gname, a)] = (sl, np.linalg.inv(S), np.linalg.inv(T))

    def scores(self, X):
        """(pred from the ridge head, {rule: score}), higher = more known."""
        P = self.st.phi(X)
        S = (P @ self.W).numpy()
        pred = S.argmax(1)
        f0 = self.st.f0
        out = {"maxcos": (l2n(X[:, f0]) @ l2n(self.mu[:, f0]).T).max(1), "ridge_max": S.max(1)}
        for T in (0.02, 0.05, 0.1):
            m = S.max(1, keepdims=True)
            out[f"ridge_energy_T{T}"] = (m[:, 0] + T * np.log(np.exp((S - m) / T).sum(1)))
        srt = np.sort(S, 1)
        out["ridge_margin"] = srt[:, -1] - srt[:, -2]
        cos = l2n(X[:, f0]) @ l2n(self.mu[:, f0]).T
        m = np.array([a for a, _ in self.st.cstat])
        sd = np.array([b for _, b in self.st.cstat])
        out["zcos"] = ((cos - m) / sd).max(1)
        out["cos_minus_mean"] = (cos - m).max(1)
        Xf, muf = X[:, f0], self.mu[:, f0]
        d = Xf.shape[1]
        Sw = self.Sw0
        for a in (0.5,):
            qd = np.empty((len(X), len(muf)))
            for c in range(len(muf)):
                S = 0.5 * self.st.cscat[c] + 0.5 * Sw
                S = (1 - a) * S + a * np.trace(S) / d * np.eye(d)
                D = Xf - muf[c]
                qd[:, c] = (np.linalg.solve(S, D.T).T * D).sum(1)
            out[f"neg_qda_s{a}"] = -qd.min(1)
            sc = (S := None)  # noqa: F841
        Z = torch.cholesky_solve(P.T.contiguous(), self.L)
        lev = (P.T * Z).sum(0).numpy()
        out["neg_leverage"] = -lev
        for (g, a), (sl, P, PT) in self.prec.items():
            Xg, mu = X[:, sl], self.mu[:, sl]
            XP = Xg @ P
            maha = (XP * Xg).sum(1)[:, None] - 2 * XP @ mu.T + ((mu @ P) * mu).sum(1)[None]
            D0 = Xg - self.gmu[sl]
            m0 = ((D0 @ PT) * D0).sum(1)
            out[f"neg_maha_{g}_s{a}"] = -maha.min(1)
            out[f"rmd_{g}_s{a}"] = -(maha - m0[:, None]).min(1)
        return pred, out


def evaluate(name, val, rate, seed=1993, stages=9, inc=10):
    feats = load_feats(name)
    global GROUPS
    Xtr, ytr, _ = feats["parts"]["train"]
    pos = class_order(feats["classes"], seed)
    if val:
        fit, vcap, _ = val_split(name, feats, seed)
        evalsets = {"valcap": (Xtr[vcap], ytr[vcap])}
        Xtr, ytr = Xtr[fit], ytr[fit]
    else:
        evalsets = {"testcap": feats["parts"]["testcap"][:2]}
        if "testrest" in feats["parts"]:
            Xc, yc = feats["parts"]["testcap"][:2]
            Xr, yr = feats["parts"]["testrest"][:2]
            evalsets["testfull"] = (np.concatenate([Xc, Xr]), np.concatenate([yc, yr]))
    yp = pos[ytr]
    if name.endswith("_ml"):
        b = lambda k, part=0: range(384 * k + 192 * part, 384 * k + 192 * (part + 1))  # noqa: E731
        GROUPS = {"f0": b(11), "b11p": b(11, 1), "b9": b(9), "b7": b(7), "b7p": b(7, 1), "b5": b(5)}
        keep = np.r_[tuple(GROUPS.values())]
        remap, start = {}, 0
        for g, r in GROUPS.items():
            remap[g] = range(start, start + len(r))
            start += len(r)
        GROUPS = remap
        Xtr = Xtr[:, keep]
        evalsets = {k: (X[:, keep], y) for k, (X, y) in evalsets.items()}
    st = State(192, seed=0)
    st.f0 = slice(GROUPS["f0"].start, GROUPS["f0"].stop)
    st.scat = np.zeros((Xtr.shape[1], Xtr.shape[1]))
    rng = np.random.RandomState(7)
    thr = {}  # rule -> per-stage thresholds
    for s in range(stages):
        cls = np.arange(s * inc, (s + 1) * inc)
        m = np.isin(yp, cls)
        X, y = Xtr[m], yp[m]
        st.add(X, y, rng)
        hold = np.zeros(len(y), bool)
        crng = np.random.RandomState(1000 + s)
        for c in cls:
            idx = np.where(y == c)[0]
            hold[crng.permutation(idx)[: max(1, round(0.2 * len(idx)))]] = True
        h = st.head(drop=(X[hold], y[hold]))
        _, sc = h.scores(X[hold])
        for r, v in sc.items():
            thr.setdefault(r, []).append(float(np.quantile(v, rate, method="lower")))
    head = st.head()
    known_c = stages * inc
    res = {}
    for k, (X, y) in evalsets.items():
        y = pos[y]
        pred, sc = head.scores(X)
        known = y < known_c
        closed = float((pred[known] == y[known]).mean() * 100)
        for r, v in sc.items():
            t = np.array(thr[r])[pred // inc]
            acc_ = v >= t
            res.setdefault(r, {})[k] = {
                "auroc": round(float(auroc(v[known], v[~known])), 4),
                "closed_acc": round(closed, 2),
                "known_rejected": round(float((~acc_[known]).mean() * 100), 2),
                "unknown_accepted": round(float(acc_[~known].mean() * 100), 2),
                "acc_at_thr": round(float(((pred == y) & acc_)[known].mean() * 100), 2),
                "acc_on_accepted": round(float((pred == y)[known & acc_].mean() * 100), 2),
            }
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--val", action="store_true")
    ap.add_argument("--rate", type=float, default=0.05)
    ap.add_argument("--rules", default="", help="comma-separated rule names to print (all when empty)")
    a = ap.parse_args()
    res = evaluate(a.name, a.val, a.rate)
    print(json.dumps(res, indent=1))
    keep = set(a.rules.split(",")) if a.rules else None
    for r, per in res.items():
        if keep and r not in keep:
            continue
        for k, m in per.items():
            print(f"{a.name:8s} {k:8s} {r:22s} " + " ".join(f"{x}={v}" for x, v in m.items()))


if __name__ == "__main__":
    main()
