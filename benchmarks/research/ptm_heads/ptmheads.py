"""Analytic / training-free heads on cached DeiT-Tiny f_0 features, run through the B0 Inc10 protocol.

Every head is exact-incremental: `add(X, y)` sees only the new stage's training features and keeps
class-level statistics (means/counts, shared or per-class scatter, Gram matrices); `scores(X)` uses
only those statistics. Nothing of old classes' images is kept.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
CAP = 10
DATA_DIRS = {"caltech": Path("/work/shared/data/caltech101"), "sketch": Path("/work/scratch/sketch")}
DATA_DIRS.update({k + sfx: v for k, v in list(DATA_DIRS.items()) for sfx in ("_ml", "_grid")})


# ------------------------------------------------------------------------------------ data
def load_feats(name: str) -> dict:
    """train_x/y (all train, sorted classes, train.txt order), testcap_x/y, testfull_x/y (if extracted)."""
    d = HERE / "feats" / name
    meta = json.loads((d / "meta.json").read_text())
    out = {"classes": meta["classes"], "parts": {}}
    for part, items in meta["parts"].items():
        n_chunks = math.ceil(len(items) / 256)
        files = [d / f"{part}_{k:04d}.npy" for k in range(n_chunks)]
        if not all(f.exists() for f in files):
            continue
        x = np.concatenate([np.load(f) for f in files]).astype(np.float64)
        y = np.array([it[1] for it in items])
        paths = [it[0] for it in items]
        out["parts"][part] = (x, y, paths)
    return out


def val_split(name: str, feats: dict, seed: int):
    """drlcli.benchmark.split_validation(data, 0.2, seed) on the cached train features:
    (fit_idx, val_idx_capped, val_idx_full) into the train arrays."""
    from drlcli.benchmark import load_data, split_validation

    data = load_data(DATA_DIRS[name], skip_classes={"BACKGROUND_Google"})
    split = split_validation(data, 0.2, seed)
    _, _, paths = feats["parts"]["train"]
    index = {p: i for i, p in enumerate(paths)}
    fit = sorted(index[str(p)] for ps in split.train.values() for p in ps)
    vfull, vcap = [], []
    for c in feats["classes"]:
        ids = [index[str(p)] for p in split.test[c]]
        vfull += ids
        vcap += ids[:CAP]
    return np.array(fit), np.array(vcap), np.array(vfull)


def ordered_split(name: str, test: bool, seed: int = 1993):
    """(Xtr, ytr, Xe, ye), labels as positions in the seed's class order: the train features and the
    capped test (``test``), or the validation split's fit part and its capped validation part."""
    feats = load_feats(name)
    Xtr, ytr, _ = feats["parts"]["train"]
    pos = class_order(feats["classes"], seed)
    if test:
        Xe, ye = feats["parts"]["testcap"][:2]
    else:
        fit, vcap, _ = val_split(name, feats, seed)
        Xe, ye = Xtr[vcap], ytr[vcap]
        Xtr, ytr = Xtr[fit], ytr[fit]
    return Xtr, pos[ytr], Xe, pos[ye]


def class_order(classes, seed):
    from drlcli.benchmark import class_order as co

    order = co(list(classes), seed=seed, shuffle=True)
    pos = {c: i for i, c in enumerate(order)}
    return np.array([pos[c] for c in classes])  # old label -> position in order


# ------------------------------------------------------------------------------------ heads
def l2n(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True).clip(1e-12)


class NCM:
    """SimpleCIL: cosine (or negative euclidean) to class means. Stats: C x d means + counts."""

    def __init__(self, metric="cos"):
        self.metric = metric
        self.sums, self.n = {}, {}

    def add(self, X, y):
        for c in np.unique(y):
            self.sums[c] = X[y == c].sum(0)
            self.n[c] = (y == c).sum()

    def means(self):
        C = len(self.sums)
        return np.stack([self.sums[c] / self.n[c] for c in range(C)])

    def scores(self, X):
        mu = self.means()
        if self.metric == "cos":
            return l2n(X) @ l2n(mu).T
        return -((X[:, None, :] - mu[None]) ** 2).sum(-1)

    def storage(self, d, C):
        return C * d + C


class Gaussian:
    """LDA (shared covariance) or QDA/FeCAM (per-class covariance) with shrinkage.

    norm: none | l2 (per-sample L2 normalisation before everything, needs no statistics).
    shrink a: S <- (1-a) S + a * (tr S / d) I.   blend b (per-class only): S_c <- (1-b) S_c + b S_shared.
    logdet: add -1/2 log|S_c| (per-class). corr: FeCAM's normalisation of S to correlation scale.
    Stats: class sums/counts (C x d), shared within-class scatter (d x d) [LDA], per-class scatter (C x d x d) [QDA].
    """

    def __init__(self, kind="lda", norm="none", shrink=0.1, blend=0.0, logdet=False, corr=False, prior=0.0):
        self.kind, self.norm, self.shrink, self.blend, self.logdet, self.corr = kind, norm, shrink, blend, logdet, corr
        self.prior = prior  # qda: add prior * 2 log n_c (the class prior of the Gaussian posterior, scaled like -maha)
        self.sums, self.n, self.scat = {}, {}, {}
        self._cache = None

    def _t(self, X):
        return l2n(X) if self.norm == "l2" else X

    def add(self, X, y):
        X = self._t(X)
        for c in np.unique(y):
            Xc = X[y == c]
            mu = Xc.mean(0)
            self.sums[c], self.n[c] = Xc.sum(0), len(Xc)
            self.scat[c] = (Xc - mu).T @ (Xc - mu)  # within-class scatter of class c
        self._cache = None

    def _shr(self, S, a):
        d = S.shape[0]
        return (1 - a) * S + a * np.trace(S) / d * np.eye(d)

    def _prep(self):
        if self._cache is not None:
            return self._cache
        C = len(self.sums)
        mu = np.stack([self.sums[c] / self.n[c] for c in range(C)])
        N = sum(self.n.values())
        Sw = sum(self.scat.values()) / max(N - C, 1)
        if self.kind == "lda":
            S = self._shr(Sw, self.shrink)
            P = np.linalg.inv(S)
            W = mu @ P
            b = -0.5 * (W * mu).sum(1)
            self._cache = ("lda", W, b)
        else:
            precs, lds = [], []
            for c in range(C):
                Sc = self.scat[c] / max(self.n[c] - 1, 1)
                Sc = (1 - self.blend) * Sc + self.blend * Sw
                Sc = self._shr(Sc, self.shrink)
                if self.corr:
                    s = np.sqrt(np.diag(Sc))
                    Sc = Sc / np.outer(s, s)
                sign, ld = np.linalg.slogdet(Sc)
                precs.append(np.linalg.inv(Sc))
                lds.append(ld)
            self._cache = ("qda", mu, np.stack(precs), np.array(lds))
        return self._cache

    def scores(self, X):
        X = self._t(X)
        cache = self._prep()
        if cache[0] == "lda":
            return X @ cache[1].T + cache[2]
        _, mu, P, ld = cache
        out = np.empty((len(X), len(mu)))
        for c in range(len(mu)):
            D = X - mu[c]
            out[:, c] = -((D @ P[c]) * D).sum(1)
            if self.logdet:
                out[:, c] -= ld[c]
            if self.prior:
                out[:, c] += self.prior * 2 * np.log(self.n[c])
        return out

    def storage(self, d, C):
        return C * d + C + (d * d if self.kind == "lda" else C * d * d)


LAMBDAS = [10.0**e for e in range(-8, 9)]


class Ridge:
    """RanPAC-style: phi = act(std(x) @ R), R ~ N(0,1) d x M; W = (G + lam I)^-1 Q with G = sum phi phi^T,
    Q = sum phi y^T (= per-class sums of phi), accumulated over stages.

    lam rule 'split': every training image goes (seeded, per class 80/20) to statistic set A or B; G_B, Q_B kept
    beside G, Q; lam = argmin over LAMBDAS of the held-out MSE ||Phi_B W_A - Y_B||^2 written with statistics only
    (n_B - 2 tr(W_A^T Q_B) + tr(W_A^T G_B W_A)), W_A = (G - G_B + lam I)^-1 (Q - Q_B); final W from all stats.
    Search: local descent on the log grid from the previous stage's choice (full grid when search='full').
    lam rule 'stage': same but A/B = 80/20 of the current stage's images only (RanPAC's own code).
    lam rule float: fixed.
    std: none | l2 (per sample) | stage1 (per-dim standardisation with stage-1 statistics, then frozen).
    Stats: G (M x M) + Q (M x C) [+ G_B, Q_B for 'split'].
    """

    def __init__(self, M=3000, act="relu", lam="split", std="none", seed=0, search="local", dtype=torch.float64, bal=0, f32=0):
        self.f32 = f32  # 1: Cholesky solves in float32 (statistics still summed in float64)
        self.M, self.act, self.lam_rule, self.std, self.seed, self.search = M, act, lam, std, seed, search
        self.bal = bal  # 1: class-balanced ridge, every image of class c weighted 50 / n_c (n_c known when c arrives)
        self.dtype = dtype
        self.R = None
        self.G = self.GB = None
        self.Q = self.QB = None  # (M, C) as dict growing
        self.nB = 0
        self.lams = []
        self.W = None
        self.shift = None

    def _phi(self, X):
        if self.std == "l2":
            X = l2n(X)
        elif self.std == "stage1":
            X = (X - self.shift[0]) / self.shift[1]
        Z = torch.from_numpy(X).to(self.dtype) @ self.R
        if self.act == "relu":
            return torch.relu(Z)
        if self.act == "gelu":
            return torch.nn.functional.gelu(Z)
        if self.act == "tanh":
            return torch.tanh(Z)
        if self.act == "none":
            return Z
        raise ValueError(self.act)

    def add(self, X, y):
        d = X.shape[1]
        if self.R is None:
            g = torch.Generator().manual_seed(self.seed)
            if self.M == 0:  # no projection: ridge on the raw features
                self.R = torch.eye(d, dtype=self.dtype)
                self.M = d
            else:
                self.R = torch.randn(d, self.M, generator=g, dtype=torch.float32).to(self.dtype)
            self.G = torch.zeros(self.M, self.M, dtype=self.dtype)
            self.GB = torch.zeros_like(self.G)
            self.Q = torch.zeros(self.M, 0, dtype=self.dtype)
            self.QB = torch.zeros_like(self.Q)
            if self.std == "stage1":
                self.shift = (X.mean(0), X.std(0) + 1e-6)
        C_old = self.Q.shape[1]
        C_new = int(y.max()) + 1
        self.Q = torch.cat([self.Q, torch.zeros(self.M, C_new - C_old, dtype=self.dtype)], 1)
        self.QB = torch.cat([self.QB, torch.zeros(self.M, C_new - C_old, dtype=self.dtype)], 1)
        P = self._phi(X)
        Y = torch.zeros(len(y), C_new, dtype=self.dtype)
        Y[torch.arange(len(y)), torch.from_numpy(y)] = 1
        if self.bal:
            cnt = np.bincount(y, minlength=C_new).astype(float)
            sw = torch.from_numpy(50.0 / cnt[y]).to(self.dtype)[:, None]
        else:
            sw = torch.ones(len(y), 1, dtype=self.dtype)
        Pw = P * sw
        self.G += Pw.T @ P
        self.Q += Pw.T @ Y
        # held-out membership: per class, seeded, 20%
        rng = np.random.RandomState(self.seed + 7)
        inB = np.zeros(len(y), bool)
        for c in np.unique(y):
            idx = np.where(y == c)[0]
            k = max(1, int(round(0.2 * len(idx))))
            inB[rng.permutation(idx)[:k]] = True
        mB = torch.from_numpy(inB)
        if isinstance(self.lam_rule, float):
            lam = self.lam_rule
        elif self.lam_rule == "split":
            self.GB += Pw[mB].T @ P[mB]
            self.QB += Pw[mB].T @ Y[mB]
            self.nB += float(sw[mB].sum())
            lam = self._select(self.G - self.GB, self.Q - self.QB, self.GB, self.QB, self.nB)
        elif self.lam_rule == "stage":
            GA, QA = Pw[~mB].T @ P[~mB], Pw[~mB].T @ Y[~mB]
            GB, QB = Pw[mB].T @ P[mB], Pw[mB].T @ Y[mB]
            lam = self._select(GA, QA, GB, QB, float(sw[mB].sum()))
        else:
            raise ValueError(self.lam_rule)
        self.lams.append(lam)
        self.W = self._solve(self.G, self.Q, lam)

    def _solve(self, G, Q, lam):
        A = G + lam * torch.eye(G.shape[0], dtype=G.dtype)
        if self.f32:
            A, Q = A.float(), Q.float()
        L, info = torch.linalg.cholesky_ex(A)
        if int(info) != 0:
            return None
        return torch.cholesky_solve(Q, L).to(G.dtype)

    def _mse(self, GA, QA, GB, QB, nB, e):
        W = self._solve(GA, QA, 10.0**e)
        if W is None:
            return float("inf")
        return float(nB - 2 * (W * QB).sum() + (W * (GB @ W)).sum())

    def _select(self, GA, QA, GB, QB, nB):
        cache = {}

        def f(e):
            if e not in cache:
                cache[e] = self._mse(GA, QA, GB, QB, nB, e)
            return cache[e]

        if self.search == "full":
            best = min(range(-8, 9), key=f)
        else:
            st = getattr(self, "step", 1)  # grid step in decades (aug_eval.py --lamstep)
            e = round(math.log10(self.lams[-1]) / st) * st if self.lams else 3
            while True:
                cand = [x for x in (e - st, e, e + st) if -8 <= x <= 8]
                nxt = min(cand, key=f)
                if nxt == e:
                    break
                e = nxt
            best = e
        self.mse_curve = dict(sorted(cache.items()))
        return 10.0**best

    def scores(self, X):
        return (self._phi(X) @ self.W).numpy()

    def storage(self, d, C):
        extra = self.M * self.M + self.M * C if self.lam_rule == "split" else 0
        return d * 0 + self.M * self.M + self.M * C + extra  # R is regenerated from its seed


# ------------------------------------------------------------------------------------ protocol
def auroc(pos, neg):
    """P(score_known > score_unknown), ties 1/2."""
    allv = np.concatenate([pos, neg])
    ranks = allv.argsort().argsort().astype(float)
    # average ranks for ties
    order = np.sort(allv)
    _, inv, counts = np.unique(allv, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts
    ranks = first[inv] + (counts[inv] - 1) / 2.0
    rp = ranks[: len(pos)].sum()
    return (rp - len(pos) * (len(pos) - 1) / 2) / (len(pos) * len(neg))


def metrics(acc_groups, accs):
    """acc_groups[t][g]: accuracy on group g after stage t (g<=t). Forgetting per group g<T."""
    T = len(accs)
    forg = []
    for g in range(T - 1):
        hist = [acc_groups[t][g] for t in range(g, T)]
        forg.append(max(hist[:-1]) - hist[-1])
    return {"A": accs, "Abar": float(np.mean(accs)), "AT": float(accs[-1]),
            "forgetting": float(np.mean(forg)) if forg else 0.0, "forg_groups": forg}


def run_protocol(make_head, Xtr, ytr, evalsets, pos, inc=10, post=None, openset_stage=None):
    """make_head() -> head; ytr/eval labels are original class ids; pos maps them to order positions.
    evalsets: {name: (X, y)}. post(head, X_eval_seen, scores) -> {variant: scores} lets one head give several
    scorings (normalisations, combinations). Returns {variant: {evalset: metrics}} and open-set AUROCs."""
    C = len(pos)
    ytr_p, stages = pos[ytr], [list(range(s, min(s + inc, C))) for s in range(0, C, inc)]
    head = make_head()
    ev = {k: (X, pos[y]) for k, (X, y) in evalsets.items()}
    rec: dict = {}
    open_res: dict = {}
    for t, cls in enumerate(stages):
        m = np.isin(ytr_p, cls)
        head.add(Xtr[m], ytr_p[m])
        seen = cls[-1] + 1
        for k, (X, y) in ev.items():
            ms = y < seen
            variants = {"base": head.scores(X[ms])}
            if post is not None:
                variants = post(head, X[ms], variants["base"])
            group = np.minimum(y[ms] // inc, len(stages) - 1)
            for v, S in variants.items():
                pred = S[:, :seen].argmax(1)
                ok = pred == y[ms]
                r = rec.setdefault(v, {}).setdefault(k, {"accs": [], "groups": []})
                r["accs"].append(100.0 * ok.mean())
                r["groups"].append([100.0 * ok[group == g].mean() for g in range(t + 1)])
            if openset_stage is not None and t + 1 == openset_stage:
                variants_all = {"base": head.scores(X)}
                if post is not None:
                    variants_all = post(head, X, variants_all["base"])
                for v, S in variants_all.items():
                    mx = S[:, :seen].max(1)
                    open_res.setdefault(v, {})[k] = float(auroc(mx[ms], mx[~ms]))
    out = {}
    for v, per in rec.items():
        out[v] = {k: metrics(r["groups"], r["accs"]) for k, r in per.items()}
        for k in per:
            if v in open_res and k in open_res[v]:
                out[v][k]["auroc"] = open_res[v][k]
    return out, head
