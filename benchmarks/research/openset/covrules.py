"""Open-set AUROC of class-covariance rules (issue 19, after the default head gained FeCAM-style
class covariances). Issue's protocol: B0 Inc10 seed 1993, the first 9 stages (90 classes) known,
the last 11 classes unknown; statistics of the final state (all known classes' fit images).

    python covrules.py caltech|sketch [--val]
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ptm_heads"))
from ptmheads import auroc, l2n, ordered_split  # noqa: E402

K = 90


def shrink(S, a):
    d = S.shape[0]
    return (1 - a) * S + a * np.trace(S) / d * np.eye(d)


def maha_all(X, mu, precs):
    out = np.empty((len(X), len(mu)))
    for c, P in enumerate(precs):
        D = X - mu[c]
        out[:, c] = ((D @ P) * D).sum(1)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--val", action="store_true")
    a = ap.parse_args()
    Xtr, ytr, Xe, ye = ordered_split(a.name, test=not a.val)
    m = ytr < K
    Xtr, ytr = Xtr[m], ytr[m]
    known = ye < K
    res = {}
    for norm in ("l2", "raw"):
        F = l2n(Xtr) if norm == "l2" else Xtr
        E = l2n(Xe) if norm == "l2" else Xe
        mu = np.stack([F[ytr == c].mean(0) for c in range(K)])
        Sc = [np.cov(F[ytr == c].T) for c in range(K)]
        n = np.array([(ytr == c).sum() for c in range(K)])
        Sp = sum((n[c] - 1) * Sc[c] for c in range(K)) / (n.sum() - K)
        gmu = F.mean(0)
        St = np.cov(F.T)
        cos = l2n(E) @ l2n(mu).T
        if norm == "l2":
            res["maxcos"] = cos.max(1)
        for b in (0.5, 0.8, 1.0):
            for sh in (0.1, 0.3, 0.5):
                precs = [np.linalg.inv(shrink((1 - b) * Sc[c] + b * Sp, sh)) for c in range(K)]
                D = maha_all(E, mu, precs)
                d0 = ((E - gmu) @ np.linalg.inv(shrink(St, sh)) * (E - gmu)).sum(1)
                res[f"{norm} -minmaha b{b} a{sh}"] = -D.min(1)
                res[f"{norm} rmd b{b} a{sh}"] = -(D - d0[:, None]).min(1)
                if norm == "l2":
                    # combination with the cosine, each standardised by its spread over the fit images
                    Dtr = maha_all(F[::3], mu, precs).min(1)
                    ctr = (l2n(F[::3]) @ l2n(mu).T).max(1)
                    z = (cos.max(1) - ctr.mean()) / ctr.std() - (D.min(1) - Dtr.mean()) / Dtr.std()
                    res[f"cos+maha b{b} a{sh}"] = z
    for r, v in res.items():
        print(f"{a.name:7s} {'val' if a.val else 'test'} {r:28s} auroc={auroc(v[known], v[~known]):.4f}")


if __name__ == "__main__":
    main()
