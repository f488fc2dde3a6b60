"""Export parity: every export format against the run directory, on the same preprocessed images.

    python benchmarks/export_parity.py                       # a fresh offline demo run (tiny ViT)
    python benchmarks/export_parity.py RUN_DIR --caltech ../shared/data/caltech101 --limit 200 \\
        --ptm-weights ../shared/data/deit_tiny_patch16_224/deit_tiny_patch16_224.safetensors
    python benchmarks/export_parity.py RUN_DIR --images some/folder list.txt

For each format (drl, torchscript, onnx) it exports the run (which only reads the run), loads the
file as ``drl predict --model`` does, scores the images, and prints against the run's own scores
(``api.load_run`` + ``model.scores``): max |Δscore|, top-1 agreement, file size, export time and
scoring throughput (images/s on preprocessed batches, decoding excluded). ``--json`` prints the
rows as one JSON object. ONNX is skipped, with a note, without the export extra.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from drlcli.api import load_run
from drlcli.data import eval_transform, load_rgb
from drlcli.errors import DependencyError
from drlcli.export import FORMATS, export_run, load_model
from drlcli.predict import expand_sources

SUFFIX = {"drl": "drl", "torchscript": "pt", "onnx": "onnx"}


def caltech_images(root: Path, limit: int) -> list[Path]:
    """``limit`` test images spread evenly over Caltech-101's test list (BACKGROUND_Google left out)."""
    lines = [line for line in (root / "test.txt").read_text().split() if not line.startswith("BACKGROUND_Google")]
    step = max(1, len(lines) // limit)
    return [root / "101_ObjectCategories" / line for line in lines[::step][:limit]]


def demo_run(work: Path) -> tuple[Path, list[Path]]:
    from drlcli.demo import run_demo

    result = run_demo(work / "demo", epochs=1, device="cpu")
    return Path(result["run_dir"]), sorted((work / "demo" / "data").glob("stage*/test/*/*.png"))


def score_all(model: Any, batches: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """(N, C) scores and images/s over the batches (one warm-up batch first)."""
    with torch.inference_mode():
        model.score_images(batches[0][:2])
        start = time.perf_counter()
        scores = torch.cat([model.score_images(b).float().cpu() for b in batches])
    return scores, sum(len(b) for b in batches) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", type=Path, help="run directory (default: a fresh demo run)")
    parser.add_argument("--images", nargs="*", default=[], help="image files, folders or .txt lists")
    parser.add_argument("--caltech", type=Path, help="Caltech-101 folder: take --limit images of test.txt")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--ptm-weights", type=Path)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="drl-parity-") as tmp:
        work = Path(tmp)
        if args.run_dir is None:
            run_dir, paths = demo_run(work)
        else:
            run_dir = args.run_dir
            paths = caltech_images(args.caltech, args.limit) if args.caltech else expand_sources(args.images)
        paths = paths[: args.limit]
        run_model = load_run(run_dir, device="cpu", ptm_weights=args.ptm_weights).model
        transform = eval_transform(run_model.data_config)
        images = torch.stack([transform(load_rgb(p)) for p in paths])  # (N, 3, H, W), preprocessed once
        batches = list(images.split(args.batch_size))
        expected, run_speed = score_all(run_model, batches)
        rows: list[dict[str, Any]] = [
            {"format": "run directory", "images_per_second": round(run_speed, 1), "max_abs_diff": 0.0}
        ]
        for fmt in args.formats.split(","):
            path = work / f"model.{SUFFIX[fmt]}"
            start = time.perf_counter()
            try:
                export_run(run_dir, path, fmt=fmt, ptm_weights=args.ptm_weights)
            except DependencyError as exc:
                rows.append({"format": fmt, "skipped": str(exc)})
                continue
            export_seconds = time.perf_counter() - start
            scores, speed = score_all(load_model(path, trust_code=True), batches)  # exported just above
            rows.append(
                {
                    "format": fmt,
                    "max_abs_diff": float((scores - expected).abs().max()),
                    "top1_agreement": float((scores.argmax(1) == expected.argmax(1)).float().mean() * 100),
                    "megabytes": round(path.stat().st_size / 2**20, 1),
                    "export_seconds": round(export_seconds, 1),
                    "images_per_second": round(speed, 1),
                }
            )
    report = {
        "run_dir": str(run_dir),
        "num_images": len(paths),
        "num_classes": len(run_model.class_names),
        "num_stages": run_model.num_stages,
        "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{report['num_images']} images, {report['num_classes']} classes, {report['num_stages']} stages, "
        f"batch {args.batch_size}, {report['threads']} threads"
    )
    print("| format | max abs Δscore | top-1 agreement (%) | MiB | export (s) | images/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['format']} | skipped: {r['skipped']} | | | | |")
            continue
        agreement = f"{r['top1_agreement']:.2f}" if "top1_agreement" in r else "-"
        print(
            f"| {r['format']} | {r['max_abs_diff']:.2e} | {agreement} | {r.get('megabytes', '-')} | "
            f"{r.get('export_seconds', '-')} | {r['images_per_second']} |"
        )


if __name__ == "__main__":
    main()
