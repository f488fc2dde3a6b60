"""The product's open-set decision with two scores, replayed on cached f_0 (issue 19): the maximum cosine
to the class prototypes (the rule shipped so far) and the relative Mahalanobis distance (Ren et al. 2021)
on x = f_0 / |f_0| with a pooled within-class covariance and a background Gaussian of all known images,
both shrunk by 0.5 towards their mean variance.

Statistics are class-level only: per class the mean of x and the image count, per stage the summed
within-class scatter of x. At stage s's commit, 20 % of each of its classes' images (seeded) are held
out, the statistics are recomputed without them, and the stage's threshold is the 5 % quantile of the
held-out images' best score over the stage's classes. The model answers with one threshold, the mean
of its classes' stage thresholds (``openset.open_set_bias``). Test: B0 Inc10, the first 9 stages
(90 classes) known, the 11 classes of stages 10-11 unknown.

    python rmd_product.py caltech|sketch [--val] [--seeds 1993,1994,1995] [--shrink 0.5] [--balanced]
        [--decision mean|newest|median|seen|oracle|shift] [--probe 7 [--weight 2]] [--folds 5]   # --probe: NAME_ml

Decisions (the threshold of the model; all but ``oracle`` and ``shift`` are class-level statistics only):
``mean`` of the stage thresholds, each set on the best score over the stage's classes (the product
until the calibration round); ``seen``: the same, the best score over every class learned at the
stage's commit (the product since); ``newest``/``median`` stage threshold; ``oracle``: every stage's
held-out images re-scored against the final statistics without them (needs their features: not
shippable, the reference); ``shift``: each stage threshold moved by the change of its held-out
images' mean own-class score. ``--balanced``: each class weighs the same in the quantile (the
product since the calibration round, rmd only).
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ptm_heads"))
from ptmheads import auroc, l2n, ordered_split  # noqa: E402

K, INC = 90, 10


def shrink(S, a):
    d = S.shape[0]
    return (1 - a) * S + a * np.trace(S) / d * np.eye(d)


class Stats:
    def __init__(self, d):
        self.means, self.counts, self.scatter = np.zeros((0, d)), np.zeros(0), np.zeros((d, d))

    def add(self, X, y, classes):
        means = np.stack([X[y == c].mean(0) for c in classes])
        counts = np.array([(y == c).sum() for c in classes], float)
        scat = sum((X[y == c] - m).T @ (X[y == c] - m) for c, m in zip(classes, means))
        out = Stats(X.shape[1])
        out.means = np.concatenate([self.means, means])
        out.counts = np.concatenate([self.counts, counts])
        out.scatter = self.scatter + scat
        return out

    def rmd(self, E, a, classes=None):
        """-(D_c(x) - D_0(x)) (N, C) for the given class indices (all when None)."""
        n, N, C = self.counts, self.counts.sum(), len(self.counts)
        Sw = self.scatter / max(N - C, 1)
        mu0 = (n[:, None] * self.means).sum(0) / N
        B = self.means - mu0
        St = (self.scatter + (B.T * n) @ B) / (N - 1)
        Pw, Pt = np.linalg.inv(shrink(Sw, a)), np.linalg.inv(shrink(St, a))
        mu = self.means if classes is None else self.means[classes]
        EP = E @ Pw
        D = (EP * E).sum(1)[:, None] - 2 * EP @ mu.T + ((mu @ Pw) * mu).sum(1)[None]
        D0 = ((E - mu0) @ Pt * (E - mu0)).sum(1)
        return -(D - D0[:, None])

    def cos(self, E, classes=None):
        mu = self.means if classes is None else self.means[classes]
        return l2n(E) @ l2n(mu).T


def quantile(scores, y, rate, balanced):
    """The lower ``rate`` quantile of ``scores``; ``balanced`` weighs each image by 1 / its class's count."""
    if not balanced:
        return float(np.quantile(scores, rate, method="lower"))
    _, inv, cnt = np.unique(y, return_inverse=True, return_counts=True)
    w = 1.0 / cnt[inv]
    order = np.argsort(scores, kind="stable")
    cum = np.cumsum(w[order])
    return float(scores[order][min(np.searchsorted(cum, rate * cum[-1] * (1 - 1e-9)), len(scores) - 1)])  # as openset.balanced_quantile


def own_mean(st, X, y, a):
    """Mean over images of their own class's relative Mahalanobis score: a class-level statistic
    (a trace against the images' scatter plus their class means), computed here from the features."""
    sc = st.rmd(X, a)
    return float(sc[np.arange(len(y)), y].mean())


# the one threshold the model answers with, from its classes' stage thresholds (the product: mean)
DECISIONS = {"mean": np.mean, "newest": lambda t: t[-1], "median": np.median, "oracle": np.mean, "shift": np.mean, "seen": np.mean}


def rmd_features(X, name, probe, weight):
    """f_0 (extract.py's and extract_grid.py's first columns), or with ``probe`` (NAME_ml features:
    block b's class token in columns [384 b, 384 b + 192), f_0 = block 11's) the product's
    ``openset.rmd_input`` [f_0/|f_0|, w t/|t|], normalised as a whole as its moments do."""
    if probe is None:
        return l2n(X[:, :192])
    assert name.endswith("_ml"), "--probe reads extract_ml.py's features"
    return l2n(np.concatenate([l2n(X[:, 384 * 11:384 * 11 + 192]), weight * l2n(X[:, 384 * probe:384 * probe + 192])], 1))


def run(name, val, seed, a, rate=0.05, decision="mean", balanced=False, probe=None, weight=2.0, folds=1):
    Xtr, ytr, Xe, ye = ordered_split(name, test=not val, seed=seed)
    Xtr, Xe = rmd_features(Xtr, name, probe, weight), rmd_features(Xe, name, probe, weight)
    st = Stats(Xtr.shape[1])
    thr = {"maxcos": [], "rmd": []}
    held, commit_mean, rest = [], [], Stats(Xtr.shape[1])
    for s in range(K // INC):
        cls = np.arange(s * INC, (s + 1) * INC)
        m = np.isin(ytr, cls)
        X, y = Xtr[m], ytr[m]
        rng = np.random.RandomState(1000 * seed + s)
        hold = np.zeros(len(y), bool)
        for c in cls:
            idx = np.where(y == c)[0]
            hold[rng.permutation(idx)[: min(max(1, round(0.2 * len(idx))), len(idx) - 1)]] = True
        cal = st.add(X[~hold], y[~hold], cls)
        local = None if decision == "seen" else np.arange(s * INC, (s + 1) * INC)
        if folds > 1:  # cross-fitting: every image held out once, by one of ``folds`` folds per class
            fold = np.zeros(len(y), int)
            for c in cls:
                idx = np.where(y == c)[0]
                fold[rng.permutation(idx)] = np.arange(len(idx)) % folds
            scored = {"maxcos": [], "rmd": []}
            for k in range(folds):
                out = fold == k
                calk = st.add(X[~out], y[~out], cls)
                scored["maxcos"].append(calk.cos(X[out], local).max(1))
                scored["rmd"].append(calk.rmd(X[out], a, local).max(1))
            order = np.concatenate([np.where(fold == k)[0] for k in range(folds)])
            for rule in scored:
                thr[rule] += [quantile(np.concatenate(scored[rule]), y[order], rate, balanced)] * INC
        else:
            for rule, sc in (("maxcos", cal.cos(X[hold], local)), ("rmd", cal.rmd(X[hold], a, local))):
                thr[rule] += [quantile(sc.max(1), y[hold], rate, balanced)] * INC
        st = st.add(X, y, cls)
        held.append((X[hold], y[hold]))
        rest = rest.add(X[~hold], y[~hold], cls)
        commit_mean.append(own_mean(st, X[hold], y[hold], a))
    if decision == "oracle":  # every held-out image re-scored against the final statistics without them
        Xh, yh = np.concatenate([h[0] for h in held]), np.concatenate([h[1] for h in held])
        thr["rmd"] = [quantile(rest.rmd(Xh, a).max(1), yh, rate, balanced)]
    elif decision == "shift":  # each stage threshold moved by its held-out images' mean own-class score
        thr["rmd"] = [t + own_mean(st, *held[i // INC], a) - commit_mean[i // INC] for i, t in enumerate(thr["rmd"])]
    known = ye < K
    out = {}
    for rule, sc in (("maxcos", st.cos(Xe)), ("rmd", st.rmd(Xe, a))):
        k = sc.max(1) - DECISIONS[decision](thr[rule])
        pred = sc.argmax(1)  # the rule's own best class (accuracy below is the ridge-free top-1 of it)
        acc = k >= 0
        out[rule] = {
            "auroc": auroc(k[known], k[~known]),
            "known_rejected": 100 * float((~acc[known]).mean()),
            "unknown_accepted": 100 * float(acc[~known].mean()),
            "top1": 100 * float((pred[known] == ye[known]).mean()),
        }
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--val", action="store_true")
    ap.add_argument("--seeds", default="1993,1994,1995")
    ap.add_argument("--shrink", type=float, default=0.5)
    ap.add_argument("--rate", type=float, default=0.05)
    ap.add_argument("--decision", choices=list(DECISIONS), default="mean")
    ap.add_argument("--balanced", action="store_true", help="class-balanced quantile (each class weighs the same)")
    ap.add_argument("--probe", type=int, default=None, help="block whose class token joins f_0 (NAME_ml features)")
    ap.add_argument("--weight", type=float, default=2.0, help="the probe token's weight")
    ap.add_argument("--folds", type=int, default=1, help="cross-fitting: every image held out once (1: one 20 %% split)")
    a = ap.parse_args()
    rows = {}
    for seed in (int(s) for s in a.seeds.split(",")):
        for rule, m in run(a.name, a.val, seed, a.shrink, a.rate, a.decision, a.balanced, a.probe, a.weight, a.folds).items():
            rows.setdefault(rule, []).append(m)
            print(f"{a.name} {'val' if a.val else 'test'} {seed} {rule:6s} " + " ".join(f"{k}={v:.4f}" for k, v in m.items()), flush=True)
    for rule, ms in rows.items():
        print(f"{a.name} {'val' if a.val else 'test'} mean {rule:6s} "
              + " ".join(f"{k}={np.mean([m[k] for m in ms]):.4f}" for k in ms[0]))


if __name__ == "__main__":
    main()
