"""Subspace features (N, S, d) of a trained drl run for the cached test lists (issue 19 rule comparison).

    python extract_stages.py RUN_DIR FEATS_NAME OUT.npz [PARTS, default testcap,testrest]
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from drlcli.api import load_run
from drlcli.data import eval_transform, load_rgb

HERE = Path(__file__).resolve().parent


def main():
    run_dir, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
    parts = sys.argv[4].split(",") if len(sys.argv) > 4 else ["testcap", "testrest"]
    torch.set_num_threads(2)
    loaded = load_run(run_dir, device="cpu")
    model = loaded.model
    meta = json.loads((HERE.parent / "ptm_heads" / "feats" / name / "meta.json").read_text())
    tf = eval_transform(model.data_config)
    res = {}
    t0 = time.time()
    for part in parts:
        items = meta["parts"][part]
        feats = []
        with torch.inference_mode():
            for j in range(0, len(items), 32):
                x = torch.stack([tf(load_rgb(Path(p))) for p, _ in items[j:j + 32]])
                feats.append(model.network(x).float().numpy())
                print(part, j + 32, len(items), f"{(j + 32) / (time.time() - t0):.1f}/s", flush=True)
        res[part] = np.concatenate(feats)
        res[part + "_y"] = np.array([y for _, y in items])
    res["prototypes"] = model.real_prototypes.numpy()
    res["class_names"] = np.array(model.class_names)
    res["class_stage"] = model.class_stage.numpy()
    res["classes_sorted"] = np.array(meta["classes"])
    np.savez(out, **res)


if __name__ == "__main__":
    main()
