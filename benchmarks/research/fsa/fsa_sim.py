"""Replay B0 Inc10 with ridge heads on features extracted from a 1-stage DRL run (extract.py of
drl_subspaces with --max-train 9999): f_0 alone against [f_0, f_1], f_1 being stage 1's subspace
trained on the first 10 classes (RanPAC's first-stage adaptation, done by DRL's own stage 1).

    python fsa_sim.py FEATS_trval.npz [--head 'ridge:M=3000'] ...
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ptm_heads"))
from ptmheads import run_protocol  # noqa: E402
from search import WithCos, parse, post  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("feats")
ap.add_argument("--head", action="append", default=None)
ap.add_argument("--inputs", default="f0,f01,f1")
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
torch.set_num_threads(a.threads)
z = np.load(a.feats)
tr, ytr, va, yva = z["train_x"].astype(np.float64), z["train_y"], z["val_x"].astype(np.float64), z["val_y"]
vb = z["val_bench"]
C = int(ytr.max()) + 1
pos = np.arange(C)
sel = {"f0": lambda x: x[:, 0], "f1": lambda x: x[:, 1], "f01": lambda x: x[:, :2].reshape(len(x), -1)}
for spec in a.head or ["ridge:M=3000"]:
    for name in a.inputs.split(","):
        f = sel[name]
        res, _ = run_protocol(lambda: WithCos(parse(spec)()), f(tr), ytr, {"valcap": (f(va)[vb], yva[vb]), "valfull": (f(va), yva)}, pos, post=post)
        msg = " | ".join(
            f"{v} " + " ".join(f"{k}:{r['Abar']:.2f}/{r['AT']:.2f}/F{r['forgetting']:.1f}" for k, r in res[v].items())
            for v in ("raw", "cosz+0.5", "cosz+1", "cosz+2")
        )
        print(f"{a.feats} {spec} {name}: {msg}", flush=True)
