"""Offline stage-by-stage simulation of heads over DRL subspaces (features from extract.py).

    python sim.py FEATS.npz [--eval val|test|val_bench] [--stages T] [--heads h1,h2,...] [--seed-rp 0]

Product constraint respected: after stage t, subspace j's statistics come only from training
images of classes learned at stages j..t (class-level sums: means, Gram matrices); an old class c
(stage i) has real statistics in subspaces 0..i only (computed when stage i was trained).
Prints one line per head: A_1..A_T, Ā, A_T (top-1 %, over eval images of the classes seen so far).
"""
import argparse
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, "/work/main")
from drlcli.prototypes import score as pkg_score  # noqa: E402
from drlcli.prototypes import synthesize

torch.set_default_dtype(torch.float64)


def load(path, eval_split, T):
    z = np.load(path)
    cs = torch.as_tensor(z["class_stage"])
    T = min(T or 99, int(z["run_stages"]), int(cs.max()))
    S = T + 1
    tr_x = torch.as_tensor(z["train_x"][:, :S]).double()
    tr_y = torch.as_tensor(z["train_y"])
    if eval_split == "val_bench":
        m = torch.as_tensor(z["val_bench"])
        ev_x = torch.as_tensor(z["val_x"][:, :S]).double()[m]
        ev_y = torch.as_tensor(z["val_y"])[m]
    else:
        ev_x = torch.as_tensor(z[f"{eval_split}_x"][:, :S]).double()
        ev_y = torch.as_tensor(z[f"{eval_split}_y"])
    keep_tr, keep_ev = cs[tr_y] <= T, cs[ev_y] <= T
    C = int((cs <= T).sum())
    return dict(
        tr_x=tr_x[keep_tr], tr_y=tr_y[keep_tr], ev_x=ev_x[keep_ev], ev_y=ev_y[keep_ev], cs=cs[:C], T=T, C=C, S=S
    )


def class_means(x, y, C):
    s = torch.zeros(C, *x.shape[1:])
    s.index_add_(0, y, x)
    n = torch.bincount(y, minlength=C).double()
    return s / n.clamp_min(1).view(-1, *([1] * (x.dim() - 1)))


def onehot(y, C):
    return F.one_hot(y, C).double()


class RP:
    """RanPAC-style random projection + ReLU."""

    def __init__(self, d, M, seed):
        g = torch.Generator().manual_seed(seed)
        self.W = torch.randn(d, M, generator=g, dtype=torch.float64)

    def __call__(self, x):
        return torch.relu(x @ self.W)


_EIG = {}


def ridge_solve(G, Q, lam):
    """(G + lam I)^-1 Q via a cached eigendecomposition of G (many lam for one G are cheap)."""
    key = (id(G), G.shape[0])
    if key not in _EIG:
        e, V = torch.linalg.eigh(G)
        _EIG[key] = (G, e.clamp_min(0), V)  # keep G alive so id() stays unique
    _, e, V = _EIG[key]
    return V @ ((V.T @ Q) / (e + lam)[:, None])


# ----------------------------------------------------------------------------- simulation


class Sim:
    def __init__(self, D, rp_dim=3000, seed_rp=0):
        self.D = D
        T, C, S = D["T"], D["C"], D["S"]
        d = D["tr_x"].shape[-1]
        self.means = class_means(D["tr_x"], D["tr_y"], C)  # (C, S, d): row c valid in subspaces 0..stage(c)
        self.rp0 = RP(d, rp_dim, seed_rp)
        self.rp01 = RP(2 * d, rp_dim, seed_rp + 1)
        # per-class sums (features transformed) accumulate per stage
        self.h0_tr = self.rp0(D["tr_x"][:, 0])
        self.h0_ev = self.rp0(D["ev_x"][:, 0])
        self.h01_tr = self.rp01(D["tr_x"][:, :2].flatten(1)) if S > 1 else None
        self.h01_ev = self.rp01(D["ev_x"][:, :2].flatten(1)) if S > 1 else None
        self.cache = {}

    # cumulative Gram matrices over classes of stages lo..t of a train-feature matrix
    def gram(self, key, H, lo, t):
        D = self.D
        k = (key, lo, t)
        if k in self.cache:
            return self.cache[k]
        st = D["cs"][D["tr_y"]]
        m = (st >= lo) & (st <= t)
        Hm, ym = H[m], D["tr_y"][m]
        G = Hm.T @ Hm
        Q = Hm.T @ onehot(ym, D["C"])
        self.cache[k] = (G, Q, m)
        return G, Q, m

    def eval_mask(self, t):
        return self.D["cs"][self.D["ev_y"]] <= t


def acc(scores, y):
    return 100.0 * (scores.argmax(1) == y).double().mean().item()


def run_head(sim, fn):
    D = sim.D
    accs = []
    for t in range(1, D["T"] + 1):
        m = sim.eval_mask(t)
        C_t = int((D["cs"] <= t).sum())
        sc = fn(sim, t, m, C_t)
        accs.append(acc(sc, D["ev_y"][m]))
    return accs


# ----------------------------------------------------------------------------- heads


def package_bank(sim, t, C_t):
    D = sim.D
    real = sim.means[:C_t, : t + 1].clone()
    cs = D["cs"][:C_t]
    for c in range(C_t):  # zero where not real (package stores zeros there)
        real[c, cs[c] + 1 :] = 0
    return synthesize(real, cs, tau=1.0, offset=1), cs


def h_package(beta, rho=0.1, rule="reweight"):
    def fn(sim, t, m, C_t):
        bank, cs = package_bank(sim, t, C_t)
        return pkg_score(sim.D["ev_x"][m, : t + 1], bank, cs, rule=rule, rho=rho, beta=beta, offset=1)

    return fn


def h_ncm0(sim, t, m, C_t):
    return F.normalize(sim.D["ev_x"][m, 0], dim=-1) @ F.normalize(sim.means[:C_t, 0], dim=-1).T


def ranpac_scores(sim, t, m, C_t, lam, which="0"):
    """Ridge on RP features of all classes seen: W = (G + lam I)^-1 Q with G = sum h h^T,
    Q = sum h y^T (what the product accumulates). Computed here in the mathematically identical
    dual form (N train images < M = 3000) for speed: scores = H_ev H^T (H H^T + lam I)^-1 Y."""
    D = sim.D
    H_tr, H_ev = (sim.h0_tr, sim.h0_ev) if which == "0" else (sim.h01_tr, sim.h01_ev)
    key = ("dual" + which, t)
    if key not in sim.cache:
        st = D["cs"][D["tr_y"]]
        msk = st <= t
        Hm = H_tr[msk]
        e, V = torch.linalg.eigh(Hm @ Hm.T)
        Y = onehot(D["tr_y"][msk], D["C"])
        sim.cache[key] = (e.clamp_min(0), V, V.T @ Y, (H_ev @ Hm.T) @ V)
    e, V, VtY, HevHV = sim.cache[key]
    return (HevHV[m] / (e + lam)[None, :]) @ VtY[:, :C_t]


def h_ranpac(lam, which="0"):
    return lambda sim, t, m, C_t: ranpac_scores(sim, t, m, C_t, lam, which)


def own_cos(sim, t, m, C_t, center=False):
    """cos(f_k(x), P_k(c)) for c of stage k (real prototypes only): (n, C_t)."""
    D = sim.D
    cs = D["cs"][:C_t]
    X = D["ev_x"][m]  # (n, S, d)
    out = torch.zeros(X.shape[0], C_t)
    for k in range(1, t + 1):
        idx = (cs == k).nonzero().squeeze(1)
        P = sim.means[idx, k]
        xk = X[:, k]
        if center:  # center by the mean of the classes that subspace k has real data for (stages k..t)
            mu = sim.means[(cs >= k).nonzero().squeeze(1), k].mean(0)
            P, xk = P - mu, xk - mu
        out[:, idx] = F.normalize(xk, dim=-1) @ F.normalize(P, dim=-1).T
    return out


def aug(x):
    """L2-normalised feature plus a constant 1 (bias) for the small per-subspace ridge heads."""
    x = F.normalize(x, dim=-1)
    return torch.cat([x, torch.ones(x.shape[0], 1)], 1)


def own_ridge(sim, t, m, C_t, lam, rp=None):
    """Per-subspace ridge head: subspace k fitted on classes of stages k..t (one-hot over those),
    score for class c of stage k = its column of head k."""
    D = sim.D
    cs = D["cs"][:C_t]
    X = D["ev_x"][m]
    out = torch.zeros(X.shape[0], C_t)
    for k in range(1, t + 1):
        key = f"sub{k}"
        if key not in sim.cache:
            sim.cache[key] = aug(D["tr_x"][:, k])
        H = sim.cache[key]
        G, Q, _ = sim.gram(key, H, k, t)
        idx = (cs == k).nonzero().squeeze(1)
        Wo = ridge_solve(G, Q[:, idx], lam)
        hx = aug(X[:, k])
        out[:, idx] = hx @ Wo
    return out


def own_ridge_syn(sim, t, m, C_t, lam, n_pseudo=20.0):
    """own_ridge, plus every OLD class o (stage < k) as n_pseudo pseudo-samples at its synthesised
    prototype P_k(o) (SPEC 2.3 synthesis; class-level, allowed) with target 0 on stage k's columns:
    the stage-k head learns to score old classes' (estimated) features low."""
    D = sim.D
    cs = D["cs"][:C_t]
    bank, _ = package_bank(sim, t, C_t)
    X = D["ev_x"][m]
    out = torch.zeros(X.shape[0], C_t)
    for k in range(1, t + 1):
        key = f"sub{k}"
        if key not in sim.cache:
            sim.cache[key] = aug(D["tr_x"][:, k])
        H = sim.cache[key]
        G, Q, _ = sim.gram(key, H, k, t)
        old = (cs < k).nonzero().squeeze(1)
        if old.numel():
            A = aug(bank[old, k])
            G = G + n_pseudo * A.T @ A  # targets of old classes on stage-k columns are 0: Q unchanged
        idx = (cs == k).nonzero().squeeze(1)
        Wo = torch.linalg.solve(G + lam * torch.eye(G.shape[0]), Q[:, idx])
        out[:, idx] = aug(X[:, k]) @ Wo
    return out


def h_ranpac_plus_own(lam, w, kind="cos", lam_own=None):
    def fn(sim, t, m, C_t):
        base = ranpac_scores(sim, t, m, C_t, lam)
        if kind == "cos":
            extra = own_cos(sim, t, m, C_t)
        elif kind == "ccos":
            extra = own_cos(sim, t, m, C_t, center=True)
        elif kind == "ridgesyn":
            extra = own_ridge_syn(sim, t, m, C_t, lam_own)
        else:
            extra = own_ridge(sim, t, m, C_t, lam_own)
        return base + w * extra

    return fn


def h_route(lam, kind="cos", lam_own=None, w0=0.0):
    """Stage by the PTM ridge head (max class score per stage); class within that stage by
    own-subspace score (+ w0 * PTM ridge score)."""

    def fn(sim, t, m, C_t):
        D = sim.D
        cs = D["cs"][:C_t]
        base = ranpac_scores(sim, t, m, C_t, lam)
        best = base.argmax(1)
        stage = cs[best]  # routed stage
        if kind == "cos":
            own = own_cos(sim, t, m, C_t)
        else:
            own = own_ridge(sim, t, m, C_t, lam_own)
        sc = own + w0 * base
        mask = cs[None, :] == stage[:, None]
        return torch.where(mask, sc, torch.full_like(sc, -1e9))

    return fn


def shared_cov_scores(sim, t, m, C_t, k_sub, shrink, cls_idx, lo, l2=False):
    if l2:
        return _shared_cov(sim, t, m, k_sub, shrink, cls_idx, lo, F.normalize(sim.D["tr_x"][:, k_sub], dim=-1),
                           F.normalize(sim.D["ev_x"][m, k_sub], dim=-1))
    return _shared_cov(sim, t, m, k_sub, shrink, cls_idx, lo, sim.D["tr_x"][:, k_sub], sim.D["ev_x"][m, k_sub])


def _shared_cov(sim, t, m, k_sub, shrink, cls_idx, lo, XTR, XEV):
    """LDA / Mahalanobis with a shared shrinkage covariance in subspace k_sub, estimated from train
    images of classes of stages lo..t (within-class scatter = class-level statistics)."""
    D = sim.D
    st = D["cs"][D["tr_y"]]
    msk = (st >= lo) & (st <= t)
    x = XTR[msk]
    y = D["tr_y"][msk]
    mu = class_means(XTR, D["tr_y"], D["C"])
    R = x - mu[y]
    Sw = R.T @ R / max(1, len(y) - len(torch.unique(y)))
    d = Sw.shape[0]
    Sw = (1 - shrink) * Sw + shrink * torch.trace(Sw) / d * torch.eye(d)
    P = torch.linalg.inv(Sw)
    M = mu[cls_idx]
    X = XEV
    W = M @ P  # (c, d)
    b = -0.5 * (W * M).sum(1)
    return X @ W.T + b


def h_lda0(shrink, l2=False):
    def fn(sim, t, m, C_t):
        return shared_cov_scores(sim, t, m, C_t, 0, shrink, torch.arange(C_t), 1, l2)

    return fn


def h_lda0_plus_lda_own(shrink, w, l2=True):
    """PTM LDA (all classes) + w * own-subspace LDA (subspace k: classes of stages k..t)."""

    def fn(sim, t, m, C_t):
        cs = sim.D["cs"][:C_t]
        base = shared_cov_scores(sim, t, m, C_t, 0, shrink, torch.arange(C_t), 1, l2)
        extra = torch.zeros_like(base)
        for k in range(1, t + 1):
            idx = (cs == k).nonzero().squeeze(1)
            extra[:, idx] = shared_cov_scores(sim, t, m, C_t, k, shrink, idx, k, l2)
        return base + w * extra

    return fn


def h_lda0_plus_own(shrink, w, kind, l2=True, lam_own=1.0):
    def fn(sim, t, m, C_t):
        base = shared_cov_scores(sim, t, m, C_t, 0, shrink, torch.arange(C_t), 1, l2)
        if kind == "ccos":
            extra = own_cos(sim, t, m, C_t, center=True)
        elif kind == "ridgesyn":
            extra = own_ridge_syn(sim, t, m, C_t, lam_own)
        else:
            extra = own_cos(sim, t, m, C_t)
        return base + w * extra

    return fn


def h_ranpac_plus_lda_own(lam, w, shrink):
    def fn(sim, t, m, C_t):
        D = sim.D
        cs = D["cs"][:C_t]
        base = ranpac_scores(sim, t, m, C_t, lam)
        extra = torch.zeros_like(base)
        for k in range(1, t + 1):
            idx = (cs == k).nonzero().squeeze(1)
            s = shared_cov_scores(sim, t, m, C_t, k, shrink, idx, k)
            extra[:, idx] = s
        return base + w * extra

    return fn


def h_oracle(kind, lam=None):
    """DIAGNOSTIC (uses the true stage): within-stage accuracy given the task id."""

    def fn(sim, t, m, C_t):
        D = sim.D
        cs = D["cs"][:C_t]
        true_stage = D["cs"][D["ev_y"][m]]
        if kind == "ranpac0":
            sc = ranpac_scores(sim, t, m, C_t, lam)
        elif kind == "ncm0":
            sc = h_ncm0(sim, t, m, C_t)
        elif kind == "owncos":
            sc = own_cos(sim, t, m, C_t)
        else:
            sc = own_ridge(sim, t, m, C_t, 1.0)
        return torch.where(cs[None, :] == true_stage[:, None], sc, torch.full_like(sc, -1e9))

    return fn


def h_stage_only(lam):
    """DIAGNOSTIC: scores that are right iff the PTM ridge head picks a class of the true stage."""

    def fn(sim, t, m, C_t):
        D = sim.D
        cs = D["cs"][:C_t]
        base = ranpac_scores(sim, t, m, C_t, lam)
        pred_stage = cs[base.argmax(1)]
        y = D["ev_y"][m]
        out = torch.zeros_like(base)
        hit = pred_stage == D["cs"][y]
        out[torch.arange(len(y)), torch.where(hit, y, (y + 1) % C_t)] = 1.0
        return out

    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("feats")
    ap.add_argument("--eval", default="val")
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--heads", default="basic")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    D = load(a.feats, a.eval, a.stages)
    sim = Sim(D)
    sanity(sim, np.load(a.feats))
    print(f"# {a.feats} eval={a.eval} T={D['T']} C={D['C']} train={len(D['tr_y'])} eval={len(D['ev_y'])}")
    heads = HEADSETS[a.heads]()
    rows = {}
    for name, fn in heads:
        accs = run_head(sim, fn)
        rows[name] = accs
        print(f"{name:42s} Abar {np.mean(accs):6.2f}  A_T {accs[-1]:6.2f}  | " + " ".join(f"{x:5.1f}" for x in accs), flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


BEST_LAMS = [float(x) for x in __import__("os").environ.get("BEST_LAMS", "1000").split(",")]
WS = [0.1, 0.3, 1.0, 3.0]
LAMS = [1e3, 1e4, 1e5, 1e6, 1e7]

def sanity(sim, z):
    D = sim.D
    real = torch.as_tensor(z["run_real_prototypes"]).double()
    T = D["T"]
    err = 0.0
    for c in range(D["C"]):
        k = int(D["cs"][c])
        err = max(err, (real[c, : k + 1] - sim.means[c, : k + 1]).abs().max().item())
    print(f"# sanity: max |recomputed class means - run's stored prototypes| = {err:.2e}")


HEADSETS = {
    "all": lambda: [
        ("package beta=1", h_package(1.0)),
        ("package beta=3", h_package(3.0)),
        ("package beta=3 rho=0", h_package(3.0, rho=0.0)),
        ("ncm f0 (simplecil)", h_ncm0),
    ]
    + [(f"lda f0 shrink={s:g}", h_lda0(s)) for s in (0.1, 0.3)]
    + [(f"lda f0 l2 shrink={s:g}", h_lda0(s, True)) for s in (0.1, 0.3)]
    + [(f"lda f0 l2 0.1 + {w:g}*ownLDA l2", h_lda0_plus_lda_own(0.1, w)) for w in (0.1, 0.3, 1.0)]
    + [(f"lda f0 l2 0.1 + {w:g}*{k}", h_lda0_plus_own(0.1, w, k)) for k in ("cos", "ccos", "ridgesyn") for w in (3.0, 10.0, 30.0, 100.0)]
    + [(f"ranpac f0 lam={l:g}", h_ranpac(l)) for l in LAMS]
    + [(f"ranpac [f0,f1] lam={l:g}", h_ranpac(l, "01")) for l in LAMS]
    + [(f"ranpac f0 lam={l:g} + {w:g}*owncos", h_ranpac_plus_own(l, w, "cos")) for l in BEST_LAMS for w in WS]
    + [(f"ranpac f0 lam={l:g} + {w:g}*ownccos", h_ranpac_plus_own(l, w, "ccos")) for l in BEST_LAMS for w in WS]
    + [(f"ranpac f0 lam={l:g} + {w:g}*ownridge(l{lo:g})", h_ranpac_plus_own(l, w, "ridge", lo)) for l in BEST_LAMS for w in WS for lo in (1.0, 10.0)]
    + [(f"ranpac f0 lam={l:g} + {w:g}*ownridgesyn(l1)", h_ranpac_plus_own(l, w, "ridgesyn", 1.0)) for l in BEST_LAMS for w in WS]
    + [(f"route lam={l:g} owncos", h_route(l, "cos")) for l in BEST_LAMS]
    + [(f"route lam={l:g} owncos + ranpac", h_route(l, "cos", w0=1.0)) for l in BEST_LAMS]
    + [(f"route lam={l:g} ownridge(l1)", h_route(l, "ridge", 1.0)) for l in BEST_LAMS]
    + [(f"ranpac f0 lam={l:g} + {w:g}*ownLDA(0.3)", h_ranpac_plus_lda_own(l, w, 0.3)) for l in BEST_LAMS for w in (0.001, 0.003, 0.01, 0.03)],
    "diag": lambda: [
        (f"ORACLE stage: ranpac f0 lam={l:g}", h_oracle("ranpac0", l)) for l in BEST_LAMS
    ]
    + [("ORACLE stage: ncm f0", h_oracle("ncm0")), ("ORACLE stage: own cos", h_oracle("owncos")),
       ("ORACLE stage: own ridge(l1)", h_oracle("ownridge"))]
    + [(f"STAGE-ID acc of ranpac f0 lam={l:g}", h_stage_only(l)) for l in BEST_LAMS],
    "final": lambda: [
        ("package beta=1", h_package(1.0)),
        ("package beta=3", h_package(3.0)),
        ("ncm f0 (simplecil)", h_ncm0),
        ("lda f0 l2 shrink=0.1", h_lda0(0.1, True)),
        ("lda f0 l2 0.1 + 3*ridgesyn", h_lda0_plus_own(0.1, 3.0, "ridgesyn")),
    ]
    + [(f"ranpac f0 lam={l:g}", h_ranpac(l)) for l in (1e5, 1e6)]
    + [(f"ranpac [f0,f1] lam={l:g}", h_ranpac(l, "01")) for l in (1e5, 1e6)]
    + [(f"ranpac f0 lam={l:g} + 0.3*owncos", h_ranpac_plus_own(l, 0.3, "cos")) for l in (1e5, 1e6)]
    + [(f"ranpac f0 lam={l:g} + 0.3*ownridgesyn(l1)", h_ranpac_plus_own(l, 0.3, "ridgesyn", 1.0)) for l in (1e5, 1e6)],
    "basic": lambda: [
        ("package beta=1", h_package(1.0)),
        ("package beta=3", h_package(3.0)),
        ("ncm f0 (simplecil)", h_ncm0),
    ]
    + [(f"ranpac f0 lam={l:g}", h_ranpac(l)) for l in LAMS]
    + [(f"ranpac [f0,f1] lam={l:g}", h_ranpac(l, "01")) for l in LAMS],
}

if __name__ == "__main__":
    main()
