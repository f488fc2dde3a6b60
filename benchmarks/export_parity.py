"""Export parity: every export format against the run directory, on the same preprocessed images.

    python benchmarks/export_parity.py                       # a fresh offline run on the tiny random ViT
    python benchmarks/export_parity.py --images 64 \\
        --ptm-weights ../shared/data/deit_tiny_patch16_224/deit_tiny_patch16_224.safetensors   # DeiT-Tiny
    python benchmarks/export_parity.py RUN_DIR --caltech ../shared/data/caltech101 --images 200 \\
        --ptm-weights ../shared/data/deit_tiny_patch16_224/deit_tiny_patch16_224.safetensors
    python benchmarks/export_parity.py RUN_DIR --sources some/folder list.txt

Without RUN_DIR it makes a fresh run in a temporary folder: two stages of generated images, one
epoch each, on the tiny random ViT, or on DeiT-Tiny when ``--ptm-weights`` is given (offline both).

For each format (drl, torchscript, pt2, onnx) it exports the run (which only reads the run), loads
the file as ``drl predict --model`` does and scores the images; then it times the run's own model
(``api.load_run``) and every loaded export side by side in this one process, on the same
preprocessed batches (decoding excluded), one CPU thread unless ``--threads`` says otherwise, in
``--rounds`` interleaved rounds (the best round of each counts). It prints max |Δscore| and top-1
agreement against the run, file size, export time, images/s and the run's speed over the format's
(``slowdown``: 1.10 means the export takes 10% longer than the run directory's model). ``--json``
prints the rows as one JSON object. ONNX is skipped, with a note, without the export extra.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from drlcli.commands.export import FORMATS, export_run
from drlcli.commands.predict import expand_sources
from drlcli.data.decode import load_rgb
from drlcli.data.loading import eval_transform
from drlcli.errors import DependencyError
from drlcli.run.load import load_run
from drlcli.serving.formats import load_model
from drlcli.serving.modelfile import FORMAT_SUFFIX

DEIT_TINY = "deit_tiny_patch16_224"
TARGET_SLOWDOWN = 1.1  # issue 17: every format within 1.1x of the run directory's speed


def caltech_images(root: Path, limit: int) -> list[Path]:
    """``limit`` test images spread evenly over Caltech-101's test list (BACKGROUND_Google left out)."""
    lines = [line for line in (root / "test.txt").read_text().split() if not line.startswith("BACKGROUND_Google")]
    step = max(1, len(lines) // limit)
    return [root / "101_ObjectCategories" / line for line in lines[::step][:limit]]


def fresh_run(work: Path, ptm_weights: Path | None, images: int) -> tuple[Path, list[Path]]:
    """A two-stage run on generated images: the tiny random ViT, or DeiT-Tiny from ``ptm_weights``."""
    from drlcli import learn_stage
    from drlcli.commands.init import init_run
    from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_stages

    per_class = max(4, -(-images // 6))  # 2 stages x 3 classes; enough test images for --images
    stages = make_stages(work / "data", num_stages=2, classes_per_stage=3, train=8, test=per_class)
    run = work / "run"
    if ptm_weights is None:
        init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS)
    else:
        init_run(run, ptm=DEIT_TINY, ptm_weights=ptm_weights)
    for train, _ in stages:
        learn_stage(run, data_dir=train, train_overrides={"epochs": 1, "batch_size": 12}, device="cpu")
    return run, sorted(p for _, test in stages for p in test.rglob("*.png"))


def timed(model: Any, batches: list[torch.Tensor]) -> float:
    """Seconds to score every batch once."""
    start = time.perf_counter()
    for batch in batches:
        model.score_images(batch)
    return time.perf_counter() - start


def side_by_side(models: dict[str, Any], batches: list[torch.Tensor], rounds: int) -> dict[str, float]:
    """images/s of each model: ``rounds`` interleaved rounds over the same batches, the best one counts."""
    best = dict.fromkeys(models, float("inf"))
    with torch.inference_mode():
        for model in models.values():  # warm-up: first-call costs (allocation, graph specialisation)
            model.score_images(batches[0])
        for _ in range(rounds):
            for name, model in models.items():
                best[name] = min(best[name], timed(model, batches))
    count = sum(len(b) for b in batches)
    return {name: count / seconds for name, seconds in best.items()}


def export_rows(run_dir: Path, work: Path, formats: list[str], ptm_weights: Path | None, batches, expected):
    """Export and load each format; rows with parity, size and export time, and the loaded models."""
    rows, models = [], {}
    for fmt in formats:
        path = work / f"model{FORMAT_SUFFIX[fmt]}"
        start = time.perf_counter()
        try:
            export_run(run_dir, path, fmt=fmt, ptm_weights=ptm_weights)
        except DependencyError as exc:
            rows.append({"format": fmt, "skipped": str(exc)})
            continue
        export_seconds = time.perf_counter() - start
        models[fmt] = load_model(path, trust_code=True)  # exported just above
        with torch.inference_mode():
            scores = torch.cat([models[fmt].score_images(b).float().cpu() for b in batches])
        rows.append(
            {
                "format": fmt,
                "max_abs_diff": float((scores - expected).abs().max()),
                "top1_agreement": float((scores.argmax(1) == expected.argmax(1)).float().mean() * 100),
                "megabytes": round(path.stat().st_size / 2**20, 1),
                "export_seconds": round(export_seconds, 1),
            }
        )
    return rows, models


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", type=Path, help="run directory (default: a fresh run, see above)")
    parser.add_argument("--sources", nargs="*", default=[], help="image files, folders or .txt lists (with RUN_DIR)")
    parser.add_argument("--caltech", type=Path, help="Caltech-101 folder: take --images images of test.txt")
    parser.add_argument("--images", "--limit", dest="images", type=int, default=200, help="subset size")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--ptm-weights", type=Path, help=f"PTM weights: a fresh run on {DEIT_TINY}, or RUN_DIR's")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (the best counts)")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="drl-parity-") as tmp:
        work = Path(tmp)
        if args.run_dir is None:
            run_dir, paths = fresh_run(work, args.ptm_weights, args.images)
        else:
            run_dir = args.run_dir
            paths = caltech_images(args.caltech, args.images) if args.caltech else expand_sources(args.sources)
        paths = paths[: args.images]
        run_model = load_run(run_dir, device="cpu", ptm_weights=args.ptm_weights).model
        transform = eval_transform(run_model.data_config)
        images = torch.stack([transform(load_rgb(p)) for p in paths])  # (N, 3, H, W), preprocessed once
        batches = list(images.split(args.batch_size))
        with torch.inference_mode():
            expected = torch.cat([run_model.score_images(b).float().cpu() for b in batches])
        rows, models = export_rows(run_dir, work, args.formats.split(","), args.ptm_weights, batches, expected)
        speeds = side_by_side({"run directory": run_model, **models}, batches, args.rounds)
    rows.insert(0, {"format": "run directory", "max_abs_diff": 0.0})
    for row in rows:
        if row["format"] in speeds:
            row["images_per_second"] = round(speeds[row["format"]], 1)
            row["slowdown"] = round(speeds["run directory"] / speeds[row["format"]], 3)
    report = {
        "run_dir": str(run_dir) if args.run_dir else f"fresh ({DEIT_TINY if args.ptm_weights else 'tiny ViT'})",
        "ptm": run_model.network.ptm.__class__.__name__,
        "input_size": list(run_model.data_config["input_size"]),
        "num_images": len(paths),
        "num_classes": len(run_model.class_names),
        "num_stages": run_model.num_stages,
        "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "torch": torch.__version__,
        "within_target": all(r.get("slowdown", 0) <= TARGET_SLOWDOWN for r in rows if "skipped" not in r),
        "rows": rows,
    }
    print(json.dumps(report, indent=2) if args.json else table(report))


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['run_dir']}, input {report['input_size']}: {report['num_images']} images, "
        f"{report['num_classes']} classes, {report['num_stages']} stages, batch {report['batch_size']}, "
        f"{report['threads']} thread(s), best of {report['rounds']} interleaved rounds, torch {report['torch']}",
        "| format | max abs Δscore | top-1 agreement (%) | MiB | export (s) | images/s | slowdown vs run |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['format']} | skipped: {r['skipped']} | | | | | |")
            continue
        agreement = f"{r['top1_agreement']:.2f}" if "top1_agreement" in r else "-"
        lines.append(
            f"| {r['format']} | {r['max_abs_diff']:.2e} | {agreement} | {r.get('megabytes', '-')} | "
            f"{r.get('export_seconds', '-')} | {r['images_per_second']} | {r['slowdown']:.2f}x |"
        )
    lines.append(f"every format within {TARGET_SLOWDOWN}x of the run directory: {report['within_target']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
