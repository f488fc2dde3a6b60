"""Small drops, real weights (issue 33): what a stage of a few classes costs as the run grows.

    python benchmarks/small_drops.py --caltech ../shared/data/caltech101 \
        --weights ../shared/data/deit_tiny_patch16_224/deit_tiny_patch16_224.safetensors \
        --stages 20 --per-stage 5 --images 15 --json small.json

Builds drops of ``--per-stage`` Caltech-101 classes with ``--images`` training images each (links,
nothing copied; ``examples/caltech101_stages.py``), creates a default ``drl`` run on DeiT-Tiny and
learns them one after another through ``drlcli``'s API, as a user adding a few classes a day would.
Per stage: the learn time (``stage.json`` ``metrics.learn_seconds``: every step but evaluation) split
into the head's fit (``ridge.seconds``: reading the run's statistics, the solve, the head built) and
the rest (loading the images, the feature pass, the open-set calibration), and the bytes of each of the
stage's files. The CPU is whatever the machine gives; both parts of a stage are timed in the same
process, one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from drlcli import init_run, learn_stage
from drlcli.config import RunConfig
from drlcli.run.directory import RunDir

ROOT = Path(__file__).resolve().parents[1]


def stage_row(run: RunDir, index: int) -> dict:
    meta = run.stage_meta(index)
    learn = float(meta["metrics"]["learn_seconds"])
    fit = float(meta["ridge"]["seconds"])
    manifest = run.manifest()
    files = {
        name.rpartition("/")[2].split(".")[0].split("-g")[0]: entry["bytes"]
        for name, entry in manifest["files"].items()
        if name.startswith(f"stages/{index:03d}/")
    }
    return {"stage": index, "learn_s": learn, "head_fit_s": fit, "rest_s": round(learn - fit, 3), "bytes": files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--caltech", type=Path, required=True)
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--stages", type=int, default=20)
    parser.add_argument("--per-stage", type=int, default=5)
    parser.add_argument("--images", type=int, default=15, help="training images per class")
    parser.add_argument("--out", type=Path, help="scratch folder (default: a temporary one, deleted)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="drl-small-"))
    try:
        drops = out / "drops"
        subprocess.run(
            [sys.executable, str(ROOT / "examples" / "caltech101_stages.py"), "--caltech", str(args.caltech)]
            + ["--out", str(drops), "--num-classes", str(args.stages * args.per_stage)]
            + ["--per-stage", str(args.per_stage), "--max-train-per-class", str(args.images)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        run_path = out / "run"
        init_run(
            run_path,
            ptm="deit_tiny_patch16_224",
            ptm_weights=args.weights,
            config=RunConfig.for_method("drl", preset="frozen"),
        )
        rows = []
        for k in range(1, args.stages + 1):
            learn_stage(run_path, data_dir=drops / f"stage{k}" / "train", device="cpu")
            row = stage_row(RunDir(run_path), k)
            rows.append(row)
            print(
                f"stage {k:3d}: learn {row['learn_s']:6.1f} s = head fit {row['head_fit_s']:5.1f} s + images, "
                f"features and calibration {row['rest_s']:5.1f} s; files {json.dumps(row['bytes'])}",
                file=sys.stderr,
                flush=True,
            )
        slower = [r["stage"] for r in rows if r["head_fit_s"] >= r["rest_s"]]
        print(f"\n{len(rows)} stages of {args.per_stage} classes x {args.images} images, DeiT-Tiny, default drl:")
        print(f"head fit at least as long as the rest in stages: {slower or 'none'}")
        print(f"run directory: {RunDir(run_path).size_bytes() / 2**20:.1f} MiB")
        if args.json:
            args.json.write_text(
                json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "stages": rows}) + "\n"
            )
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
