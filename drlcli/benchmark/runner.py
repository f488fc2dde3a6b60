"""The benchmark runner: every variant over the same stages, each in its own run directory,
through the same library calls as the CLI; resume, timing and rescoring.

Each stage's images become a folder of symlinks under ``OUT/data``; each variant's run lives in
``OUT/runs/<variant>``. Re-running the same command continues unfinished variants from their last
committed stage and reuses finished ones. Several class orders (``seeds``): each seed is the
benchmark above in its own ``OUT/seed_<seed>/`` (resumed per seed). With a TensorBoard folder, each
variant's event files go to ``TB/<variant>`` (``TB/seed_<seed>/<variant>``), one TensorBoard run each.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .. import distributed
from ..commands.init import init_run
from ..config import RunConfig
from ..data import check_workers
from ..device import resolve_device
from ..errors import UsageError
from ..methods import method_of, schedule_of
from ..precision import check_precision
from ..progress import Progress, ProgressFn
from ..run.directory import RunDir
from ..run.load import load_run
from ..run.records import train_metrics
from ..stage import learn_stage
from ..tracking import check_tensorboard_dir
from .folders import check_protocol, materialise, protocol_record
from .protocol import (
    DEFAULT_SEED,
    StagePlan,
    load_data,
    num_images,
    parse_seeds,
    parse_split,
    plan_stages,
)
from .report import aggregate, rescored_row, summary_row, write_reports
from .scoring import rescore, timing
from .variants import Variant, parse_methods, parse_score

LogFn = Callable[[str], None]


@dataclass(frozen=True)
class BenchmarkSettings:
    data_dir: Path
    out_dir: Path
    ptm: str
    ptm_weights: Path | None = None
    random_init: bool = False
    ptm_kwargs: dict[str, Any] | None = None
    split: str = "B0Inc10"
    seed: int = DEFAULT_SEED
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
    precision: str = "fp32"  # the network forward's in every pass (precision.py)
    num_workers: int | None = None  # DataLoader workers of every pass; None: each variant's config
    tensorboard_dir: Path | None = None  # event files, one folder per variant (tracking.py)


def benchmark(
    settings: BenchmarkSettings,
    methods: str,
    *,
    seeds: str | None = None,
    seed_given: bool = False,
    progress: ProgressFn | None = None,
    log: LogFn | None = None,
) -> dict[str, Any]:
    """``drl benchmark``: parse ``methods`` (``drl,drl/loss=ce,...``) and the class orders
    (``seeds``: ``1993,1994``; else ``settings.seed`` alone), then run them. ``seed_given``: whether
    ``settings.seed`` was chosen rather than the default (it contradicts ``seeds``)."""
    variants = parse_methods(methods)
    for text in settings.rescore:  # refused now, not after the data is read and split
        parse_score(text)
    if seeds is None:
        check_settings(settings, [Path(settings.out_dir)])
        return run_benchmark(settings, variants, progress=progress, log=log)
    if seed_given:
        raise UsageError("pass --seed or --seeds, not both")
    orders = parse_seeds(seeds)
    check_settings(settings, [Path(settings.out_dir) / f"seed_{seed}" for seed in orders])
    return run_seeds(settings, variants, orders, progress=progress, log=log)


def check_settings(settings: BenchmarkSettings, outs: list[Path]) -> None:
    """Fail before any work: workers, precision, and a TensorBoard folder that is inside a run
    directory or among the runs under ``OUT/runs`` (``outs``: each class order's OUT)."""
    if settings.num_workers is not None:
        check_workers(settings.num_workers)
    check_precision(settings.precision, resolve_device(settings.device))
    if settings.tensorboard_dir is None:
        return
    check_tensorboard_dir(settings.tensorboard_dir)
    folder = Path(settings.tensorboard_dir).resolve()
    for runs in (out.resolve() / "runs" for out in outs):
        if folder == runs or runs in folder.parents:
            raise UsageError(
                f"--tensorboard {settings.tensorboard_dir} is inside {runs}, where the benchmark keeps its run "
                "directories; pick a folder outside it (e.g. OUT/tensorboard)"
            )


# ------------------------------------------------------------------------------ stage data


# ------------------------------------------------------------------------- timing, scoring


# -------------------------------------------------------------------------------- running


@dataclass
class _Session:
    """One benchmark over one class order: its settings, plan and stage folders, where to report,
    and the wall clock with the stages run so far (for the whole-benchmark estimate)."""

    settings: BenchmarkSettings
    plan: StagePlan
    folders: list[tuple[Path, Path]]
    num_variants: int
    progress: ProgressFn | None
    say: LogFn
    main: bool  # under torchrun rank 0 alone writes files; all ranks train
    started: float = dataclasses.field(default_factory=time.perf_counter)
    stages_run: int = 0
    # MiB each learn-stage this session ran read (its images, the PTM and the run), by variant and stage
    read_mib: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)
    stored_mib: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)  # the run's size after a stage

    def run_variant(self, v_index: int, variant: Variant, score_options: list[dict[str, Any]]) -> list[dict]:
        """Learn the variant's missing stages; rank 0 returns its results rows."""
        config = variant.config(epochs=self.settings.epochs, seed=self.settings.seed)
        run_dir = Path(self.settings.out_dir) / "runs" / variant.dirname
        for k in range(self._open_run(variant, run_dir, config), len(self.plan.stages)):
            self._learn(v_index, variant, run_dir, k)
        distributed.barrier()
        return self._rows(variant, run_dir, config, score_options) if self.main else []

    def _open_run(self, variant: Variant, run_dir: Path, config: RunConfig) -> int:
        """Stages already committed in the variant's run (0 for a new one, created by rank 0)."""
        settings = self.settings
        distributed.barrier()  # a run rank 0 is about to create is not looked at half-made
        if RunDir(run_dir).exists():
            run = RunDir(run_dir)
            stored = RunConfig.from_dict(run.run_config()["config"])
            if stored != config:
                raise UsageError(
                    f"{run_dir} was run with other settings for {variant.label}; pass another --out or remove it"
                )
            return len(run.stage_indices())
        if self.main:
            init_run(
                run_dir,
                ptm=settings.ptm,
                ptm_weights=settings.ptm_weights,
                random_init=settings.random_init,
                ptm_kwargs=settings.ptm_kwargs,
                config=config,
                seed=settings.seed,
            )
        return 0

    def _learn(self, v_index: int, variant: Variant, run_dir: Path, k: int) -> None:
        num_stages = len(self.plan.stages)
        elapsed = time.perf_counter() - self.started
        left = ""
        if self.stages_run:  # a rough whole-benchmark estimate from the stages run so far
            remaining = (num_stages - k) + (self.num_variants - v_index) * num_stages
            left = f", about {elapsed / self.stages_run * remaining / 60:.0f} min left"
        self.say(
            f"[{variant.label}] stage {k + 1}/{num_stages} ({len(self.plan.stages[k])} classes); "
            f"variant {v_index}/{self.num_variants}, {elapsed / 60:.1f} min so far{left}"
        )
        self.stages_run += 1
        tag = f"{variant.label} stage {k + 1}/{num_stages}"

        def relay(event: Progress) -> None:
            if self.progress:
                self.progress(replace(event, detail=f"{tag} {event.detail}".strip()))

        train_dir, test_dir = self.folders[k]
        settings = self.settings
        read = io_bytes()
        result = learn_stage(
            run_dir,
            data_dir=train_dir,
            eval_data_dir=test_dir,
            train_overrides={"num_workers": settings.num_workers},  # None: the variant's config
            device=settings.device,
            ptm_weights=settings.ptm_weights,
            precision=settings.precision,
            tensorboard_dir=Path(settings.tensorboard_dir) / variant.dirname if settings.tensorboard_dir else None,
            progress=relay,
        )
        after = io_bytes()
        if read is not None and after is not None:
            self.read_mib.setdefault(variant.label, {})[k + 1] = round((after[0] - read[0]) / 2**20, 2)
        self.stored_mib.setdefault(variant.label, {})[k + 1] = round(RunDir(run_dir).size_bytes() / 2**20, 2)
        acc = result.eval.top1 if result.eval else float("nan")
        self.say(f"[{variant.label}] stage {k + 1}: A = {acc:.2f}% ({result.total_seconds:.0f}s)")

    def _rows(self, variant: Variant, run_dir: Path, config: RunConfig, score_options: list[dict]) -> list[dict]:
        """The variant's results row, then one per ``--rescore`` option (trained methods only)."""
        settings = self.settings
        loaded = load_run(run_dir, device=settings.device, ptm_weights=settings.ptm_weights)
        per_image = timing(loaded, self.folders[-1][1], settings.timing_batch, precision=settings.precision)
        row = summary_row(variant.label, variant, loaded, config, per_image)
        read = self.read_mib.get(variant.label, {})
        stored = self.stored_mib.get(variant.label, {})
        row["stage_read_mib"] = [read.get(t) for t in range(1, row["num_stages"] + 1)]  # None: learned earlier
        row["stage_stored_mib"] = [stored.get(t) for t in range(1, row["num_stages"] + 1)]
        if not (score_options and method_of(config).trains):
            return [row]
        if schedule_of(config).carries:
            # the prototype bank's rows were taken on networks that later stages moved
            self.say(f"[{variant.label}] not rescored: its network is carried (schedule.stages all)")
            return [row]
        if any(train_metrics(meta).get("skipped") is True for meta in loaded.stage_metas):
            # scoring by other options would read subspaces of stages that were never trained
            self.say(f"[{variant.label}] not rescored: its stages were not trained (train.skip_unread)")
            return [row]
        self.say(f"[{variant.label}] rescoring with {list(settings.rescore)}")
        rescored = rescore(
            loaded,
            [f[1] for f in self.folders],
            score_options,
            num_workers=loaded.config.train.num_workers if settings.num_workers is None else settings.num_workers,
            precision=settings.precision,
        )
        return [row] + [rescored_row(row, text, o, r) for text, (o, r) in zip(settings.rescore, rescored)]


def io_bytes() -> tuple[int, int] | None:
    """(read, written): the bytes of this process's read and write calls so far (Linux
    ``/proc/self/io`` ``rchar`` and ``wchar``; None elsewhere)."""
    try:
        with open("/proc/self/io", encoding="ascii") as io:
            fields = dict(line.split(": ", 1) for line in io.read().splitlines() if ": " in line)
        return int(fields["rchar"]), int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return None


def run_benchmark(
    settings: BenchmarkSettings,
    variants: list[Variant],
    *,
    progress: ProgressFn | None = None,
    log: LogFn | None = None,
) -> dict[str, Any]:
    """Run every variant over the same stages; write results.json, results.md and (if matplotlib) a plot."""
    base, inc = parse_split(settings.split)
    data = load_data(settings.data_dir, skip_classes=set(settings.skip_classes))
    plan = plan_stages(
        data,
        base=base,
        inc=inc,
        seed=settings.seed,
        shuffle=settings.shuffle,
        val_fraction=settings.val_fraction,
        max_stages=settings.max_stages,
    )
    out = Path(settings.out_dir)
    main = distributed.is_main()
    protocol = protocol_record(settings)
    check_protocol(out / "protocol.json", protocol, write=main)
    folders = materialise(
        plan.stages,
        plan.data,
        out / "data",
        max_train=settings.max_train_per_class,
        max_test=settings.max_test_per_class,
        write=main,
    )
    distributed.barrier()
    score_options = [parse_score(text) for text in settings.rescore]
    session = _Session(settings, plan, folders, len(variants), progress, log or (lambda _: None), main)
    results = []
    for v_index, variant in enumerate(variants, 1):
        results += session.run_variant(v_index, variant, score_options)
    report = {
        "protocol": {**protocol, **_plan_record(settings, plan)},
        "results": results,
        "wall_seconds": round(time.perf_counter() - session.started, 1),
    }
    report["artifacts"] = _artifacts(report, out, settings) if main else {}
    return report


def _artifacts(report: dict[str, Any], out: Path, settings: BenchmarkSettings) -> dict[str, str | None]:
    """The files written: results.json, results.md, the plot, and the TensorBoard folder if asked for."""
    paths = write_reports(report, out)
    if settings.tensorboard_dir is not None:
        paths["tensorboard"] = str(settings.tensorboard_dir)
    return paths


def _plan_record(settings: BenchmarkSettings, plan: StagePlan) -> dict[str, Any]:
    return {
        "class_order": plan.order,
        "stages": [len(s) for s in plan.stages],
        "data_source": plan.data.source,
        "train_images": num_images(plan.data.train, plan.stages, settings.max_train_per_class),
        "test_images": num_images(plan.data.test, plan.stages, settings.max_test_per_class),
        "epochs": settings.epochs,
        "device": str(resolve_device(settings.device)),
        "precision": settings.precision,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def run_seeds(
    settings: BenchmarkSettings,
    variants: list[Variant],
    seeds: tuple[int, ...],
    *,
    progress: ProgressFn | None = None,
    log: LogFn | None = None,
) -> dict[str, Any]:
    """``run_benchmark`` once per class order, in ``OUT/seed_<seed>/``; then the mean ± std report."""
    say = log or (lambda _: None)
    out = Path(settings.out_dir)
    reports = {}
    for k, seed in enumerate(seeds, 1):
        say(f"class order {k}/{len(seeds)}: seed {seed}")
        tensorboard = Path(settings.tensorboard_dir) / f"seed_{seed}" if settings.tensorboard_dir else None
        reports[seed] = run_benchmark(
            replace(settings, seed=seed, out_dir=out / f"seed_{seed}", tensorboard_dir=tensorboard),
            variants,
            progress=progress,
            log=log,
        )
    report = aggregate(reports)
    report["artifacts"] = _artifacts(report, out, settings) if distributed.is_main() else {}
    return report
