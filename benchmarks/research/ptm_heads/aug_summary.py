"""Mean ± std over seeds of aug_eval.py results: python aug_summary.py DATA SPLIT [EVALSET]"""
import json
import sys
from collections import defaultdict

import numpy as np
from ptmheads import HERE

data, split = sys.argv[1], sys.argv[2]
only = sys.argv[3] if len(sys.argv) > 3 else None
rows = defaultdict(dict)
for line in open(HERE / "results" / f"{data}_{split}_aug.jsonl"):
    r = json.loads(line)
    cfg = (r["cols"], r.get("qcols") or r["cols"], r.get("qshrink", 0.3), r.get("qblend", 0.8), r.get("qfreeze", 0),
           r["views"], r["wv"], r["M"], r.get("lamstep", 1), r.get("qprior", 0), r.get("rnorm", 0), r.get("max_train", 0),
           f"grid{r.get('gscale', 1.0):g}" if r.get("grid") else "")
    for k, m in r["results"].items():
        rows[(cfg, k)][r["seed"]] = m
for (cfg, k), per in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1])):
    if only and not k.startswith(only):
        continue
    seeds = sorted(per)
    ab = np.array([per[s]["Abar"] for s in seeds])
    at = np.array([per[s]["AT"] for s in seeds])
    fg = np.array([per[s]["forgetting"] for s in seeds])
    print(f"{str(cfg):70s} {k:14s} n={len(seeds)} Abar {ab.mean():.2f}±{ab.std():.2f} AT {at.mean():.2f}±{at.std():.2f} F {fg.mean():.2f}")
