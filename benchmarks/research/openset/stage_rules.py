"""Open-set AUROC of rules that use a trained drl run's stage subspaces (issue 19): the run learned
all 11 stages, but stage s's subspace depends only on stages <= s, so the model after stage 9 is
the run's first 9 stages; the classes of stages 10-11 are the unknowns.

    python stage_rules.py FEATS.npz RUN_DIR
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ptm_heads"))
from ptmheads import auroc, l2n  # noqa: E402

from drlcli.prototypes import score_weights, synthesize, weighted_scores  # noqa: E402

KNOWN_STAGES = 9


def main():
    z = np.load(sys.argv[1])
    run = Path(sys.argv[2])
    scales = []
    for s in range(1, KNOWN_STAGES + 1):
        meta = json.loads((run / "stages" / f"{s:03d}" / "stage.json").read_text())
        scales.append(meta["metrics"]["train"]["scale"])
    names, cstage = list(z["class_names"]), z["class_stage"]
    sorted_names = list(z["classes_sorted"])
    known = cstage <= KNOWN_STAGES
    C = int(known.sum())
    P = z["prototypes"][:C, : 1 + KNOWN_STAGES]  # (C, 10, d)
    stage_of = cstage[:C]
    res = {}
    for part in ("testcap", "testfull") if "testrest" in z else ("testcap",):
        if part == "testfull":
            F = np.concatenate([z["testcap"], z["testrest"]])
            y = np.concatenate([z["testcap_y"], z["testrest_y"]])
        else:
            F, y = z["testcap"], z["testcap_y"]
        F = F[:, : 1 + KNOWN_STAGES]
        gl = np.array([names.index(sorted_names[k]) for k in y])  # run's class index
        is_known = gl < C
        cos = np.einsum("nsd,csd->ncs", l2n_3(F), l2n_3(P))  # (N, C, S)
        own = cos[:, np.arange(C), stage_of]  # (N, C)
        ptm = cos[:, :, 0]
        out = {
            "maxcos_ptm": ptm.max(1),
            "maxcos_own_stage": own.max(1),
            "das_margin_sigma": (own * np.array(scales)[stage_of - 1] - 1.0).max(1),
            "mean_ptm_own": ((ptm + own) / 2).max(1),
            "maxcos_all_subspaces_mean": cos.mean(2).max(1),
        }
        bank = synthesize(torch.from_numpy(P).float(), torch.from_numpy(stage_of).long(), tau=1.0, offset=1)
        for beta in (1.0, 3.0):
            w = score_weights(torch.from_numpy(stage_of).long(), bank.shape[1], rho=0.1, beta=beta, offset=1)
            sc = weighted_scores(torch.from_numpy(F).float(), bank, w).numpy()
            out[f"paper_reweight_beta{beta:g}"] = sc.max(1)
            if beta == 1.0:
                pred = sc.argmax(1)
        acc = float((pred[is_known] == gl[is_known]).mean() * 100)
        for r, v in out.items():
            res.setdefault(r, {})[part] = round(float(auroc(v[is_known], v[~is_known])), 4)
        res.setdefault("_closed_acc_paper", {})[part] = round(acc, 2)
        res.setdefault("_n", {})[part] = [int(is_known.sum()), int((~is_known).sum())]
    for r, v in res.items():
        print(f"{r:28s} {v}")


def l2n_3(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True).clip(1e-12)


if __name__ == "__main__":
    main()
