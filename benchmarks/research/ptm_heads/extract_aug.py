"""Cache DeiT-Tiny features of augmented views of the training images (for augmented statistics).

    python extract_aug.py DATA_DIR NAME VIEW [THREADS]    # NAME e.g. caltech_aug; VIEW flip | rrcS_K
      flip    : the eval transform of the horizontally flipped image
      rrcS_K  : drlcli's training transform (random resized crop, area scale [S/100, 1], flip p 0.5),
                random streams seeded with K
Columns: block-7 class token [0, 192), block-11 class token (= f_0) [192, 384), both after the final
norm. Same train order/chunks as extract.py: feats/NAME/VIEW_CCCC.npy.
"""
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from extract import CHUNK, HERE, PTM, WEIGHTS, lists
from PIL import ImageOps

from drlcli import backbone
from drlcli.backbone import PTMSource
from drlcli.data import eval_transform, load_rgb, train_transform


def main():
    data_dir, name, view = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 2)
    out = HERE / "feats" / name
    out.mkdir(parents=True, exist_ok=True)
    _, parts = lists(data_dir)
    items = parts["train"]
    ptm = backbone.create_ptm(PTM, source=PTMSource(weights_path=WEIGHTS)).eval()
    cfg = backbone.data_config(ptm)
    if view == "flip":
        tf0 = eval_transform(cfg)
        tf = lambda im: tf0(ImageOps.mirror(im))  # noqa: E731
    else:
        scale, seed = view[3:].split("_")
        tf = train_transform(cfg, crop_scale_min=int(scale) / 100, hflip=True)
        random.seed(int(seed))
        torch.manual_seed(int(seed))
    t0, done = time.time(), 0
    for k in range(0, len(items), CHUNK):
        f = out / f"{view}_{k // CHUNK:04d}.npy"
        batch = items[k:k + CHUNK]
        imgs = [tf(load_rgb(Path(p))) for p, _ in batch]  # drawn even when cached: same stream on resume
        if f.exists():
            continue
        feats = []
        with torch.inference_mode():
            for j in range(0, len(imgs), 32):
                x = ptm.patch_embed(torch.stack(imgs[j:j + 32]))
                x = ptm.norm_pre(ptm._pos_embed(x))
                for b, blk in enumerate(ptm.blocks):
                    x = blk(x)
                    if b == 7:
                        c7 = ptm.norm(x)[:, 0]
                feats.append(torch.cat([c7, ptm.norm(x)[:, 0]], 1).float().numpy())
        tmp = f.with_suffix(".tmp.npy")
        np.save(tmp, np.concatenate(feats).astype(np.float32))
        tmp.replace(f)
        done += len(batch)
        print(f"{name} {view} {k + len(batch)}/{len(items)} {done / (time.time() - t0):.1f} img/s", flush=True)
    print(f"{name} {view} done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
