"""The ``drl`` commands: each parses its options, makes one library call inside the error
boundary (``boundary.execute``) and hands the result to its renderer (``render``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from .. import jsonio
from ..config import MAX_SEED, MAX_WORKERS
from ..errors import UsageError
from . import render
from .boundary import ClickUsageError, OneLineErrors, command, execute, fail
from .options import (
    CONFIG_SECTIONS,
    EPILOG,
    DeviceOpt,
    ExportFormat,
    JsonOpt,
    MethodName,
    PrecisionName,
    PrecisionOpt,
    PtmArgOpt,
    QuietOpt,
    RandomInitOpt,
    RunOpt,
    TensorBoardOpt,
    VerboseOpt,
    WeightsOpt,
    WorkersOpt,
    parse_ptm_args,
    train_default,
)
from .output import Reporter

app = typer.Typer(
    cls=OneLineErrors,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, powershell)
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts are plain: brackets such as [/key=value] are not markup
    help="Class-incremental learning on a frozen pre-trained ViT (DRL: IPA network + DAS).",
    epilog=EPILOG,
)


def _api() -> Any:
    """``drlcli.api``, imported when a command runs (torch with it), looked up at call time."""
    from .. import api

    return api


def _stdout_is_a_terminal() -> bool:
    """Whether results go to a person (text lines) or to a file or pipe (JSON lines)."""
    return sys.stdout.isatty()


def _installed(distribution: str) -> str | None:
    """A distribution's version from its metadata (no import: torch alone takes seconds); None if absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _torch_version() -> str | None:
    """torch's own ``__version__``, build tag included (``+cu130``, ``+cpu``: the metadata may lack it),
    read from ``torch/version.py`` without importing torch; the metadata's version if that fails."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return _installed("torch")
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    return _installed("torch")


def _versions(*, cuda: bool) -> dict[str, Any]:
    """drlcli's, torch's and timm's versions; whether CUDA is available only if asked (``cuda``):
    only torch can tell, and importing it is what makes ``drl --version`` slow."""
    from .. import __version__

    versions: dict[str, Any] = {"drlcli": __version__, "torch": _torch_version(), "timm": _installed("timm")}
    if cuda:
        import torch

        versions["cuda_available"] = torch.cuda.is_available()
    return versions


@app.callback(invoke_without_command=True)
def _top_level(
    ctx: typer.Context,
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the versions of drlcli, torch and timm (without loading torch: instant); with --verbose also "
        "whether CUDA is available (loads torch: seconds).",
    ),
    as_json: bool = typer.Option(False, "--json", help="With --version: one JSON object on stdout."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="With --version: also whether CUDA is available."),
) -> None:
    if version:
        versions = _versions(cuda=verbose)
        if as_json:
            print(jsonio.dumps({"ok": True, **versions}))
        else:
            print(
                "\n".join(f"{name} {'not installed' if value is None else value}" for name, value in versions.items())
            )
        raise typer.Exit(0)
    if as_json:  # `drl --json eval` would silently drop --json: it belongs to the command
        fail(UsageError("--json goes after the command (e.g. drl eval --json) or with --version"), as_json=True)
    if verbose:  # the same for --verbose; a click error: OneLineErrors answers a later --json too
        raise ClickUsageError("--verbose goes after the command (e.g. drl eval --verbose) or with --version", ctx=ctx)
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())


@app.command(short_help="Create a run directory for a PTM (records its name, sha256 and data config).")
def init(
    ptm: str = typer.Option(
        ...,
        "--ptm",
        help="timm ViT name, e.g. deit_tiny_patch16_224, or hf-hub:timm/REPO[@REVISION] from the Hugging Face cache.",
    ),
    ptm_weights: Path | None = WeightsOpt,
    random_init: bool = RandomInitOpt,
    ptm_arg: list[str] = PtmArgOpt,
    method: MethodName | None = typer.Option(None, "--method", help="Method; default drl, or the --config file's."),
    config: Path | None = typer.Option(
        None,
        "--config",
        help=f"YAML run config: method, and any of the sections {', '.join(CONFIG_SECTIONS)} (each a mapping "
        "of that section's keys; what is left out keeps the method's default).",
    ),
    preset: str | None = typer.Option(
        None,
        "--preset",
        help="A named recipe of the method under --config's sections: paper (drl: the paper's scoring).",
    ),
    seed: int = typer.Option(0, "--seed", min=0, max=MAX_SEED, help="Seed for --random-init."),
    allow_nonempty: bool = typer.Option(
        False,
        "--allow-nonempty",
        help="Create the run in a folder that holds other files (never changed). Without it init needs an "
        "empty folder; a file under one of the run's own names (ptm.safetensors, stages, ...) is refused either way.",
    ),
    run: Path = RunOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Create a run directory for a PTM (records its name, sha256 and data config)."""
    from ..config import RunConfig

    def action(reporter: Reporter) -> Any:
        name = method.value if method else None
        if config:
            cfg = RunConfig.from_yaml(config, method=name, preset=preset)
        else:
            cfg = RunConfig.for_method(name or "drl", preset=preset)
        return _api().init_run(
            run,
            ptm=ptm,
            ptm_weights=ptm_weights,
            random_init=random_init,
            ptm_kwargs=parse_ptm_args(ptm_arg),
            config=cfg,
            seed=seed,
            allow_nonempty=allow_nonempty,
            progress=reporter,
        )

    execute(action, render.init, name="init", phase=f"creating {run}", as_json=as_json, quiet=quiet, verbose=verbose)


@app.command(
    "learn-stage",
    short_help="Learn the classes in --data as a new stage, committed atomically; an interrupted one resumes.",
)
def learn_stage(
    data: Path = typer.Option(..., "--data", help="Folder with one sub-folder of images per new class."),
    eval_data: Path | None = typer.Option(None, "--eval-data", help="Test folder, registered for later evals."),
    epochs: int | None = typer.Option(
        None,
        "--epochs",
        min=1,
        show_default=False,
        help=f"Training epochs for this stage, if it is trained (drl's default head reads no stage: "
        f"train.skip_unread); {train_default('epochs')}.",
    ),
    batch_size: int | None = typer.Option(
        None, "--batch-size", min=1, show_default=False, help=f"Images per step; {train_default('batch_size')}."
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
        from ..export import export_run

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
    as_json: bool = typer.Option(False, "--json", help="JSON lines (one object per image) even on a terminal."),
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Top-k classes per image: JSON lines on stdout (a table on a terminal); exit 3 if any image failed."""
    json_lines = as_json or not _stdout_is_a_terminal()
    with command(
        name="predict", as_json=as_json, quiet=quiet, verbose=verbose, device=device, interrupted="interrupted"
    ) as reporter:
        from ..predict import PredictStats, predict_sources

        reporter.phase(f"loading {model or 'the run'}")

        stats = PredictStats()
        for p in predict_sources(
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
        ):
            reporter.result(render.prediction(p.to_dict(), json_lines=json_lines))
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
def info(run: Path = RunOpt, as_json: bool = JsonOpt, quiet: bool = QuietOpt, verbose: bool = VerboseOpt) -> None:
    """Stages, classes, PTM, and the model's growth per stage: parameters and bytes, cumulative (no PTM load)."""
    execute(lambda _: _api().info(run), render.info, name="info", as_json=as_json, quiet=quiet, verbose=verbose)


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
    before are unchanged. See the README, "Forgetting a class"."""

    def action(reporter: Reporter) -> Any:
        if (class_name is None) == (restore is None):
            raise UsageError("pass exactly one of --class NAME (forget it) or --restore NAME (bring it back)")
        if restore is not None and purge:
            raise UsageError("--purge goes with --class (forget and keep nothing), not with --restore")
        from .. import forget as forgetting

        if restore is not None:
            return forgetting.restore_class(run, restore, reason=reason, progress=reporter)
        return forgetting.forget_class(run, class_name, reason=reason, purge=purge, progress=reporter)

    what = f"forgetting {class_name}" if class_name is not None else f"restoring {restore}"
    execute(action, render.forget, name="forget", phase=what, as_json=as_json, quiet=quiet, verbose=verbose)


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
        help="Comma-separated variants method[/key=value...], e.g. drl,drl/loss=ce,ease/epochs=3,simplecil.",
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
        from ..demo import run_demo

        return run_demo(out, epochs=epochs, device=device, progress=reporter)

    execute(action, render.demo, name="demo", as_json=as_json, quiet=quiet, verbose=verbose, device=device)


def main() -> None:
    """Entry point (``drl``, ``python -m drlcli``); under torchrun each command joins the process
    group once its options are parsed (``boundary.command``), and leaves it here."""
    clean = False
    try:
        app()
        clean = True
    except SystemExit as exc:  # typer ends every command with one
        clean = exc.code in (0, None)
        raise
    finally:
        if "drlcli.distributed" in sys.modules:  # a command ran (or torchrun set up the group)
            sys.modules["drlcli.distributed"].teardown(clean=clean)
