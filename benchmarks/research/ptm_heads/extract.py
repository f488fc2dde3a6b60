"""Cache DeiT-Tiny f_0 (class token after the final norm, eval transform) exactly as drlcli computes it.

    python extract.py DATA_DIR NAME [THREADS]     # e.g. /work/shared/data/caltech101 caltech 1

Resumable, chunked (feats/NAME/PART_CCCC.npy, 256 images each). Parts, in priority order:
  train      : every train image, classes in sorted order, train.txt order within a class
  testcap    : the first 10 test images per class (test.txt order)   == --max-test-per-class 10
  testrest   : the remaining test images per class
`load.py` assembles them. f_0 = ptm.forward_features(x)[:, 0] (timm, = drlcli IPANetwork f_0 within 4e-6,
checked in extract_check.py); eval transform = drlcli.data.eval_transform(backbone.data_config(ptm)).
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from drlcli import backbone
from drlcli.backbone import PTMSource
from drlcli.benchmark import load_data
from drlcli.data import eval_transform, load_rgb

PTM = "deit_tiny_patch16_224"
WEIGHTS = Path("/work/shared/data/deit_tiny_patch16_224/deit_tiny_patch16_224.safetensors")
HERE = Path(__file__).resolve().parent
CHUNK = 256
CAP = 10


def lists(data_dir: Path):
    data = load_data(data_dir, skip_classes={"BACKGROUND_Google"})
    classes = sorted(data.train)
    parts = {"train": [], "testcap": [], "testrest": []}
    for i, c in enumerate(classes):
        parts["train"] += [(str(p), i) for p in data.train[c]]
        parts["testcap"] += [(str(p), i) for p in data.test[c][:CAP]]
        parts["testrest"] += [(str(p), i) for p in data.test[c][CAP:]]
    return classes, parts


def main():
    data_dir, name = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    out = HERE / "feats" / name
    out.mkdir(parents=True, exist_ok=True)
    classes, parts = lists(data_dir)
    meta = {"data_dir": str(data_dir), "classes": classes,
            "parts": {k: [[p, y] for p, y in v] for k, v in parts.items()}}
    (out / "meta.json").write_text(json.dumps(meta))
    ptm = backbone.create_ptm(PTM, source=PTMSource(weights_path=WEIGHTS))
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
                    feats.append(ptm.forward_features(x)[:, 0].float().numpy())
            tmp = f.with_suffix(".tmp.npy")
            np.save(tmp, np.concatenate(feats).astype(np.float32))
            tmp.replace(f)
            done += len(batch)
            print(f"{name} {part} {k + len(batch)}/{len(items)} {done / (time.time() - t0):.1f} img/s", flush=True)
    print(f"{name} all parts done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
