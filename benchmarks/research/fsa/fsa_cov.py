"""First-stage adaptation with the default head: replay B0 Inc10 on features extracted from a 1-stage
DRL run (drl_subspaces/extract.py --max-train 9999 --max-val 9999 --skip-test), scoring
z(ridge on R_IN) + 4 z(FeCAM-style class covariances on Q_IN, L2-normalised, shrink 0.3, blend 0.8),
R_IN / Q_IN each f0, f1 (stage 1's subspace, trained on the first 10 classes) or f01 ([f0, f1]).

    python fsa_cov.py FEATS_trval.npz [--pairs f0:f0,f01:f0,f1:f1,f01:f01]
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ptm_heads"))
from ptmheads import Gaussian, Ridge, run_protocol  # noqa: E402

SEL = {"f0": lambda x: x[:, 0], "f1": lambda x: x[:, 1], "f01": lambda x: x[:, :2].reshape(len(x), -1)}


def z(S):
    return (S - S.mean(1, keepdims=True)) / S.std(1, keepdims=True).clip(1e-12)


class Both:
    def __init__(self, rin, qin):
        self.rin, self.qin = SEL[rin], SEL[qin]
        self.ridge = Ridge(M=3000)
        self.qda = Gaussian(kind="qda", norm="l2", shrink=0.3, blend=0.8)

    def add(self, X, y):
        self.ridge.add(self.rin(X), y)
        self.qda.add(self.qin(X), y)

    def scores(self, X):
        return self.ridge.scores(self.rin(X))


def post(head, X, S):
    Q = head.qda.scores(head.qin(X))[:, : S.shape[1]]
    S = S[:, : Q.shape[1]]
    return {"ridge": S, "w4": z(S) + 4 * z(Q)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("feats")
    ap.add_argument("--pairs", default="f0:f0,f01:f0,f1:f1,f01:f01")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    f = np.load(a.feats)
    tr, ytr, va, yva, vb = f["train_x"].astype(np.float64), f["train_y"], f["val_x"].astype(np.float64), f["val_y"], f["val_bench"]
    pos = np.arange(int(ytr.max()) + 1)
    for pair in a.pairs.split(","):
        rin, qin = pair.split(":")
        res, _ = run_protocol(lambda: Both(rin, qin), tr, ytr, {"valcap": (va[vb], yva[vb]), "valfull": (va, yva)}, pos, post=post)
        msg = " | ".join(f"{v} " + " ".join(f"{k}:{r['Abar']:.2f}/{r['AT']:.2f}/F{r['forgetting']:.1f}" for k, r in res[v].items()) for v in ("ridge", "w4"))
        print(f"{Path(a.feats).name} ridge={rin} cov={qin}: {msg}", flush=True)


if __name__ == "__main__":
    main()
