"""Ridge head with within-stage feature mixes as negatives (all-zero targets): does it lift open-set
AUROC without costing accuracy? Validation split, 90 known classes. python mixneg.py caltech|sketch [--test]"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ptm_heads"))
from ptmheads import auroc, l2n, ordered_split  # noqa: E402


def main():
    name = sys.argv[1]
    test = "--test" in sys.argv
    Xtr, yp, Xe, ye = ordered_split(name, test)
    K, M = 90, 3000
    R = torch.randn(192, M, generator=torch.Generator().manual_seed(0)).double()
    phi = lambda X: torch.relu(torch.from_numpy(X) @ R)  # noqa: E731
    rng = np.random.RandomState(0)
    Pe = phi(Xe)
    known = ye < K
    for wmix in (0.0, 0.1, 0.3, 1.0):
        for nmix in (1,) if wmix else (0,):
            G = torch.zeros(M, M, dtype=torch.float64)
            Q = torch.zeros(M, K, dtype=torch.float64)
            for s in range(9):
                m = (yp >= 10 * s) & (yp < 10 * s + 10)
                X, y = Xtr[m], yp[m]
                P = phi(X)
                G += P.T @ P
                Q[:, 10 * s:10 * s + 10] += P.T @ torch.nn.functional.one_hot(torch.from_numpy(y - 10 * s), 10).double()
                if wmix:
                    n = nmix * len(X)
                    i, j = rng.randint(len(X), size=n), rng.randint(len(X), size=n)
                    keep = y[i] != y[j]
                    a = rng.uniform(0.3, 0.7, size=(n, 1))
                    Xm = a * X[i] + (1 - a) * X[j]
                    Xm = Xm[keep]
                    Pm = phi(Xm)
                    G += wmix * Pm.T @ Pm
            for lam in (1e3, 1e4, 1e5):
                W = torch.linalg.solve(G + lam * torch.eye(M, dtype=torch.float64), Q)
                S = (Pe @ W).numpy()
                acc = (S[known].argmax(1) == ye[known]).mean() * 100
                mx = S.max(1)
                T = 0.1
                en = S.max(1) + T * np.log(np.exp((S - S.max(1, keepdims=True)) / T).sum(1))
                print(f"{name} wmix={wmix} lam={lam:g} acc={acc:.2f} auroc_max={auroc(mx[known], mx[~known]):.4f} "
                      f"auroc_energy={auroc(en[known], en[~known]):.4f}", flush=True)


if __name__ == "__main__":
    main()
