"""Issue 32, on a lent GPU: train many stage-1 adaptations of the PTM at once, embed and score them here.

The CPU takes about 27 minutes to train one AdaptFormer set for 20 epochs on a first stage of Sketch;
a GPU takes seconds. This script trains, on the GPU machine, one adapter set per (variant, class
order, split) with drlcli's own loop (``stage.train.train_stage``, as ``first_stage.py embed`` does)
and writes the adapters; ``first_stage.py embed --adapters FILE --key K`` then embeds every image
with one of them on the CPU and ``../cov_rank/replay.py`` scores it with the product's head.

The images do not travel (the device tool carries 64 MiB): the Caltech-101 photos of the stage-1
classes do, with ``manifest.json`` (the stage-1 images and labels of each order and split, and the
sha256 of each sketch as ``make.py`` wrote it here), and the sketches are redrawn there by the data
set's own generator (``make.py``'s ``sketch``), checked against those hashes.

Here, once (``.devdata/`` is ignored: ``echo /.devdata/ >> .git/info/exclude``), 55 MB:

    python gpu_adapt.py pack --sketch /work/scratch/sketch --shared ../shared/data --out .devdata

It also writes ``.devdata/caltech101`` (the 20 classes, 30 train and 15 test images each, that
``tests/test_precision.py``'s real-data test reads) and the DeiT-Tiny weights, so that one device call
with ``carry [".devdata"]`` runs both ``DRL_SHARED_DATA=$PWD/.devdata pytest -m gpu`` and

    python gpu_adapt.py train --src .devdata/sketchsrc --weights .devdata/deit_tiny_patch16_224/*.safetensors \
        --out $OUT --budget 280 --workers 12
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from drlcli.data import ImageSet
from drlcli.methods.ease.options import EaseConfig
from drlcli.options import TrainConfig
from drlcli.ptm import backbone
from drlcli.ptm.backbone import PTMSource
from drlcli.stage import train as stage_train
from drlcli.stage.train import train_stage

sys.path.insert(0, str(Path(__file__).resolve().parent))
from first_stage import Adapted, plan  # noqa: E402

# name -> (loss, epochs, lr, kd)
VARIANTS = {
    "ce20": ("ce", 20, 0.01, 0.0),  # RanPAC's phase 1
    "das20": ("das", 20, 0.01, 0.0),
    "ce5": ("ce", 5, 0.01, 0.0),
    "das5": ("das", 5, 0.01, 0.0),
    "das20kd2": ("das", 20, 0.01, 2.0),
    "ce20lr3": ("ce", 20, 0.001, 0.0),
    "das20lr3": ("das", 20, 0.001, 0.0),
}


def redraw(src: Path, manifest: dict, dst: Path) -> int:
    """The stage-1 sketches from their photos by the data set's own generator; how many match the hashes."""
    spec = importlib.util.spec_from_file_location("make", src / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    same = 0
    for rel, digest in manifest["sha256"].items():
        out = dst / rel
        make.sketch((src / (rel[:-4] + ".jpg"), out))
        same += hashlib.sha256(out.read_bytes()).hexdigest() == digest
    return same


def pack(args) -> None:
    """The bundle a device call carries: weights, the tests' Caltech subset, the stage-1 photos."""
    out, shared = args.out, args.shared
    weights = out / "deit_tiny_patch16_224"
    weights.mkdir(parents=True, exist_ok=True)
    shutil.copy(shared / "deit_tiny_patch16_224" / "deit_tiny_patch16_224.safetensors", weights)
    caltech, lists = shared / "caltech101", {}
    for split in ("train", "test"):  # as tests/test_precision.py's caltech_stages picks them
        for line in (caltech / f"{split}.txt").read_text().split():
            if (caltech / "101_ObjectCategories" / line).is_file():
                lists.setdefault((split, line.split("/")[0]), []).append(line)
    names = sorted({name for _, name in lists})[:20]
    for split, cap in (("train", 30), ("test", 15)):
        keep = [line for name in names for line in lists[split, name][:cap]]
        (out / "caltech101").mkdir(exist_ok=True)
        (out / "caltech101" / f"{split}.txt").write_text("\n".join(keep) + "\n")
        for line in keep:
            dst = out / "caltech101" / "101_ObjectCategories" / line
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(caltech / "101_ObjectCategories" / line, dst)
    src = out / "sketchsrc"
    manifest: dict = {"runs": {}, "sha256": {}}
    for seed in (1993, 1994, 1995):
        for split in ("val", "test"):  # the images first_stage.py embed trains on
            data, stages = plan(args.sketch, seed, split)
            first = sorted(stages[0])
            items = [
                [str(Path(p).relative_to(args.sketch / "101_ObjectCategories")), i]
                for i, c in enumerate(first)
                for p in data.train[c]
            ]
            manifest["runs"][f"{seed}-{split}"] = {"classes": first, "items": items}
            for rel, _ in items:
                photo = rel[:-4] + ".jpg"
                (src / photo).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(caltech / "101_ObjectCategories" / photo, src / photo)
                sketch = args.sketch / "101_ObjectCategories" / rel
                manifest["sha256"][rel] = hashlib.sha256(sketch.read_bytes()).hexdigest()
    (src / "manifest.json").write_text(json.dumps(manifest))
    shutil.copy(shared / "caltech101-sketch" / "make.py", src / "make.py")
    print(f"packed {len(manifest['sha256'])} stage-1 photos and {len(names)} test classes into {out}")


def persistent(loader_factory):
    def make(*args, **kwargs):
        if kwargs.get("num_workers", 0) > 0:
            kwargs["persistent_workers"] = True
        return loader_factory(*args, **kwargs)

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    k = sub.add_parser("pack")
    k.add_argument("--sketch", type=Path, required=True, help="Caltech-101-Sketch as make.py wrote it")
    k.add_argument("--shared", type=Path, default=Path("../shared/data"))
    k.add_argument("--out", type=Path, default=Path(".devdata"))
    p = sub.add_parser("train")
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("--weights", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sketches", type=Path, default=Path("/tmp/sketch"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--runs", default="1993-val,1994-val,1995-val,1993-test,1994-test,1995-test")
    p.add_argument("--budget", type=float, default=300.0, help="seconds; no new training starts after")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--max-images", type=int, default=0, help="a smoke test: the first N images of each run")
    p.add_argument("--epochs", type=int, default=0, help="a smoke test: this many epochs for every variant")
    args = parser.parse_args()
    if args.command == "pack":
        pack(args)
        return
    start = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    manifest = json.loads((args.src / "manifest.json").read_text())
    same = redraw(args.src, manifest, args.sketches)
    print(
        f"redrew {len(manifest['sha256'])} sketches, {same} byte-identical to make.py's here ({time.time() - start:.0f}s)"
    )
    stage_train.make_loader = persistent(stage_train.make_loader)
    ptm = backbone.create_ptm("deit_tiny_patch16_224", source=PTMSource(weights_path=args.weights))
    cfg = backbone.data_config(ptm)
    args.out.mkdir(parents=True, exist_ok=True)
    for run in args.runs.split(","):
        seed = int(run.split("-")[0])
        entry = manifest["runs"][run]
        items = entry["items"][: args.max_images or None]
        images = ImageSet(
            args.sketches,
            tuple(entry["classes"]),
            tuple(args.sketches / r for r, _ in items),
            tuple(l for _, l in items),
        )
        saved = {}
        for name in args.variants.split(","):
            if time.time() - start > args.budget:
                print(f"budget spent: {run} {name} and later not trained", flush=True)
                break
            loss, epochs, lr, kd = VARIANTS[name]
            net = Adapted(ptm, EaseConfig(adapter_dim=64))
            net.new_stage(seed=seed)
            net.to(device)
            train = TrainConfig(
                epochs=args.epochs or epochs,
                batch_size=48,
                lr=lr,
                loss=loss,
                kd_weight=kd,
                seed=seed,
                num_workers=args.workers,
            )
            tick = time.time()
            result = train_stage(net, images, train, cfg)
            seconds = time.time() - tick
            saved[name] = {k: v.detach().cpu() for k, v in net.stages[-1].state_dict().items()}
            record = {
                "run": run,
                "variant": name,
                "images": len(items),
                "seconds": seconds,
                "losses": result.epoch_losses,
            }
            with open(args.out / "train.jsonl", "a") as log:
                log.write(json.dumps(record) + "\n")
            print(
                f"{run} {name}: {len(items)} images, {seconds:.1f}s, last loss {result.epoch_losses[-1]:.4f}",
                flush=True,
            )
            torch.save(saved, args.out / f"adapters-{run}.pt")
    print(f"done in {time.time() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
