"""Cosine in the ridge head's random-feature space (class means of phi = Q's columns / counts) as an
open-set score, against the cosine on f_0. AUROC only. python phicos.py caltech|sketch [--test]"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ptm_heads"))
from ptmheads import auroc, l2n, ordered_split  # noqa: E402


def main():
    name, test = sys.argv[1], "--test" in sys.argv
    Xtr, yp, Xe, ye = ordered_split(name, test)
    K = 90
    known = ye < K
    for M in (3000,):
        R = torch.randn(192, M, generator=torch.Generator().manual_seed(0)).double().numpy()
        for centre in (False, True):
            phi = lambda X: np.maximum(X @ R, 0)  # noqa: E731
            P, Pe = phi(Xtr[yp < K]), phi(Xe)
            y = yp[yp < K]
            if centre:
                m = P.mean(0)
                P, Pe = P - m, Pe - m
            mu = np.stack([P[y == c].mean(0) for c in range(K)])
            s = (l2n(Pe) @ l2n(mu).T).max(1)
            print(f"{name} {'test' if test else 'val'} phicos M={M} centred={centre} auroc={auroc(s[known], s[~known]):.4f}")
    mu0 = np.stack([Xtr[yp == c].mean(0) for c in range(K)])
    for centre in (False, True):
        X0, E0 = Xtr[yp < K], Xe
        if centre:
            m = X0.mean(0)
            mu, E = mu0 - m, E0 - m
        else:
            mu, E = mu0, E0
        s = (l2n(E) @ l2n(mu).T).max(1)
        print(f"{name} {'test' if test else 'val'} f0cos centred={centre} auroc={auroc(s[known], s[~known]):.4f}")


if __name__ == "__main__":
    main()
