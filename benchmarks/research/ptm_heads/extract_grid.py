"""Cache spatially pooled DeiT-Tiny patch tokens next to the class token (layout features, issue 15).

For blocks 7 and 11, after the final norm: the class token and the 14 x 14 patch tokens average-pooled
over a 2 x 2 grid (7 x 7 patches per cell, cells in row-major order). Columns:
    [0, 192)     block-11 class token (= f_0)
    [192, 960)   block-11 patch tokens, 2 x 2 grid (cell k = [192 + 192 k, 384 + 192 k))
    [960, 1152)  block-7 class token
    [1152, 1920) block-7 patch tokens, 2 x 2 grid
Same parts/chunks/meta as extract.py, so ptmheads.load_feats('NAME') reads them.

    python extract_grid.py DATA_DIR NAME [THREADS]     # NAME e.g. caltech_grid
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from extract import CHUNK, HERE, PTM, WEIGHTS, lists

from drlcli import backbone
from drlcli.backbone import PTMSource
from drlcli.data import eval_transform, load_rgb


def pooled(ptm, x):
    n = ptm.norm(x)
    p = n[:, ptm.num_prefix_tokens:]
    side = int(round(p.shape[1] ** 0.5))
    grid = torch.nn.functional.adaptive_avg_pool2d(p.transpose(1, 2).reshape(len(p), -1, side, side), 2)
    return [n[:, 0], grid.flatten(2).transpose(1, 2).flatten(1)]


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
                    x = ptm.norm_pre(ptm._pos_embed(ptm.patch_embed(x)))
                    cols = {}
                    for b, blk in enumerate(ptm.blocks):
                        x = blk(x)
                        if b == 7:
                            cols[7] = pooled(ptm, x)
                    cols[11] = pooled(ptm, x)
                    feats.append(torch.cat(cols[11] + cols[7], 1).float().numpy())
            tmp = f.with_suffix(".tmp.npy")
            np.save(tmp, np.concatenate(feats).astype(np.float32))
            tmp.replace(f)
            done += len(batch)
            print(f"{name} {part} {k + len(batch)}/{len(items)} {done / (time.time() - t0):.1f} img/s", flush=True)
    print(f"{name} all parts done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
