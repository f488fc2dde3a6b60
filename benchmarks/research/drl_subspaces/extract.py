"""Extract ALL subspaces f_0..f_t of a (partial or final) DRL benchmark run, one network pass per image.

    python extract.py RUN_DIR DATA_DIR OUT.npz [--seed 1993] [--max-train 30] [--max-test 10]
                      [--val-fraction 0.2] [--classes-of-stages N]

Reproduces the benchmark's split exactly (drlcli.benchmark.load_data / split_validation /
class_order / stage_classes): 'train' = the first max_train images per class of the 80% part
(what the stage was trained on and what its prototypes came from), 'val' = the first max_val (10) held-out 20%
images of each class (= the benchmark's own val set), 'test' = first max_test
of test.txt per class. Labels are global class indices in class order (stage s holds classes
10(s-1)..10s-1). Eval transform, features as the run's IPANetwork computes them: (N, S, d).
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from drlcli import api
from drlcli.benchmark import class_order, load_data, parse_split, split_validation, stage_classes
from drlcli.data import ImageSet
from drlcli.model import embed_images

WEIGHTS = Path("/work/shared/data/deit_tiny_patch16_224/deit_tiny_patch16_224.safetensors")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("data_dir")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=1993)
    ap.add_argument("--max-train", type=int, default=30)
    ap.add_argument("--max-test", type=int, default=10)
    ap.add_argument("--val-fraction", type=float, default=0.2)
    ap.add_argument("--max-val", type=int, default=10, help="first N held-out images per class (benchmark: max_test)")
    ap.add_argument("--skip-test", action="store_true")
    ap.add_argument("--split", default="B0Inc10")
    ap.add_argument("--classes-of-stages", type=int, default=None, help="only images of the first N stages' classes")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    full = load_data(Path(a.data_dir), skip_classes={"BACKGROUND_Google"})
    data = split_validation(full, a.val_fraction, a.seed)
    order = class_order(list(data.train), seed=a.seed, shuffle=True)
    base, inc = parse_split(a.split)
    stages = stage_classes(order, base, inc)
    if a.classes_of_stages:
        stages = stages[: a.classes_of_stages]
    classes = [c for s in stages for c in sorted(s)]  # a stage folder lists its classes sorted
    class_stage = np.array([k + 1 for k, s in enumerate(stages) for _ in s])
    loaded = api.load_run(a.run_dir, device="cpu", ptm_weights=WEIGHTS)
    model = loaded.model
    net = model.network.eval()
    run_names = model.class_names
    assert run_names == classes[: len(run_names)], "run class order differs from the reproduced split"
    res = {"classes": np.array(classes), "class_stage": class_stage, "run_stages": len(loaded.stage_metas)}
    res["run_real_prototypes"] = model.real_prototypes.numpy()
    splits = (
        ("train", {c: data.train[c][: a.max_train] for c in classes}),
        ("val", {c: data.test[c][: a.max_val] for c in classes}),
        ("test", {c: full.test[c][: a.max_test] for c in classes}),
    )
    for split, by_class in splits:
        if split == "test" and a.skip_test:
            continue
        paths, labels, first = [], [], []
        for i, c in enumerate(classes):
            paths += by_class[c]
            labels += [i] * len(by_class[c])
            first += [j < a.max_test for j in range(len(by_class[c]))]
        root = Path("/")
        images = ImageSet(root=root, class_names=tuple(classes), paths=tuple(paths), labels=tuple(labels))
        t0 = time.time()

        def progress(step, total, t0=t0, split=split):
            if step % 10 == 0 or step == total:
                print(f"{split} {step}/{total} {time.time() - t0:.0f}s", file=sys.stderr, flush=True)

        feats, labs = embed_images(net, images, model.data_config, batch_size=32, progress=progress)
        res[f"{split}_x"] = feats.numpy().astype(np.float32)
        res[f"{split}_y"] = labs.numpy().astype(np.int64)
        if split == "val":
            res["val_bench"] = np.array(first)
        print(f"{split}: {len(paths)} images, feats {tuple(feats.shape)} in {time.time() - t0:.0f}s", file=sys.stderr)
        if split == "val":  # train+val ready: save now so head selection can start before test is done
            np.savez(a.out.replace(".npz", "_trval.npz"), **res)
    np.savez(a.out, **res)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
