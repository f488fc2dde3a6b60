"""Aggregate results/*.jsonl into mean ± std tables.  python report.py [DATA_SPLIT ...] [--variant raw]"""
import json
import sys
from collections import defaultdict

import numpy as np
from ptmheads import HERE


def rows(name, variant="raw", evalset=None):
    recs = [json.loads(l) for l in open(HERE / "results" / f"{name}.jsonl")]
    by = defaultdict(dict)
    for r in recs:
        head = r["head"].replace(",f32=1", "")  # float32 solves: identical results (checked, caltech val 1993)
        by[(head, r["tag"])][r["seed"]] = r  # last record per seed wins
    out = []
    for (head, tag), seeds in by.items():
        any_r = next(iter(seeds.values()))
        variants = [variant] if variant != "all" else list(any_r["results"])
        for v in variants:
            if v not in any_r["results"]:
                continue
            for ev in any_r["results"][v]:
                if evalset and ev != evalset:
                    continue
                vals = {k: [s["results"][v][ev][k] for s in seeds.values() if k in s["results"][v][ev]]
                        for k in ("Abar", "AT", "forgetting", "auroc")}
                out.append((head + (f" [{tag}]" if tag else ""), v, ev, sorted(seeds), vals,
                            np.mean([s["seconds"] for s in seeds.values()]), any_r["storage_floats"]))
    return out


def fmt(x):
    if not x:
        return "—"
    return f"{np.mean(x):.2f} ± {np.std(x):.2f}" if len(x) > 1 else f"{x[0]:.2f}"


def table(name, variant="raw", evalset=None):
    lines = ["| head | variant | eval | seeds | Ā | A_T | forgetting | AUROC (9 stages known) | s/run | stats floats |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for head, v, ev, seeds, vals, sec, st in sorted(rows(name, variant, evalset), key=lambda r: (r[2], -np.mean(r[4]["Abar"]))):
        au = vals["auroc"]
        au_s = (f"{np.mean(au):.3f} ± {np.std(au):.3f}" if len(au) > 1 else f"{au[0]:.3f}") if au else "—"
        lines.append(f"| `{head}` | {v} | {ev} | {','.join(map(str, seeds))} | {fmt(vals['Abar'])} | {fmt(vals['AT'])} | "
                     f"{fmt(vals['forgetting'])} | {au_s} | {sec:.0f} | {st:,} |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    variant = "raw"
    evalset = None
    for a in sys.argv[1:]:
        if a.startswith("--variant="):
            variant = a.split("=", 1)[1]
        if a.startswith("--eval="):
            evalset = a.split("=", 1)[1]
    for name in args:
        print(f"### {name} ({variant})\n")
        print(table(name, variant, evalset))
        print()
