"""The commands on a run: each parses its options, makes one library call inside the error boundary
(``boundary.execute``) and hands the result to its renderer (``render``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ..errors import UsageError
from ..options import MAX_WORKERS
from . import create, render  # noqa: F401  (create: init, registered first so --help lists it first)
from .app import app
from .boundary import command, execute
from .options import (
    CardOpt,
    DeviceOpt,
    ExportFormat,
    JsonOpt,
    PrecisionName,
    PrecisionOpt,
    PredictFormat,
    PredictFormatOpt,
    QuietOpt,
    ReportOpt,
    RunOpt,
    TensorBoardOpt,
    VerboseOpt,
    WeightsOpt,
    WorkersOpt,
    predict_style,
    train_default,
)
from .output import Reporter


def _api() -> Any:
    """``drlcli.api``, imported when a command runs (torch with it), looked up at call time."""
    from .. import api

    return api


@app.command(
    "learn-stage",
    short_help="Learn the classes in --data as a new stage, committed atomically; an interrupted one resumes.",
)
def learn_stage(
    data: Path = typer.Option(..., "--data", help="Folder with one sub-folder of images per new class."),
    eval_data: Path | None = typer.Option(None, "--eval-data", help="Test folder, registered for later evals."),
    eval_fraction: float | None = typer.Option(
        None,
        "--eval-fraction",
        help="Instead of --eval-data: hold out this fraction (0 to 1) of each class of --data as the stage's "
        "evaluation set, seeded by the run's train seed, never trained on (not evaluated again by eval --all-seen).",
    ),
    epochs: int | None = typer.Option(
        None,
        "--epochs",
        min=1,
        show_default=False,
        help=f"Training epochs for this stage, if it is trained (drl's default trains its adapter set at each "
        f"stage until adapting stops paying; recipe frozen trains none); {train_default('epochs')}; once the set "
        "has trained, schedule.later_epochs (the default's 5).",
    ),
    batch_size: int | None = typer.Option(
        None,
        "--batch-size",
        min=1,
        show_default=False,
        help=f"Images per step; {train_default('batch_size')}; once the set has trained, schedule.later_batch_size "
        "(the default's 12).",
    ),
    lr: float | None = typer.Option(
        None, "--lr", min=0.0, show_default=False, help=f"SGD learning rate; {train_default('lr')}."
    ),
    workers: int | None = typer.Option(
        None,
        "--workers",
        min=0,
        max=MAX_WORKERS,
        show_default=False,
        help=f"DataLoader worker processes of every pass (training, prototypes, evaluation); "
        f"{train_default('num_workers')}.",
    ),
    restart: bool = typer.Option(
        False, "--restart", help="Discard an interrupted run's epoch checkpoint instead of resuming it."
    ),
    precision: PrecisionName = PrecisionOpt,
    tensorboard: Path | None = TensorBoardOpt,
    device: str = DeviceOpt,
    ptm_weights: Path | None = WeightsOpt,
    run: Path = RunOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Learn the classes in --data as a new stage; commit it atomically.

    An interrupted run resumes from its last finished epoch when re-run with the same data and
    options; re-running a committed stage with the same data does nothing."""
    overrides = {"epochs": epochs, "batch_size": batch_size, "lr": lr, "num_workers": workers}

    def action(reporter: Reporter) -> Any:
        return _api().learn_stage(
            run,
            data_dir=data,
            eval_data_dir=eval_data,
            eval_fraction=eval_fraction,
            train_overrides=overrides,
            device=device,
            ptm_weights=ptm_weights,
            restart=restart,
            precision=precision.value,
            tensorboard_dir=tensorboard,
            progress=reporter,
        )

    execute(
        action,
        render.learn_stage,
        name="learn-stage",
        phase="loading the run",
        as_json=as_json,
        quiet=quiet,
        verbose=verbose,
        device=device,
    )


@app.command(
    "eval",
    short_help="Top-1/top-5 accuracy, per stage group and old/new, most-confused pairs, A_t history, forgetting.",
)
def eval_(
    all_seen: bool = typer.Option(False, "--all-seen", help="Every eval set registered by learn-stage."),
    data: Path | None = typer.Option(None, "--data", help="A labelled folder of learned classes."),
    plot: Path | None = typer.Option(
        None, "--plot", help="Also draw A_t and each stage group's accuracy per stage (.png/.svg/.pdf; plot extra)."
    ),
    confusions: int = typer.Option(5, "--confusions", min=0, help="How many most-confused class pairs to list."),
    report: Path | None = ReportOpt,
    unknown_data: Path | None = typer.Option(
        None,
        "--unknown-data",
        help="Class folders of classes the run has NOT learned: also report how well the 'unknown' answer "
        "separates them from the known images (AUROC, unknown accepted, known rejected).",
    ),
    workers: int = WorkersOpt,
    precision: PrecisionName = PrecisionOpt,
    device: str = DeviceOpt,
    ptm_weights: Path | None = WeightsOpt,
    run: Path = RunOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Top-1 and top-5 accuracy overall, top-1 per stage group and old/new, the most-confused class pairs, and the
    history: A_t, the accuracy matrix (row t: after stage t, column g: stage g's classes), forgetting."""

    def action(reporter: Reporter) -> Any:
        return _api().evaluate(
            run,
            data_dir=data,
            all_seen=all_seen,
            device=device,
            ptm_weights=ptm_weights,
            confusions=confusions,
            plot_path=plot,
            report_dir=report,
            unknown_dir=unknown_data,
            num_workers=workers,
            precision=precision.value,
            progress=reporter,
        )

    execute(
        action,
        render.evaluate,
        name="eval",
        phase="loading the run",
        as_json=as_json,
        quiet=quiet,
        verbose=verbose,
        device=device,
    )


@app.command(short_help="Write one self-contained inference file: .drl, TorchScript, .pt2 or ONNX.")
def export(
    out: Path = typer.Option(..., "--out", help="Output file (e.g. model.drl, model.pt, model.pt2, model.onnx)."),
    fmt: ExportFormat | None = typer.Option(
        None,
        "--format",
        help="drl (the run's model in one file; default), torchscript, pt2 (torch.export) or onnx (images -> scores "
        "graph, for serving; onnx needs the export extra). Default: from the --out suffix (.pt/.ts, .pt2, .onnx), "
        "else drl; "
        "a --format the suffix contradicts is refused.",
    ),
    ptm_weights: Path | None = WeightsOpt,
    run: Path = RunOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Write one self-contained inference file (weights, prototypes, classes, preprocessing). Reads the run only."""

    def action(reporter: Reporter) -> Any:
        from ..commands.export import export_run

        return export_run(run, out, fmt=fmt.value if fmt else None, ptm_weights=ptm_weights, progress=reporter)

    execute(action, render.export, name="export", phase=f"writing {out}", as_json=as_json, quiet=quiet, verbose=verbose)


@app.command(
    short_help="Top-k classes per image: JSON lines on stdout, text lines on a terminal; exit 3 if any failed."
)
def predict(
    sources: list[str] = typer.Argument(..., help="Image files, folders, .txt lists of paths, or - (paths on stdin)."),
    model: Path | None = typer.Option(
        None,
        "--model",
        help="An exported file instead of --run: .drl, .onnx, .pt/.ts TorchScript or .pt2 torch.export (both need "
        "--trust-code). "
        "The format comes from the name; content that does not match it is refused (exit 5).",
    ),
    trust_code: bool = typer.Option(
        False,
        "--trust-code",
        help="Allow a TorchScript or .pt2 --model: loading it may EXECUTE CODE FROM THE FILE (it can read, "
        "write or delete files). Only for files you made or trust; .drl and .onnx never need it.",
    ),
    top_k: int = typer.Option(5, "--top-k", min=1, help="Classes per image."),
    batch_size: int = typer.Option(64, "--batch-size", min=1),
    workers: int = WorkersOpt,
    precision: PrecisionName = PrecisionOpt,
    device: str = DeviceOpt,
    ptm_weights: Path | None = WeightsOpt,
    run: Path = RunOpt,
    fmt: PredictFormat | None = PredictFormatOpt,
    as_json: bool = typer.Option(False, "--json", help="Same as --format jsonl (JSON lines even on a terminal)."),
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Top-k classes per image: JSON lines on stdout (a table on a terminal); exit 3 if any image failed."""
    as_json = as_json or fmt == PredictFormat.jsonl  # --json is --format jsonl (errors as JSON too)
    with command(
        name="predict", as_json=as_json, quiet=quiet, verbose=verbose, device=device, interrupted="interrupted"
    ) as reporter:
        from ..commands.predict import PredictStats, predict_sources

        style = predict_style(fmt, as_json)
        reporter.phase(f"loading {model or 'the run'}")

        stats = PredictStats()
        results = predict_sources(
            sources,
            model_path=model,
            run_dir=run,
            device=device,
            ptm_weights=ptm_weights,
            trust_code=trust_code,
            top_k=top_k,
            batch_size=batch_size,
            num_workers=workers,
            precision=precision.value,
            stats=stats,
            progress=reporter,
        )
        for i, p in enumerate(results):
            reporter.result(render.prediction(p.to_dict(), style=style, top_k=top_k, first=i == 0))
    if stats.failed:
        raise typer.Exit(3)


@app.command(short_help="Check every file of a run against its manifest; exit 5 naming any damage.")
def verify(run: Path = RunOpt, as_json: bool = JsonOpt, quiet: bool = QuietOpt, verbose: bool = VerboseOpt) -> None:
    """Check every file of a run against its manifest (sizes, sha256, format); exit 5 naming any damage."""
    execute(
        lambda reporter: _api().verify(run, progress=reporter),
        render.verify,
        name="verify",
        phase=f"checking every file of {run}",
        as_json=as_json,
        quiet=quiet,
        verbose=verbose,
    )


@app.command(short_help="Stages, classes, PTM, forgotten classes and the model's growth per stage (no PTM load).")
def info(run: Path = RunOpt, card: bool = CardOpt, as_json: bool = JsonOpt, quiet: bool = QuietOpt, verbose: bool = VerboseOpt) -> None:  # fmt: skip
    """Stages, classes, PTM, and the model's growth per stage: parameters and bytes, cumulative (no PTM load)."""
    call, shown = ("model_card", render.card) if card else ("info", render.info)
    execute(lambda _: getattr(_api(), call)(run), shown, name="info", as_json=as_json, quiet=quiet, verbose=verbose)


@app.command(short_help="Forget a learned class (a new generation of the run without it), or --restore one.")
def forget(
    class_name: str | None = typer.Option(
        None, "--class", help="Take this class out of every answer (eval, predict, later exports)."
    ),
    restore: str | None = typer.Option(
        None, "--restore", help="Bring back a class forgotten without --purge (its kept slices)."
    ),
    reason: str | None = typer.Option(
        None, "--reason", help="Why (one line), recorded in the run's forget log with the UTC time."
    ),
    purge: bool = typer.Option(
        False,
        "--purge",
        help="With --class: keep nothing of the class's prototypes and head columns (legal deletion); it cannot "
        "be restored. On a class already forgotten, deletes what was kept.",
    ),
    run: Path = RunOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Forget a learned class (a new generation of the run without it), or --restore one.

    What the class's images left in shared statistics and trained stage networks stays; exports made
    before are unchanged. See docs/forgetting.md."""

    def action(reporter: Reporter) -> Any:
        if (class_name is None) == (restore is None):
            raise UsageError("pass exactly one of --class NAME (forget it) or --restore NAME (bring it back)")
        if restore is not None and purge:
            raise UsageError("--purge goes with --class (forget and keep nothing), not with --restore")
        from ..commands import forget as forgetting

        if restore is not None:
            return forgetting.restore_class(run, restore, reason=reason, progress=reporter)
        return forgetting.forget_class(run, class_name, reason=reason, purge=purge, progress=reporter)

    what = f"forgetting {class_name}" if class_name is not None else f"restoring {restore}"
    execute(action, render.forget, name="forget", phase=what, as_json=as_json, quiet=quiet, verbose=verbose)
