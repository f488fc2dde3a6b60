"""Cache multi-layer DeiT-Tiny features: for every block b (0..11) the class token and the mean of the
patch tokens, each after the final norm, eval transform. Same parts/chunks/meta as extract.py, so
ptmheads.load_feats('NAME') reads them; columns: block b class token = [384 b, 384 b + 192),
block b patch mean = [384 b + 192, 384 (b + 1)). Block 11's class token is f_0.

    python extract_ml.py DATA_DIR NAME [THREADS]     # NAME e.g. caltech_ml
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from drlcli import backbone
from drlcli.backbone import PTMSource
from drlcli.data import eval_transform, load_rgb
from extract import CHUNK, HERE, PTM, WEIGHTS, lists


def main():
    data_dir, name = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    out = HERE / "feats" / name
    out.mkdir(parents=True, exist_ok=True)
    classes, parts = lists(data_dir)
    meta = {"data_dir": str(data_dir), "classes": classes,
            "parts": {k: [[p, y] for p, y in v] for k, v in parts.items()}}
    (out / "meta.json").write_text(json.dumps(meta))
    ptm = backbone.create_ptm(PTM, source=PTMSource(weights_path=WEIGHTS)).eval()
    tf = eval_transform(backbone.data_config(ptm))
    t0, done = time.time(), 0
    for part, items in parts.items():
        for k in range(0, len(items), CHUNK):
            f = out / f"{part}_{k // CHUNK:04d}.npy"
            if f.exists():
                continue
            batch = items[k:k + CHUNK]
            feats = []
            with torch.inference_mode():
                for j in range(0, len(batch), 32):
                    x = torch.stack([tf(load_rgb(Path(p))) for p, _ in batch[j:j + 32]])
                    x = ptm.patch_embed(x)
                    x = ptm._pos_embed(x)
                    x = ptm.norm_pre(x)
                    cols = []
                    for blk in ptm.blocks:
                        x = blk(x)
                        n = ptm.norm(x)
                        cols += [n[:, 0], n[:, ptm.num_prefix_tokens:].mean(1)]
                    feats.append(torch.cat(cols, 1).float().numpy())
            tmp = f.with_suffix(".tmp.npy")
            np.save(tmp, np.concatenate(feats).astype(np.float32))
            tmp.replace(f)
            done += len(batch)
            print(f"{name} {part} {k + len(batch)}/{len(items)} {done / (time.time() - t0):.1f} img/s", flush=True)
    print(f"{name} all parts done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
