"""The benchmark's report: each variant's results row, the mean ± std over class orders, the markdown tables, the accuracy
plot, and ``results.json``/``results.md``/``accuracy.png`` in the output folder."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from .. import jsonio, storage
from ..config import RunConfig
from ..methods import schedule_of
from ..metrics import AccuracyReport, summarize_history
from ..run.load import LoadedRun
from ..run.records import history_of, passes_record, train_metrics
from ..run.track import tied_track
from .variants import Variant

SUMMARY_KEYS = (
    "average",
    "last",
    "mean_forgetting",
    "train_seconds",
    "learn_seconds",
    "passes_per_image",
    "inference_ms_per_image",
)


def mean_std(values: list[float | None]) -> dict[str, float | None]:
    """Mean and sample standard deviation (n − 1; 0 for one value); None when a value is missing."""
    if not values or any(v is None for v in values):
        return {"mean": None, "std": None}
    return {
        "mean": round(statistics.fmean(values), 4),
        "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
    }


def aggregate(reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One report over class orders: per variant, mean ± std of Ā, A_T, forgetting, times and each A_t;
    every order's own results kept under ``per_seed``."""
    seeds = list(reports)
    first = reports[seeds[0]]
    summary = [_across_seeds(row, [_row_of(reports[seed], row["label"]) for seed in seeds]) for row in first["results"]]
    protocol = {k: v for k, v in first["protocol"].items() if k not in ("seed", "class_order")}
    return {
        "protocol": {
            **protocol,
            "seeds": seeds,
            "class_orders": {str(seed): reports[seed]["protocol"]["class_order"] for seed in seeds},
        },
        "summary": summary,
        "per_seed": {str(seed): reports[seed]["results"] for seed in seeds},
        "wall_seconds": round(sum(r["wall_seconds"] for r in reports.values()), 1),
    }


def _row_of(report: dict[str, Any], label: str) -> dict[str, Any]:
    return next(r for r in report["results"] if r["label"] == label)


def _across_seeds(row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's row over the orders: mean ± std of each figure and of each A_t they all have."""
    num_stages = min(len(r["accuracy"]) for r in rows)
    return {
        "label": row["label"],
        "method": row["method"],
        "num_seeds": len(rows),
        **{key: mean_std([r.get(key) for r in rows]) for key in SUMMARY_KEYS},
        "accuracy": [mean_std([r["accuracy"][t] for r in rows]) for t in range(num_stages)],
    }


# ------------------------------------------------------------------------------- rows


def summary_row(label: str, variant: Variant, loaded: LoadedRun, config: RunConfig, seconds_per_image: float) -> dict:
    """A variant's results row: A_t, Ā, forgetting, parameters, bytes and times from its loaded run
    (its stage metadata checked by ``check_stage_meta``)."""
    run, metas = loaded.run, loaded.stage_metas
    history = history_of(metas)
    train = [train_metrics(m).get("seconds", 0.0) for m in metas]
    learn = [m["metrics"].get("learn_seconds") for m in metas]  # None: a stage from before learn_seconds
    return {
        "label": label,
        "method": variant.method,
        "run_dir": str(run.path),
        "config": config.to_dict(),
        "accuracy": history.accuracy,
        "average": history.average,
        "last": history.last,
        "forgetting": history.forgetting,
        "mean_forgetting": history.mean_forgetting,
        "final_groups": (metas[-1]["metrics"]["eval"] or {}).get("groups", {}),
        "params_per_stage": [m["num_params"] for m in metas],
        "bytes_per_stage": _stage_bytes(loaded, config),
        "train_seconds": round(sum(train), 2),
        "stage_train_seconds": [round(s, 2) for s in train],
        # SGD, feature pass and fit, without evaluation: comparable between methods (train_seconds is
        # the SGD alone for a method that trains, the feature pass and fit for one that does not)
        "learn_seconds": None if None in learn else round(sum(learn), 2),
        "stage_learn_seconds": [None if s is None else round(s, 2) for s in learn],
        # forward passes per training image the learning cost (stage/cost.py; None: a stage from before them)
        **_passes(metas),
        "inference_ms_per_image": round(1000 * seconds_per_image, 3),
        "num_stages": len(metas),
    }


def _passes(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's forward passes per training image, and each stage's (``metrics.passes``)."""
    stages = [passes_record(m) for m in metas]
    images = [sum(m["images_per_class"].values()) for m in metas]
    total = None
    if stages and None not in stages:
        total = round(sum(p["per_image"] * n for p, n in zip(stages, images)) / max(1, sum(images)), 2)
    return {"passes_per_image": total, "stage_passes": [None if p is None else p["per_image"] for p in stages]}


def _stage_bytes(loaded: LoadedRun, config: RunConfig) -> list[int]:
    """Each stage's bytes on disk; a switched run's with its frozen track's stage (``run/track.py``)."""
    run, manifest = loaded.run, loaded.manifest
    sizes = [run.stage_bytes(i, manifest) for i in run.stage_indices(manifest)]
    if not schedule_of(config).switches:
        return sizes
    track, held, _ = tied_track(run, manifest, loaded.stage_metas, classes=False)
    return [size + track.stage_bytes(i, held) for size, i in zip(sizes, run.stage_indices(manifest), strict=True)]


def rescored_row(row: dict[str, Any], text: str, options: dict[str, Any], reports: list[AccuracyReport]) -> dict:
    """``row`` scored again with other options (``text``: as given to --rescore)."""
    history = summarize_history(reports)
    return {
        **row,
        "label": f"{row['label']} [score {text}]",
        "rescored_from": row["label"],
        "config": {**row["config"], "score": {**row["config"]["score"], **options}},
        "accuracy": history.accuracy,
        "average": history.average,
        "last": history.last,
        "forgetting": history.forgetting,
        "mean_forgetting": history.mean_forgetting,
        "final_groups": reports[-1].groups,
    }


# ------------------------------------------------------------------------------- tables


def markdown_table(report: dict[str, Any]) -> str:
    if "summary" in report:
        return seeds_markdown(report)
    results = report["results"]
    num_stages = max((r["num_stages"] for r in results), default=0)
    head = ["variant", "Ā", "A_T", "forgetting"] + [f"A_{t}" for t in range(1, num_stages + 1)]
    head += ["params/stage", "learn s", "passes/img", "infer ms/img"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        params = r["params_per_stage"]
        row = [
            f"`{r['label']}`",
            _fmt(r["average"]),
            _fmt(r["last"]),
            _fmt(r["mean_forgetting"]),
            *[_fmt(a) for a in r["accuracy"]],
            per_stage(params),
            _fmt(r.get("learn_seconds"), 0),
            _fmt(r.get("passes_per_image"), 1),
            f"{r['inference_ms_per_image']:.1f}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines + cost_lines(results, num_stages)) + "\n"


def cost_lines(results: list[dict[str, Any]], num_stages: int) -> list[str]:
    """Each variant's learn seconds, forward passes per image and MiB read at every stage, and the run
    directory's MiB after it (the stages' newest statistics are stored with the newest stage), side by side;
    "-" where this command did not learn the stage."""
    if not any(r.get("stage_learn_seconds") for r in results):
        return []
    head = ["learn s (passes/img; MiB read; run MiB)"] + [f"stage {t}" for t in range(1, num_stages + 1)]
    lines = ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        seconds, passes = r.get("stage_learn_seconds") or [], r.get("stage_passes") or []
        read = r.get("stage_read_mib") or []
        sizes = r.get("stage_stored_mib") or []
        cells = [
            f"{_fmt(s, 0)} ({_fmt(p, 1)}; {_fmt(m, 1)}; {_fmt(z, 1)})"
            for s, p, m, z in itertools.zip_longest(seconds, passes, read, sizes)
        ]
        lines.append("| " + " | ".join([f"`{r['label']}`", *cells]) + " |")
    return lines


def per_stage(values: list[int]) -> str:
    """Stage 1's value, then each later stage's, in stage order ("a/b/c"); one value when every stage
    has the same."""
    if not values:
        return "0"
    return "/".join(f"{v:,}" for v in (values[:1] if len(set(values)) == 1 else values))


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pm(stat: dict[str, float | None], digits: int = 2) -> str:
    if stat["mean"] is None:
        return "–"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def seeds_markdown(report: dict[str, Any]) -> str:
    """Mean ± std over class orders per variant, then every order's Ā / A_T / forgetting."""
    seeds = report["protocol"]["seeds"]
    lines = [
        f"Mean ± std (sample, n − 1) over {len(seeds)} class orders (seeds {', '.join(map(str, seeds))}).",
        "",
        "| variant | Ā | A_T | forgetting | learn s | passes/img | infer ms/img |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["summary"]:
        learn = r.get("learn_seconds") or {"mean": None}
        passes = r.get("passes_per_image") or {"mean": None}
        cells = [_pm(r["average"]), _pm(r["last"]), _pm(r["mean_forgetting"]), _pm(learn, 0), _pm(passes, 1)]
        lines.append(f"| `{r['label']}` | " + " | ".join([*cells, _pm(r["inference_ms_per_image"], 1)]) + " |")
    lines += ["", "| variant | seed | Ā | A_T | forgetting | learn s | passes/img |", "|---|---|---|---|---|---|---|"]
    for r in report["summary"]:
        for seed in seeds:
            row = next(x for x in report["per_seed"][str(seed)] if x["label"] == r["label"])
            cells = [_fmt(row["average"]), _fmt(row["last"]), _fmt(row["mean_forgetting"])]
            lines.append(
                f"| `{r['label']}` | {seed} | "
                + " | ".join([*cells, _fmt(row.get("learn_seconds"), 0), _fmt(row.get("passes_per_image"), 1)])
                + " |"
            )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------- plot


def plot(report: dict[str, Any], path: Path) -> bool:
    """Accuracy vs stage; False when matplotlib (the ``plot`` extra) is not installed."""
    from ..errors import DependencyError
    from ..plots import pyplot

    try:
        plt = pyplot(purpose="the benchmark plot")
    except DependencyError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    classes = np.cumsum(report["protocol"]["stages"])
    p = report["protocol"]
    if "summary" in report:  # mean ± std band over class orders
        for r in report["summary"]:
            mean = np.array([a["mean"] for a in r["accuracy"]])
            std = np.array([a["std"] for a in r["accuracy"]])
            x = classes[: len(mean)]
            (line,) = ax.plot(x, mean, marker="o", label=f"{r['label']} (Ā {_pm(r['average'])})")
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
        ax.set_title(f"{p['split']}, mean ± std over seeds {', '.join(map(str, p['seeds']))}, {p['ptm']}")
    else:
        for r in report["results"]:
            ax.plot(
                classes[: len(r["accuracy"])], r["accuracy"], marker="o", label=f"{r['label']} (Ā {_fmt(r['average'])})"
            )
        ax.set_title(f"{p['split']}, seed {p['seed']}, {p['ptm']}")
    ax.set_xlabel("classes seen")
    ax.set_ylabel("top-1 on all seen classes (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -------------------------------------------------------------------------------- files


def write_reports(report: dict[str, Any], out: Path) -> dict[str, str | None]:
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, str | None] = {}
    json_path, md_path, png_path = out / "results.json", out / "results.md", out / "accuracy.png"
    atomic_write(json_path, jsonio.dumps(report, indent=2) + "\n")
    paths["results_json"] = str(json_path)
    atomic_write(md_path, markdown_table(report))
    paths["results_md"] = str(md_path)
    paths["plot"] = str(png_path) if plot(report, png_path) else None
    return paths


def atomic_write(path: Path, text: str) -> None:
    storage.write_atomic(path, text.encode())
