"""Run heads through B0 Inc10 on cached features.

    python search.py --data caltech --split val --seeds 1993,1994,1995 --head 'ridge:M=3000' --head ncm
    python search.py --data caltech --split test --seeds 1993 --head 'ridge:M=3000'

Head specs: ncm | ncm:metric=euc | lda:norm=l2,shrink=0.1 | qda:norm=l2,shrink=0.5,blend=0.5,logdet=1,corr=0 |
ridge:M=3000,act=relu,lam=split,std=none,seed=0,search=local   (lam may be a number)
Each head also reports 'cosz+w' variants: z(cos to means) + w * z(head) (z = per-sample standardisation over the
seen classes), and scale statistics of its raw scores. split val: fit on drlcli split_validation(0.2, seed)'s 80%,
evaluate on its held-out images (valcap: first 10 per class; valfull: all). split test: fit on all train,
evaluate testcap (first 10/class) and testfull (when extracted). Results append to results/DATA_SPLIT.jsonl.
"""
import argparse
import json
import time

import numpy as np
import torch
from ptmheads import HERE, NCM, Gaussian, Ridge, class_order, load_feats, run_protocol, val_split

WS = (0.5, 1.0, 2.0)


def parse(spec):
    name, _, rest = spec.partition(":")
    kw = {}
    for item in filter(None, rest.split(",")):
        k, v = item.split("=")
        try:
            v = int(v)
        except ValueError:
            try:
                v = float(v)
            except ValueError:
                pass
        kw[k] = v
    if name == "ncm":
        return lambda: NCM(**kw)
    if name in ("lda", "qda"):
        kw = {k: (bool(v) if k in ("logdet", "corr") else v) for k, v in kw.items()}
        return lambda: Gaussian(kind=name, **kw)
    if name == "ridge":
        if "lam" in kw and not isinstance(kw["lam"], str):
            kw["lam"] = float(kw["lam"])
        return lambda: Ridge(**kw)
    raise ValueError(spec)


class WithCos:
    """A head plus SimpleCIL's class means (for the cos+head combinations)."""

    def __init__(self, head):
        self.head, self.ncm = head, NCM("cos")

    def add(self, X, y):
        self.head.add(X, y)
        self.ncm.add(X, y)

    def scores(self, X):
        return self.head.scores(X)


def z(S):
    return (S - S.mean(1, keepdims=True)) / S.std(1, keepdims=True).clip(1e-12)


SCALE = []


def post(h, X, S):
    cos = h.ncm.scores(X)
    out = {"raw": S}
    for w in WS:
        out[f"cosz+{w:g}"] = z(cos) + w * z(S)
    # scale statistics of the raw head scores (for normalising against cosine scores later)
    srt = np.sort(S, 1)
    srt_c = np.sort(cos, 1)
    SCALE.append({"C": S.shape[1], "top1": float(srt[:, -1].mean()), "margin": float((srt[:, -1] - srt[:, -2]).mean()),
                  "std": float(S.std(1).mean()), "mean": float(S.mean()),
                  "cos_top1": float(srt_c[:, -1].mean()), "cos_margin": float((srt_c[:, -1] - srt_c[:, -2]).mean()),
                  "cos_std": float(cos.std(1).mean()), "cos_mean": float(cos.mean())})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--split", choices=["val", "test"], required=True)
    ap.add_argument("--seeds", default="1993,1994,1995")
    ap.add_argument("--head", action="append", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="")
    ap.add_argument("--feats", default=None, help="cached feature set (default: --data), e.g. caltech_ml")
    ap.add_argument("--cols", default=None, help="extract_ml.py columns, e.g. c11,p11,c8: class token (c) / patch mean (p) of block b")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    feats = load_feats(a.feats or a.data)
    if a.cols:
        idx = np.concatenate([np.arange(384 * int(t[1:]) + (192 if t[0] == "p" else 0), 384 * int(t[1:]) + (384 if t[0] == "p" else 192))
                              for t in a.cols.split(",")])
        feats["parts"] = {k: (x[:, idx], y, p) for k, (x, y, p) in feats["parts"].items()}
        a.tag = (a.tag + " " if a.tag else "") + "cols=" + a.cols
    Xtr, ytr, _ = feats["parts"]["train"]
    out_f = HERE / "results" / f"{a.data}_{a.split}.jsonl"
    out_f.parent.mkdir(exist_ok=True)
    for seed in map(int, a.seeds.split(",")):
        pos = class_order(feats["classes"], seed)
        if a.split == "val":
            fit, vcap, vfull = val_split(a.data, feats, seed)
            Xf, yf = Xtr[fit], ytr[fit]
            evalsets = {"valcap": (Xtr[vcap], ytr[vcap]), "valfull": (Xtr[vfull], ytr[vfull])}
        else:
            Xf, yf = Xtr, ytr
            evalsets = {}
            if "testcap" in feats["parts"]:
                evalsets["testcap"] = feats["parts"]["testcap"][:2]
            if "testrest" in feats["parts"] and "testcap" in feats["parts"]:
                Xc, yc, _ = feats["parts"]["testcap"]
                Xr, yr, _ = feats["parts"]["testrest"]
                evalsets["testfull"] = (np.concatenate([Xc, Xr]), np.concatenate([yc, yr]))
        for spec in a.head:
            SCALE.clear()
            t0 = time.time()
            res, h = run_protocol(lambda: WithCos(parse(spec)()), Xf, yf, evalsets, pos, post=post, openset_stage=9)
            dt = time.time() - t0
            d, C = Xf.shape[1], len(pos)
            rec = {"data": a.data, "split": a.split, "seed": seed, "head": spec, "tag": a.tag, "seconds": dt,
                   "storage_floats": h.head.storage(d, C), "results": res,
                   "lams": getattr(h.head, "lams", None), "scale_last": SCALE[-1], "scale_first": SCALE[0]}
            with open(out_f, "a") as f:
                f.write(json.dumps(rec) + "\n")
            msg = " ".join(f"{k}:{r['Abar']:.2f}/{r['AT']:.2f}/F{r['forgetting']:.1f}/au{r.get('auroc', float('nan')):.3f}"
                           for k, r in res["raw"].items())
            best_c = max((v for v in res if v.startswith("cosz")), key=lambda v: list(res[v].values())[0]["Abar"])
            msgc = " ".join(f"{k}:{r['Abar']:.2f}/{r['AT']:.2f}" for k, r in res[best_c].items())
            print(f"{a.data} {a.split} {seed} {spec} {a.tag} [{dt:.0f}s] raw {msg} | {best_c} {msgc}"
                  + (f" lams={[f'{l:.0e}' for l in h.head.lams]}" if hasattr(h.head, "lams") else ""), flush=True)


if __name__ == "__main__":
    main()
