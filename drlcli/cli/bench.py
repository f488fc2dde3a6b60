"""``drl benchmark`` and ``drl demo``: the protocol runs and the built-in offline demo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ..options import MAX_SEED, MAX_WORKERS
from . import commands, render  # noqa: F401  (commands: registered first, so --help lists them before these)
from .app import app
from .boundary import execute
from .options import (
    DeviceOpt,
    JsonOpt,
    PrecisionName,
    PrecisionOpt,
    PtmArgOpt,
    QuietOpt,
    RandomInitOpt,
    VerboseOpt,
    WeightsOpt,
    parse_ptm_args,
)
from .output import Reporter


@app.command(short_help="Run B-m Inc-n for several methods or variants; write results.json, results.md, a plot.")
def benchmark(
    data: Path = typer.Option(
        ..., "--data", help="Folder with train/ and test/ class folders, or train.txt + test.txt + one image tree."
    ),
    out: Path = typer.Option(..., "--out", help="Folder for stage data, one run per variant, results."),
    ptm: str = typer.Option("deit_tiny_patch16_224", "--ptm", help="timm ViT name."),
    ptm_weights: Path | None = WeightsOpt,
    random_init: bool = RandomInitOpt,
    ptm_arg: list[str] = PtmArgOpt,
    methods: str = typer.Option(
        "drl,ease,simplecil",
        "--methods",
        help="Comma-separated variants recipe[/key=value...] or method[/key=value...], e.g. "
        "default,frozen/lr=0.01,ranpac-published,ease/epochs=3 (drl init --recipe lists the recipes).",
    ),
    split: str = typer.Option("B0Inc10", "--split", help="B<m>Inc<n>: m classes first (0: n), then n per stage."),
    seed: int | None = typer.Option(
        None,
        "--seed",
        min=0,
        max=MAX_SEED,
        help="Class-order permutation seed (PILOT's), also the train seed [default: 1993].",
    ),
    seeds: str | None = typer.Option(
        None, "--seeds", help="Several class orders, e.g. 1993,1994,1995: one subfolder each, mean ± std over them."
    ),
    no_shuffle: bool = typer.Option(False, "--no-shuffle", help="Sorted class order."),
    epochs: int | None = typer.Option(None, "--epochs", min=1, help="Epochs for every trained variant."),
    max_train: int | None = typer.Option(None, "--max-train-per-class", min=1, help="First N train images/class."),
    max_test: int | None = typer.Option(None, "--max-test-per-class", min=1, help="First N test images/class."),
    val_fraction: float | None = typer.Option(
        None, "--val-fraction", help="Evaluate on this held-out fraction of train (for tuning), not on test."
    ),
    max_stages: int | None = typer.Option(
        None, "--stages", min=1, help="Run only the first N stages (quick checks, tuning); rerun with more to continue."
    ),
    skip_class: list[str] = typer.Option(["BACKGROUND_Google"], "--skip-class", help="Class to leave out."),
    rescore: list[str] = typer.Option(
        [],
        "--rescore",
        help="Also score each trained run's prototype bank with these options, no retraining (e.g. beta=0).",
    ),
    workers: int | None = typer.Option(
        None,
        "--workers",
        min=0,
        max=MAX_WORKERS,
        show_default=False,
        help="DataLoader worker processes of every pass; default: each variant's config (0 unless a variant sets "
        "num_workers).",
    ),
    precision: PrecisionName = PrecisionOpt,
    tensorboard: Path | None = typer.Option(
        None,
        "--tensorboard",
        help="Also write TensorBoard event files, one folder per variant (DIR/<variant>; DIR/seed_<seed>/<variant> "
        "with --seeds), outside --out/runs: per-epoch loss and learning rate, per-stage A_t, Ā and forgetting "
        "(tensorboard extra).",
    ),
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Run B-m Inc-n for several methods/variants; write results.json, results.md and a plot."""

    def action(reporter: Reporter) -> Any:
        from ..benchmark import DEFAULT_SEED, BenchmarkSettings
        from ..benchmark import benchmark as run_benchmark

        settings = BenchmarkSettings(
            data_dir=data,
            out_dir=out,
            ptm=ptm,
            ptm_weights=ptm_weights,
            random_init=random_init,
            ptm_kwargs=parse_ptm_args(ptm_arg),
            split=split,
            seed=DEFAULT_SEED if seed is None else seed,
            shuffle=not no_shuffle,
            epochs=epochs,
            max_train_per_class=max_train,
            max_test_per_class=max_test,
            val_fraction=val_fraction,
            max_stages=max_stages,
            skip_classes=tuple(skip_class),
            device=device,
            rescore=tuple(rescore),
            precision=precision.value,
            num_workers=workers,
            tensorboard_dir=tensorboard,
        )
        return run_benchmark(
            settings, methods, seeds=seeds, seed_given=seed is not None, progress=reporter, log=reporter.log
        )

    execute(action, render.benchmark, name="benchmark", as_json=as_json, quiet=quiet, verbose=verbose, device=device)


@app.command(short_help="Offline end-to-end demo: generated images, a tiny random ViT, three stages.")
def demo(
    out: Path = typer.Option(Path("drl-demo"), "--out", help="Folder for generated data, run and export."),
    epochs: int = typer.Option(3, "--epochs", min=1),
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Offline end-to-end demo: generated images, a tiny random ViT, three stages."""

    def action(reporter: Reporter) -> Any:
        from ..commands.demo import run_demo

        return run_demo(out, epochs=epochs, device=device, progress=reporter)

    execute(action, render.demo, name="demo", as_json=as_json, quiet=quiet, verbose=verbose, device=device)
