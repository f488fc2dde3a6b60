"""``drl benchmark``: the B-m Inc-n protocol (SPEC §4) for several methods and variants on the same
data and class order, each in its own run directory, through the same library calls as the CLI.

Data: class folders (``train/`` and ``test/`` under one folder) or one class-folder tree plus
``train.txt``/``test.txt`` list files (Caltech-101's layout; ``--skip-class`` lines are dropped).
Class order: the sorted class names permuted with ``numpy.random.RandomState(seed)`` (what
LAMDA-PILOT does), so a seed gives the same order as there. Each stage's images become a folder of
symlinks under ``OUT/data``; each variant's run lives in ``OUT/runs/<variant>``. Re-running the same
command continues unfinished variants from their last committed stage and reuses finished ones.

A variant is ``method[/key=value...]``, e.g. ``drl/loss=ce``, ``drl/gate=sum``, ``ease/epochs=3``;
keys are config fields (``train.lr`` or just ``lr`` when the name is unique across sections).

Several class orders (``--seeds 1993,1994,1995``): each seed is the benchmark above in its own
``OUT/seed_<seed>/`` (resumed per seed), and ``OUT/results.{json,md}`` and the plot add the mean and
the sample standard deviation (n − 1) over the orders, per variant.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from . import api, distributed, jsonio
from .config import MAX_SEED, RunConfig, config_sections
from .data import ImageDataset, eval_transform, scan_class_folders
from .errors import DataError, UsageError
from .methods import method_of
from .metrics import AccuracyReport, accuracy_report, summarize_history
from .model import embed_images
from .prototypes import score, synthesize
from .rundir import RunDir

SECTIONS = config_sections()  # ipa, ease, ranpac, train, score
DEFAULT_METHODS = "drl,ease,simplecil"
ABLATIONS = "drl,drl/loss=ce,drl/kd_weight=0,drl/attention=none,drl/gate=sum,drl/rule=concat"


# ------------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    label: str
    method: str
    overrides: dict[str, dict[str, Any]]  # section -> field -> value

    def config(self, *, epochs: int | None, seed: int) -> RunConfig:
        sections = {name: dict(values) for name, values in self.overrides.items()}
        train = sections.setdefault("train", {})
        train.setdefault("seed", seed)
        if epochs is not None:
            train.setdefault("epochs", epochs)
        return RunConfig.for_method(self.method, sections)

    @property
    def dirname(self) -> str:
        return re.sub(r"[^A-Za-z0-9._=-]+", "_", self.label.replace("/", "__"))


def _resolve_key(key: str) -> tuple[str, str]:
    if "." in key:
        section, name = key.split(".", 1)
        if section in SECTIONS and name in {f.name for f in fields(SECTIONS[section])}:
            return section, name
        raise UsageError(f"unknown variant option {key!r}; use a config key such as train.lr or ipa.gate")
    owners = [s for s, cls in SECTIONS.items() if key in {f.name for f in fields(cls)}]
    if len(owners) == 1:
        return owners[0], key
    if not owners:
        raise UsageError(f"unknown variant option {key!r}; use a config key such as lr, loss, gate or rule")
    raise UsageError(f"variant option {key!r} is ambiguous; write it as one of {[f'{s}.{key}' for s in owners]}")


def parse_variant(text: str) -> Variant:
    """``method[/key=value...]`` -> Variant (values parsed as YAML scalars)."""
    parts = [p for p in text.strip().split("/") if p]
    if not parts:
        raise UsageError("empty --methods entry; use e.g. drl,ease,simplecil")
    method, overrides = parts[0], {}
    for part in parts[1:]:
        if "=" not in part:
            raise UsageError(f"variant option {part!r} in {text!r} is not KEY=VALUE; use e.g. drl/loss=ce")
        key, raw = part.split("=", 1)
        section, name = _resolve_key(key)
        overrides.setdefault(section, {})[name] = yaml.safe_load(raw)
    variant = Variant(text.strip(), method, overrides)
    variant.config(epochs=None, seed=0)  # validate now, before any work
    return variant


def parse_methods(text: str) -> list[Variant]:
    variants = [parse_variant(item) for item in text.split(",") if item.strip()]
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise UsageError(f"--methods lists a variant twice: {labels}")
    if not variants:
        raise UsageError("--methods is empty; use e.g. drl,ease,simplecil")
    return variants


def parse_score(text: str) -> dict[str, Any]:
    """``key=value[/key=value]`` over the score section, e.g. ``beta=0/rule=concat``."""
    out = {}
    for part in [p for p in text.split("/") if p]:
        if "=" not in part:
            raise UsageError(f"--rescore {text!r}: {part!r} is not KEY=VALUE; use e.g. beta=0 or rule=concat")
        key, raw = part.split("=", 1)
        section, name = _resolve_key(key if "." in key else f"score.{key}")
        if section != "score":
            raise UsageError(f"--rescore takes score options (rule, rho, beta, tau), not {key!r}")
        out[name] = yaml.safe_load(raw)
    RunConfig.for_method("drl", {"score": out})  # validate the values now
    return out


def parse_seeds(text: str) -> tuple[int, ...]:
    """``1993,1994,1995`` -> (1993, 1994, 1995)."""
    try:
        seeds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(
            f"--seeds {text!r} is not a comma-separated list of integers; use e.g. 1993,1994,1995"
        ) from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds {text!r} must list distinct integers, e.g. 1993,1994,1995")
    if not all(0 <= s <= MAX_SEED for s in seeds):
        raise UsageError(f"--seeds {text!r}: every seed must be in [0, {MAX_SEED}] (like --seed)")
    return seeds


def parse_split(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"B(\d+)Inc(\d+)", text.strip(), flags=re.IGNORECASE)
    if not match or int(match.group(2)) == 0:
        raise UsageError(f"--split {text!r} is not B<m>Inc<n> with n > 0; use e.g. B0Inc10 or B50Inc10")
    return int(match.group(1)), int(match.group(2))


# ----------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class BenchmarkData:
    """Image paths per class for train and test (list order kept)."""

    train: dict[str, list[Path]]
    test: dict[str, list[Path]]
    source: str


def _read_list(list_file: Path, images_root: Path, skip: set[str]) -> dict[str, list[Path]]:
    by_class: dict[str, list[Path]] = {}
    try:
        lines = list_file.read_text().split()
    except OSError as exc:
        raise DataError(f"cannot read list file {list_file}: {exc.strerror}; check the path") from exc
    except UnicodeDecodeError as exc:
        raise DataError(f"list file {list_file} is not UTF-8 text ({exc.reason}); fix the list file") from exc
    for line in lines:
        cls = line.split("/")[0]
        if cls in skip:
            continue
        if line.startswith("/") or ".." in Path(line).parts:
            raise DataError(
                f"{list_file}: line {line!r} points outside {images_root}; list paths relative to it as <class>/<file>"
            )
        if "/" not in line:
            raise DataError(f"{list_file}: line {line!r} is not <class>/<file>; fix the list file")
        by_class.setdefault(cls, []).append(images_root / line)
    missing = [p for paths in by_class.values() for p in paths if not p.is_file()]
    if missing:
        raise DataError(
            f"{len(missing)} image(s) listed in {list_file} are missing, e.g. {missing[0]}; "
            "fix the list or the image folder"
        )
    return by_class


def _read_folders(root: Path) -> dict[str, list[Path]]:
    images = scan_class_folders(root, what="benchmark data")
    out: dict[str, list[Path]] = {}
    for path, label in zip(images.paths, images.labels):
        out.setdefault(images.class_names[label], []).append(path)
    return out


def load_data(data_dir: Path, *, skip_classes: set[str]) -> BenchmarkData:
    """``data_dir`` holds train/ and test/ class folders, or train.txt, test.txt and one image tree."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"benchmark data {data_dir} is not a folder; pass --data DIR")
    if (data_dir / "train").is_dir() and (data_dir / "test").is_dir():
        train, test = _read_folders(data_dir / "train"), _read_folders(data_dir / "test")
        source = "class folders"
    elif (data_dir / "train.txt").is_file() and (data_dir / "test.txt").is_file():
        trees = [p for p in sorted(data_dir.iterdir()) if p.is_dir() and not p.name.startswith(".")]
        if len(trees) != 1:
            raise DataError(
                f"{data_dir} has train.txt/test.txt but {len(trees)} image folders; keep exactly one class-folder tree"
            )
        train = _read_list(data_dir / "train.txt", trees[0], skip_classes)
        test = _read_list(data_dir / "test.txt", trees[0], skip_classes)
        source = f"lists train.txt/test.txt over {trees[0].name}/"
    else:
        raise DataError(
            f"{data_dir} has neither train/ and test/ class folders nor train.txt and test.txt; "
            "see `drl benchmark --help` for the layouts"
        )
    train = {c: v for c, v in train.items() if c not in skip_classes}
    test = {c: v for c, v in test.items() if c not in skip_classes}
    if set(train) != set(test):
        odd = sorted(set(train) ^ set(test))
        raise DataError(f"train and test have different classes, e.g. {odd[:5]}; every class needs both")
    return BenchmarkData(train, test, source)


def class_order(classes: list[str], *, seed: int, shuffle: bool) -> list[str]:
    ordered = sorted(classes)
    if not shuffle:
        return ordered
    perm = np.random.RandomState(seed).permutation(len(ordered))
    return [ordered[i] for i in perm]


def stage_classes(order: list[str], base: int, inc: int) -> list[list[str]]:
    if base >= len(order):
        raise UsageError(f"B{base} needs more than {len(order)} classes; lower the base")
    first = base if base > 0 else inc
    stages = [order[:first]]
    for start in range(first, len(order), inc):
        stages.append(order[start : start + inc])
    return stages


def split_validation(data: BenchmarkData, fraction: float, seed: int) -> BenchmarkData:
    """Hold out ``fraction`` of each class's training images as the evaluation set (test unused)."""
    rng = np.random.RandomState(seed)
    train, val = {}, {}
    for cls, paths in data.train.items():
        idx = rng.permutation(len(paths))
        n_val = max(1, int(math.ceil(fraction * len(paths))))
        if n_val >= len(paths):
            raise DataError(f"class {cls} has {len(paths)} training images, too few for --val-fraction {fraction}")
        val[cls] = [paths[i] for i in sorted(idx[:n_val])]
        train[cls] = [paths[i] for i in sorted(idx[n_val:])]
    return BenchmarkData(train, val, data.source + f", validation split {fraction:g} of train")


def materialise(
    stages: list[list[str]],
    data: BenchmarkData,
    out: Path,
    *,
    max_train: int | None,
    max_test: int | None,
    write: bool = True,
) -> list[tuple[Path, Path]]:
    """Symlink each stage's images into OUT/data/stage_NN/{train,test}/<class>/ (idempotent);
    with ``write`` False only the folder names are returned."""
    folders = []
    for k, classes in enumerate(stages, 1):
        pair = []
        for split, source, cap in (("train", data.train, max_train), ("test", data.test, max_test)):
            root = out / f"stage_{k:02d}" / split
            pair.append(root)
            for cls in classes if write else []:
                folder = root / cls
                folder.mkdir(parents=True, exist_ok=True)
                wanted = {f"{i:05d}_{p.name}": p.resolve() for i, p in enumerate(source[cls][:cap])}
                for name, target in wanted.items():
                    link = folder / name
                    if link.is_symlink() and Path(link.readlink()) != target:
                        link.unlink()
                    if not link.is_symlink():
                        link.symlink_to(target)
                for stale in folder.iterdir():
                    if stale.name not in wanted:
                        stale.unlink()
        folders.append(tuple(pair))
    return folders


# ------------------------------------------------------------------------------- running


@dataclass(frozen=True)
class BenchmarkSettings:
    data_dir: Path
    out_dir: Path
    ptm: str
    ptm_weights: Path | None = None
    random_init: bool = False
    ptm_kwargs: dict[str, Any] | None = None
    split: str = "B0Inc10"
    seed: int = 1993
    shuffle: bool = True
    epochs: int | None = None
    max_train_per_class: int | None = None
    max_test_per_class: int | None = None
    val_fraction: float | None = None
    max_stages: int | None = None  # run only the first N stages of the protocol
    skip_classes: tuple[str, ...] = ("BACKGROUND_Google",)
    device: str = "auto"
    timing_batch: int = 32
    rescore: tuple[str, ...] = ()  # score options (e.g. "beta=0/rule=concat") also evaluated per run


def _timing(loaded: api.LoadedRun, test_dir: Path, batch: int) -> float:
    """Median seconds per image of network + scoring on one batch of test images (after 1 warm-up)."""
    model = loaded.model
    images = scan_class_folders(test_dir, what="timing images")
    dataset = ImageDataset(images, eval_transform(model.data_config))
    n = min(batch, len(dataset))
    device = model.device
    x = torch.stack([dataset[i][0] for i in range(n)]).to(device)
    times = []
    with torch.inference_mode():
        for _ in range(6):  # the first is a warm-up
            start = time.perf_counter()
            model.score_images(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the run's GPU, not the current one
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / n


def rescore(
    loaded: api.LoadedRun, test_dirs: list[Path], scores: list[dict[str, Any]]
) -> list[tuple[dict[str, Any], list[AccuracyReport]]]:
    """A_t after every stage under other scoring options, without retraining.

    Stage t's model is the final one restricted to the classes of stages 1..t and their
    subspaces: a subspace never depends on later stages, so this is exact (with the run's own
    options it reproduces the recorded A_t). One pass of the final network over the test images.
    """
    model = loaded.model
    index = model.class_index()
    feats, targets = [], []
    for test_dir in test_dirs[: model.num_stages]:
        images = scan_class_folders(test_dir, what="test data")
        f, y = embed_images(model.network, images, model.data_config, batch_size=api.EVAL_BATCH_SIZE)
        feats.append(f)
        targets.append(torch.tensor([index[name] for name in images.class_names])[y])
    features, target = torch.cat(feats), torch.cat(targets)
    stage_of = model.class_stage
    out = []
    for options in scores:
        cfg = dataclasses.replace(model.score_cfg, **options)
        reports = []
        for t in range(1, model.num_stages + 1):
            classes = stage_of <= t
            width = min(model.num_subspaces, model.offset + t)
            real = model.real_prototypes[classes][:, :width]
            bank = synthesize(real, stage_of[classes], tau=cfg.tau, offset=model.offset)
            rows = stage_of[target] <= t
            logits = score(
                features[rows][:, :width],
                bank,
                stage_of[classes],
                rule=cfg.rule,
                rho=cfg.rho,
                beta=cfg.beta,
                offset=model.offset,
            )
            # classes of stages <= t come first in the class list, so indices are unchanged
            reports.append(accuracy_report(logits.argmax(1), target[rows], stage_of, num_stages=t))
        out.append((options, reports))
    return out


def _check_protocol(path: Path, protocol: dict[str, Any], *, write: bool) -> None:
    """An --out folder holds one protocol: continuing it with other data or split would mix them."""
    if path.exists():
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path} is unreadable ({exc}); pass another --out") from exc
        changed = sorted(k for k in protocol if stored.get(k) != protocol[k])
        if changed:
            raise UsageError(
                f"--out {path.parent} holds a benchmark with other {', '.join(changed)}; "
                "pass another --out or the same options"
            )
    elif write:
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, jsonio.dumps(protocol, indent=2) + "\n")


def _summary(label: str, variant: Variant, run_dir: Path, config: RunConfig, seconds_per_image: float) -> dict:
    run = RunDir(run_dir)
    manifest = run.manifest()
    metas = [run.stage_meta(i, manifest) for i in run.stage_indices(manifest)]
    history = api.history_of(metas)
    forgetting = history.forgetting
    train = [(m["metrics"].get("train") or {}).get("seconds", 0.0) for m in metas]
    return {
        "label": label,
        "method": variant.method,
        "run_dir": str(run_dir),
        "config": config.to_dict(),
        "accuracy": history.accuracy,
        "average": history.average,
        "last": history.last,
        "forgetting": forgetting,
        "mean_forgetting": history.mean_forgetting,
        "final_groups": (metas[-1]["metrics"]["eval"] or {}).get("groups", {}),
        "params_per_stage": [m["num_params"] for m in metas],
        "bytes_per_stage": [run.size_bytes(manifest, prefix=f"stages/{i:03d}/") for i in run.stage_indices(manifest)],
        "train_seconds": round(sum(train), 2),
        "stage_train_seconds": [round(s, 2) for s in train],
        "inference_ms_per_image": round(1000 * seconds_per_image, 3),
        "num_stages": len(metas),
    }


def run_benchmark(
    settings: BenchmarkSettings,
    variants: list[Variant],
    *,
    progress: Callable[[api.Progress], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every variant over the same stages; write results.json, results.md and (if matplotlib) a plot."""
    say = log or (lambda _: None)
    base, inc = parse_split(settings.split)
    data = load_data(settings.data_dir, skip_classes=set(settings.skip_classes))
    if settings.val_fraction is not None:
        if not 0.0 < settings.val_fraction < 1.0:
            raise UsageError(f"--val-fraction must be in (0, 1), got {settings.val_fraction}")
        data = split_validation(data, settings.val_fraction, settings.seed)
    order = class_order(list(data.train), seed=settings.seed, shuffle=settings.shuffle)
    stages = stage_classes(order, base, inc)[: settings.max_stages]
    out = Path(settings.out_dir)
    main = distributed.is_main()  # under torchrun rank 0 alone writes files; all ranks train
    protocol = {
        "data": str(Path(settings.data_dir).resolve()),
        "split": settings.split,
        "seed": settings.seed,
        "shuffle": settings.shuffle,
        "max_train_per_class": settings.max_train_per_class,
        "max_test_per_class": settings.max_test_per_class,
        "val_fraction": settings.val_fraction,
        "skip_classes": sorted(settings.skip_classes),
        "ptm": settings.ptm,
    }
    _check_protocol(out / "protocol.json", protocol, write=main)
    folders = materialise(
        stages,
        data,
        out / "data",
        max_train=settings.max_train_per_class,
        max_test=settings.max_test_per_class,
        write=main,
    )
    distributed.barrier()
    score_options = [parse_score(text) for text in settings.rescore]
    results = []
    stages_run = 0
    started = time.perf_counter()
    for v_index, variant in enumerate(variants, 1):
        config = variant.config(epochs=settings.epochs, seed=settings.seed)
        run_dir = out / "runs" / variant.dirname
        done = 0
        distributed.barrier()  # a run rank 0 is about to create is not looked at half-made
        if (run_dir / "manifest.json").exists():
            run = RunDir(run_dir)
            stored = RunConfig.from_dict(run.run_config()["config"])
            if stored != config:
                raise UsageError(
                    f"{run_dir} was run with other settings for {variant.label}; pass another --out or remove it"
                )
            done = len(run.stage_indices())
        elif main:
            api.init_run(
                run_dir,
                ptm=settings.ptm,
                ptm_weights=settings.ptm_weights,
                random_init=settings.random_init,
                ptm_kwargs=settings.ptm_kwargs,
                config=config,
                seed=settings.seed,
            )
        for k in range(done, len(stages)):
            train_dir, test_dir = folders[k]
            elapsed = time.perf_counter() - started
            left = ""
            if stages_run:  # a rough whole-benchmark estimate from the stages run so far
                remaining = (len(stages) - k) + (len(variants) - v_index) * len(stages)
                left = f", about {elapsed / stages_run * remaining / 60:.0f} min left"
            say(
                f"[{variant.label}] stage {k + 1}/{len(stages)} ({len(stages[k])} classes); "
                f"variant {v_index}/{len(variants)}, {elapsed / 60:.1f} min so far{left}"
            )
            stages_run += 1
            tag = f"{variant.label} stage {k + 1}/{len(stages)}"

            def relay(event: api.Progress, tag: str = tag) -> None:
                if progress:
                    progress(api.Progress(event.phase, event.step, event.total, f"{tag} {event.detail}".strip()))

            result = api.learn_stage(
                run_dir,
                data_dir=train_dir,
                eval_data_dir=test_dir,
                device=settings.device,
                ptm_weights=settings.ptm_weights,
                progress=relay,
            )
            acc = result.eval.top1 if result.eval else float("nan")
            say(f"[{variant.label}] stage {k + 1}: A = {acc:.2f}% ({result.total_seconds:.0f}s)")
        distributed.barrier()
        if main:
            loaded = api.load_run(run_dir, device=settings.device, ptm_weights=settings.ptm_weights)
            per_image = _timing(loaded, folders[-1][1], settings.timing_batch)
            row = _summary(variant.label, variant, run_dir, config, per_image)
            results.append(row)
            if score_options and method_of(config).trains:
                say(f"[{variant.label}] rescoring with {list(settings.rescore)}")
                for text, (options, reports) in zip(
                    settings.rescore, rescore(loaded, [f[1] for f in folders], score_options)
                ):
                    history = summarize_history(reports)
                    results.append(
                        {
                            **row,
                            "label": f"{variant.label} [score {text}]",
                            "rescored_from": variant.label,
                            "config": {**row["config"], "score": {**row["config"]["score"], **options}},
                            "accuracy": history.accuracy,
                            "average": history.average,
                            "last": history.last,
                            "forgetting": history.forgetting,
                            "mean_forgetting": history.mean_forgetting,
                            "final_groups": reports[-1].groups,
                        }
                    )
    report = {
        "protocol": {
            **protocol,
            "class_order": order,
            "stages": [len(s) for s in stages],
            "data_source": data.source,
            "train_images": sum(len(data.train[c][: settings.max_train_per_class]) for s in stages for c in s),
            "test_images": sum(len(data.test[c][: settings.max_test_per_class]) for s in stages for c in s),
            "epochs": settings.epochs,
            "device": str(api.resolve_device(settings.device)),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "results": results,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    report["artifacts"] = write_reports(report, out) if main else {}
    return report


def run_seeds(
    settings: BenchmarkSettings,
    variants: list[Variant],
    seeds: tuple[int, ...],
    *,
    progress: Callable[[api.Progress], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``run_benchmark`` once per class order, in ``OUT/seed_<seed>/``; then the mean ± std report."""
    say = log or (lambda _: None)
    out = Path(settings.out_dir)
    reports = {}
    for k, seed in enumerate(seeds, 1):
        say(f"class order {k}/{len(seeds)}: seed {seed}")
        reports[seed] = run_benchmark(
            replace(settings, seed=seed, out_dir=out / f"seed_{seed}"), variants, progress=progress, log=log
        )
    report = aggregate(reports)
    report["artifacts"] = write_reports(report, out) if distributed.is_main() else {}
    return report


SUMMARY_KEYS = ("average", "last", "mean_forgetting", "train_seconds", "inference_ms_per_image")


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
    summary = []
    for row in first["results"]:
        rows = [next(r for r in reports[seed]["results"] if r["label"] == row["label"]) for seed in seeds]
        num_stages = min(len(r["accuracy"]) for r in rows)
        summary.append(
            {
                "label": row["label"],
                "method": row["method"],
                "num_seeds": len(rows),
                **{key: mean_std([r[key] for r in rows]) for key in SUMMARY_KEYS},
                "accuracy": [mean_std([r["accuracy"][t] for r in rows]) for t in range(num_stages)],
            }
        )
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


# ------------------------------------------------------------------------------- reports


def markdown_table(report: dict[str, Any]) -> str:
    if "summary" in report:
        return seeds_markdown(report)
    results = report["results"]
    num_stages = max((r["num_stages"] for r in results), default=0)
    head = ["variant", "Ā", "A_T", "forgetting"] + [f"A_{t}" for t in range(1, num_stages + 1)]
    head += ["params/stage", "train s", "infer ms/img"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        params = sorted(set(r["params_per_stage"]))
        row = [
            f"`{r['label']}`",
            _fmt(r["average"]),
            _fmt(r["last"]),
            _fmt(r["mean_forgetting"]),
            *[_fmt(a) for a in r["accuracy"]],
            "/".join(f"{p:,}" for p in params) if params else "0",
            f"{r['train_seconds']:.0f}",
            f"{r['inference_ms_per_image']:.1f}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


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
        "| variant | Ā | A_T | forgetting | train s | infer ms/img |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["summary"]:
        cells = [_pm(r["average"]), _pm(r["last"]), _pm(r["mean_forgetting"]), _pm(r["train_seconds"], 0)]
        lines.append(f"| `{r['label']}` | " + " | ".join([*cells, _pm(r["inference_ms_per_image"], 1)]) + " |")
    lines += ["", "| variant | seed | Ā | A_T | forgetting | train s |", "|---|---|---|---|---|---|"]
    for r in report["summary"]:
        for seed in seeds:
            row = next(x for x in report["per_seed"][str(seed)] if x["label"] == r["label"])
            cells = [_fmt(row["average"]), _fmt(row["last"]), _fmt(row["mean_forgetting"])]
            lines.append(f"| `{r['label']}` | {seed} | " + " | ".join([*cells, f"{row['train_seconds']:.0f}"]) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> bool:
    """Accuracy vs stage; False when matplotlib (the ``plot`` extra) is not installed."""
    from .errors import DependencyError
    from .plots import pyplot

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


def write_reports(report: dict[str, Any], out: Path) -> dict[str, str | None]:
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, str | None] = {}
    json_path, md_path, png_path = out / "results.json", out / "results.md", out / "accuracy.png"
    _atomic_write(json_path, jsonio.dumps(report, indent=2) + "\n")
    paths["results_json"] = str(json_path)
    _atomic_write(md_path, markdown_table(report))
    paths["results_md"] = str(md_path)
    paths["plot"] = str(png_path) if plot(report, png_path) else None
    return paths


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
