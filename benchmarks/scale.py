"""A year of daily drops, simulated (issue 33): the real init / learn-stage / eval / export / predict
on a long run of a randomly initialised ViT of ViT-B width, measuring how each cost grows.

    python benchmarks/scale.py --out /tmp/scale                       # 100 stages of 10 classes, d 768
    python benchmarks/scale.py --out /tmp/scale --stages 12 --json scale.json
    python benchmarks/scale.py --out /tmp/scale --stages 0 --thousand  # one stage of 1,000 classes only
    python benchmarks/scale.py --out /tmp/scale --stages 100 --paired 5  # and stage 10 against 100, turn about

The PTM is ``vit_base_patch16_224``'s shape (d 768, 12 blocks, 12 heads) on 32 x 32 generated
images with 16 x 16 patches (4 patch tokens: the 2 x 2 layout of the default head still fits), so
the PTM pass is cheap and what grows with the run shows. The run is the default ``drl`` (ridge head
with M 3000, the 2 x 2 layout and class covariances), learned through ``drlcli``'s own API in this
process, one stage after another. Per stage it prints the learn time split into the feature pass
(prototypes, calibration) and the head's fit (``stage.json``: the ridge's own seconds, which include
reading the earlier stages' statistics), the bytes this process read and wrote during learn-stage
(``/proc/self/io`` rchar / wchar: every read and write call, page cache or not), the run directory's
size and the process's peak RSS so far. At the end: ``eval --all-seen``, a ``.drl`` export and its
size, ``predict`` from it, and the default head's cost per image against a bare ViT-B/16 forward at
224 x 224 (random weights), timed side by side, interleaved. Then it fits each growth (least
squares, linear and quadratic in the stage index) and extrapolates to 365 stages and 3,650 classes;
the export by the line through its size at a tenth of the stages (exported then too) and at the end,
so its fixed part (R, the pooled scatters) is not scaled with the classes.

``--thousand`` also learns one stage of 1,000 classes in a fresh run (time and peak memory stated).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import timm
import torch

from drlcli import evaluate, export_run, init_run, learn_stage, load_model
from drlcli.api import predict_sources
from drlcli.benchmark.runner import io_bytes
from drlcli.config import RunConfig
from drlcli.run.directory import RunDir
from drlcli.synthetic import make_class_folders

PTM = "vit_base_patch16_224"
PTM_KWARGS = {"img_size": 32, "patch_size": 16}
YEAR_STAGES, YEAR_CLASSES = 365, 3650


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def make_drop(root: Path, first_class: int, classes: int, images: int) -> Path:
    return make_class_folders(root, list(range(first_class, first_class + classes)), images_per_class=images)


def learn_one(run: Path, data: Path, index: int) -> dict[str, float]:
    """learn-stage of one drop, with what it cost."""
    read0, written0 = io_bytes()
    tick = time.perf_counter()
    learn_stage(run, data_dir=data, device="cpu")
    seconds = time.perf_counter() - tick
    read1, written1 = io_bytes()
    meta = RunDir(run).stage_meta(index)
    fit = float(meta.get("ridge", {}).get("seconds", 0.0))
    learn = float(meta["metrics"]["learn_seconds"])
    return {
        "stage": index,
        "seconds": round(seconds, 3),
        "feature_pass": round(learn - fit, 3),  # the stage's images through the PTM, prototypes, calibration
        "head_fit": round(fit, 3),  # the ridge's fit: reading earlier statistics, summing, λ, solve, covariances
        "read_mib": (read1 - read0) / 2**20,
        "written_mib": (written1 - written0) / 2**20,
        "run_mib": dir_bytes(run) / 2**20,
        "peak_rss_mib": peak_rss_mib(),
    }


def fit_growth(xs: list[float], ys: list[float], at: float) -> dict[str, float]:
    """Least-squares fits y = a + b·x and y = a + b·x + c·x², each evaluated at ``at``."""
    out = {}
    for degree in (1, 2):
        if len(xs) > degree:
            coef = np.polyfit(xs, ys, degree)
            out[f"deg{degree}"] = float(np.polyval(coef, at))
    return out


def predict_peak_rss(model: Path, pictures: list[str]) -> float:
    """Peak RSS (MiB) of ``drl predict --model MODEL`` on ``pictures`` in a process of its own: the
    child's own VmHWM at exit (a forked child's ru_maxrss can count the parent's pages it shared
    before exec), its ru_maxrss where /proc is missing."""
    report = (
        "import atexit, pathlib, resource, runpy, sys\n"
        "def peak():\n"
        "    status = pathlib.Path('/proc/self/status')\n"
        "    lines = status.read_text().splitlines() if status.exists() else []\n"
        "    kib = next((int(l.split()[1]) for l in lines if l.startswith('VmHWM:')), None)\n"
        "    kib = kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "    print(f'peak-rss-kib {kib}', file=sys.stderr)\n"
        "atexit.register(peak)\n"
        "sys.argv = ['drl', *sys.argv[1:]]\n"
        "runpy.run_module('drlcli', run_name='__main__')\n"
    )
    command = [sys.executable, "-c", report, "predict", "--model", str(model), *pictures, "--device", "cpu", "-q"]
    done = subprocess.run(
        command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    kib = [int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("peak-rss-kib ")]
    return kib[-1] / 1024


def head_cost(model_path: Path, repeats: int, reference: str) -> dict[str, float]:
    """The exported model's head on random features against a bare forward of ``reference`` (ViT-B/16
    at its own 224 x 224), batch 16."""
    model = load_model(model_path)
    vit = timm.create_model(reference, pretrained=False, num_classes=0).eval()
    images = torch.randn(16, 3, *vit.patch_embed.img_size, generator=torch.Generator().manual_seed(0))
    width = model.network.width
    rows = 1 + model.layout_scored**2
    features = torch.randn(16, rows, width, generator=torch.Generator().manual_seed(1))
    head_times, bare_times = [], []
    with torch.inference_mode():
        for _ in range(repeats):  # interleaved: other load on a shared machine hits both alike
            tick = time.perf_counter()
            model.head(features)
            head_times.append(time.perf_counter() - tick)
            tick = time.perf_counter()
            vit.forward_features(images)
            bare_times.append(time.perf_counter() - tick)
    head, bare = min(head_times), min(bare_times)
    return {"head_ms_per_image": 1000 * head / 16, "reference_ms_per_image": 1000 * bare / 16, "ratio": head / bare}


def _init_frozen(run: Path, args) -> None:
    """A run of the frozen head (``drl --preset frozen``), whose costs this script measures."""
    init_run(
        run,
        ptm=args.ptm,
        random_init=True,
        ptm_kwargs=args.ptm_kwargs,
        config=RunConfig.for_method("drl", preset="frozen"),
    )


def year_run(args, out: Path, log) -> dict:
    run, data = out / "run", out / "data"
    _init_frozen(run, args)
    base = dir_bytes(run)  # the run's PTM weights (random, so stored in the run) and records
    rows = []
    early = max(1, args.stages // 10)  # an export here too: the export's fixed and per-class parts
    result: dict = {}
    for t in range(1, args.stages + 1):
        drop = make_drop(data / f"stage{t:03d}", (t - 1) * args.classes, args.classes, args.images)
        row = learn_one(run, drop, t)
        row["stages_mib"] = row["run_mib"] - base / 2**20  # what the stages added
        shutil.rmtree(drop)  # the images are gone by the next drop, as in production
        rows.append(row)
        log(
            f"stage {t:3d}: {row['seconds']:7.1f} s (features {row['feature_pass']:6.1f}, head fit "
            f"{row['head_fit']:6.1f}), read {row['read_mib']:8.1f} MiB, wrote {row['written_mib']:7.1f} MiB, "
            f"stages {row['stages_mib']:8.1f} MiB, peak RSS {row['peak_rss_mib']:7.0f} MiB"
        )
        if t == early and t < args.stages:
            at = export_run(run, out / "model_early.drl")
            result["early_export"] = {"classes": t * args.classes, "mib": at.bytes / 2**20}
            if args.paired:
                shutil.copytree(run, out / "run_early")  # learned again at the end, beside the last stage
    result["stages"] = rows
    if not rows:
        return result
    test = make_drop(data / "test", 0, args.stages * args.classes, 1)
    tick = time.perf_counter()
    evaluate(run, data_dir=test, device="cpu")
    result["eval_seconds"] = time.perf_counter() - tick
    tick = time.perf_counter()
    exported = export_run(run, out / "model.drl")
    result["export"] = {"seconds": time.perf_counter() - tick, "mib": exported.bytes / 2**20}
    pictures = sorted(str(p) for p in test.rglob("*.png"))[:64]
    tick = time.perf_counter()
    answered = list(predict_sources(pictures, model_path=Path(exported.path), device="cpu"))
    result["predict"] = {"images": len(answered), "seconds": time.perf_counter() - tick}
    result["predict"]["process_peak_rss_mib"] = predict_peak_rss(Path(exported.path), pictures)
    result["head_cost"] = head_cost(Path(exported.path), args.repeats, args.reference)
    xs = [r["stage"] for r in rows]
    result["extrapolated_to_365"] = {
        key: fit_growth(xs, [r[key] for r in rows], YEAR_STAGES)
        for key in ("head_fit", "feature_pass", "read_mib", "written_mib", "stages_mib")
    }
    classes = [r["stage"] * args.classes for r in rows]
    # the export and the head's per-image cost grow with the classes: "proportional" scales all of it
    # from the last stage (an upper bound); "two_exports" is the line through the early export and the last
    ptm_mib = base / 2**20  # the export holds the same PTM weights: only the rest grows
    result["base_mib"] = ptm_mib
    grown = result["export"]["mib"] - ptm_mib
    extrapolated = {"proportional": grown * YEAR_CLASSES / classes[-1]}
    if "early_export" in result:
        first = result["early_export"]
        per_class = (result["export"]["mib"] - first["mib"]) / (classes[-1] - first["classes"])
        extrapolated["two_exports"] = grown + per_class * (YEAR_CLASSES - classes[-1])
        extrapolated["per_class_kib"] = per_class * 1024
    result["extrapolated_to_365"]["export_mib_beyond_ptm"] = extrapolated
    result["extrapolated_to_365"]["head_ratio"] = {"linear": result["head_cost"]["ratio"] * YEAR_CLASSES / classes[-1]}
    if args.paired and (out / "run_early").is_dir():
        result["paired"] = paired(out / "run_early", run, args, out, log)
    return result


def paired(early: Path, late: Path, args, out: Path, log) -> dict:
    """One more drop learned on a copy of the run at an early stage and on a copy at its last, turn
    about, ``args.paired`` times each: the ratio of their learn time without the feature pass, each
    pair measured under the same load (the per-stage rows above were minutes apart)."""
    rows: dict[str, list[dict]] = {"early": [], "late": []}
    drop = make_drop(out / "data_paired", 10**6, args.classes, args.images)  # classes neither run has
    for repeat in range(args.paired):
        for name, source in (("early", early), ("late", late))[:: 1 if repeat % 2 == 0 else -1]:
            copy = out / f"paired_{name}"
            shutil.copytree(source, copy)
            os.sync()  # the copy's writeback does not fall inside the timing
            index = max(RunDir(copy).stage_indices()) + 1
            row = learn_one(copy, drop, index)
            row["without_features"] = row["seconds"] - row["feature_pass"]
            rows[name].append(row)
            shutil.rmtree(copy)
    shutil.rmtree(drop)
    result = {"repeats": args.paired, "stages": {n: rows[n][0]["stage"] for n in rows}, "rows": rows}
    for key in ("without_features", "head_fit", "feature_pass"):
        early_s = statistics.median(r[key] for r in rows["early"])
        late_s = statistics.median(r[key] for r in rows["late"])
        ratios = [b[key] / max(a[key], 1e-9) for a, b in zip(rows["early"], rows["late"])]
        result[key] = {"early": early_s, "late": late_s, "median_ratio": statistics.median(ratios), "ratios": ratios}
    summary = {k: v for k, v in result.items() if k != "rows"}
    log(f"paired, stage {result['stages']['early']} and {result['stages']['late']}: {json.dumps(summary)}")
    return result


def thousand(args, out: Path, log) -> dict:
    """One stage of 1,000 classes, in a fresh run."""
    run, data = out / "run1000", out / "data1000"
    _init_frozen(run, args)
    drop = make_drop(data, 0, 1000, 2)
    row = learn_one(run, drop, 1)
    tick = time.perf_counter()
    exported = export_run(run, out / "model1000.drl")
    row["export_seconds"] = time.perf_counter() - tick
    row["export_mib"] = exported.bytes / 2**20
    log(f"1,000 classes in one stage: {json.dumps(row)}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="scratch folder (default: a temporary one, deleted)")
    parser.add_argument("--stages", type=int, default=100)
    parser.add_argument("--classes", type=int, default=10, help="classes per stage")
    parser.add_argument("--images", type=int, default=4, help="training images per class")
    parser.add_argument("--repeats", type=int, default=5, help="timings of the head against the bare forward")
    parser.add_argument("--thousand", action="store_true", help="also one stage of 1,000 classes")
    parser.add_argument("--ptm", default=PTM, help="the run's PTM (random weights)")
    parser.add_argument("--ptm-kwargs", type=json.loads, default=PTM_KWARGS, help="its timm options (JSON)")
    parser.add_argument("--reference", default=PTM, help="the model whose bare forward the head is compared with")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--paired",
        type=int,
        default=0,
        help="also learn one more drop on the run at a tenth of its stages and at its last, N times each, turn about",
    )
    parser.add_argument(
        "--pair",
        type=Path,
        nargs=2,
        metavar=("EARLY_RUN", "LATE_RUN"),
        help="only --paired, on copies of these two runs",
    )
    args = parser.parse_args()

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    keep = args.out is not None
    out = args.out or Path(tempfile.mkdtemp(prefix="drl-scale-"))
    if keep and any(out.iterdir() if out.exists() else []):
        parser.error(f"--out {out} is not empty; pass a new folder")
    out.mkdir(parents=True, exist_ok=True)
    try:
        report = {"threads": torch.get_num_threads(), **vars(args)}
        report["out"] = str(out)
        report["json"] = str(args.json) if args.json else None
        if args.pair:
            report["paired"] = paired(*args.pair, args, out, log)
        else:
            report.update(year_run(args, out, log))
        if args.thousand:
            report["one_stage_of_1000"] = thousand(args, out, log)
    finally:
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
    print_summary(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")


def print_summary(report: dict) -> None:
    rows = report["stages"] if isinstance(report.get("stages"), list) else []  # (--pair: none)
    if rows:
        first, last = rows[min(9, len(rows) - 1)], rows[-1]
        print(f"\n{len(rows)} stages of {report['classes']} classes, {report['ptm']} {report['ptm_kwargs']}:")
        print(
            f"head fit, stage {last['stage']} / stage {first['stage']}: {last['head_fit'] / max(first['head_fit'], 1e-9):.2f}x"
        )
        print(
            f"bytes read, stage {last['stage']} / stage {first['stage']}: {last['read_mib'] / max(first['read_mib'], 1e-9):.2f}x"
        )
        print(
            f"run directory: {last['run_mib']:.1f} MiB ({last['stages_mib']:.1f} MiB of stages, the rest the PTM "
            f"and records); peak RSS {last['peak_rss_mib']:.0f} MiB"
        )
        print(
            f"export {report['export']['mib']:.1f} MiB ({report['base_mib']:.1f} MiB of it the PTM); head / ViT-B forward per image: {report['head_cost']['ratio']:.3f}; "
            f"predict's peak RSS {report['predict']['process_peak_rss_mib']:.0f} MiB"
        )
        print(
            f"median feature pass {statistics.median(r['feature_pass'] for r in rows):.1f} s, "
            f"median head fit {statistics.median(r['head_fit'] for r in rows):.1f} s"
        )
        print(
            f"extrapolated to {YEAR_STAGES} stages / {YEAR_CLASSES} classes: "
            + json.dumps(
                {k: {m: round(v, 1) for m, v in fits.items()} for k, fits in report["extrapolated_to_365"].items()}
            )
        )
    if "paired" in report:
        pair = report["paired"]
        print(
            f"paired, {pair['repeats']} times each: learn-stage without the feature pass at stage {pair['stages']['late']} "
            f"/ stage {pair['stages']['early']}: {pair['without_features']['median_ratio']:.2f}x, the median of "
            f"{' '.join(f'{r:.2f}' for r in pair['without_features']['ratios'])} "
            f"({pair['without_features']['late']:.1f} s against {pair['without_features']['early']:.1f} s; head fit "
            f"{pair['head_fit']['median_ratio']:.2f}x)"
        )
    if "one_stage_of_1000" in report:
        t = report["one_stage_of_1000"]
        print(
            f"1,000 classes in one stage: {t['seconds']:.0f} s, peak RSS {t['peak_rss_mib']:.0f} MiB, export {t['export_mib']:.1f} MiB"
        )


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
