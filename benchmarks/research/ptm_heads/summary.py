"""Curated tables for FINDINGS.md:  python summary.py val|test"""
import sys

import numpy as np
from report import rows

HEADS = [("ncm", "raw", "SimpleCIL (cos to means)"),
         ("lda:shrink=0.1", "raw", "LDA shared cov, shrink 0.1"),
         ("lda:norm=l2,shrink=0.1", "raw", "LDA on L2-normed f_0, shrink 0.1"),
         ("qda:norm=l2,shrink=0.3,blend=0.8", "raw", "FeCAM-style per-class cov (l2, shrink .3, blend .8)"),
         ("ridge:M=3000", "raw", "RanPAC ridge M=3000 (baseline)"),
         ("ridge:M=3000", "cosz+0.5", "RanPAC ridge + cos, z-scored, w=0.5"),
         ("ridge:M=3000,bal=1", "raw", "class-balanced ridge M=3000"),
         ("ridge:M=3000,bal=1", "cosz+1", "class-balanced ridge + cos, z, w=1"),
         ("ridge:M=3000,lam=100000", "raw", "ridge M=3000, fixed λ=1e5 (half the statistics)"),
         ("ridge:M=3000,lam=100000,bal=1", "raw", "class-balanced ridge, fixed λ=1e5"),
         ("ridge:M=5000", "raw", "ridge M=5000")]


def f(x, p=2):
    if not x:
        return "—"
    return f"{np.mean(x):.{p}f} ± {np.std(x):.{p}f}" if len(x) > 1 else f"{x[0]:.{p}f} (1 seed)"


split = sys.argv[1]
evs = ("valcap", "valfull") if split == "val" else ("testcap", "testfull")
for ev in evs:
    print(f"\n**{split}, {ev}** (mean ± std over orders; n = seeds)\n")
    print("| head | Caltech Ā | Caltech A_T | Caltech F | Caltech AUROC | Sketch Ā | Sketch A_T | Sketch F | Sketch AUROC | n |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    tabs = {d: {(h, v): (vals, seeds) for h, v, e, seeds, vals, *_ in rows(f"{d}_{split}", "all", ev)} for d in ("caltech", "sketch")}
    for h, v, label in HEADS:
        cells, ns = [], []
        for d in ("caltech", "sketch"):
            vals, seeds = tabs[d].get((h, v), ({}, []))
            cells += [f(vals.get("Abar")), f(vals.get("AT")), f(vals.get("forgetting"), 1), f(vals.get("auroc"), 3)]
            ns.append(str(len(seeds)))
        print(f"| {label} `{h}` {v} | " + " | ".join(cells) + f" | {'/'.join(ns)} |")
