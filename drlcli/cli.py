"""The ``drl`` command line: a thin Typer layer over ``drlcli.api``.

Each command parses options, makes one library call and prints the result: text or one JSON
object (``--json``) on stdout; logs and progress on stderr (``--quiet``: warnings only,
``--verbose``: timings and per-epoch losses too). ``_execute`` is the one place that maps library
errors to one-line messages and exit codes (see ``errors.EXIT_CODES``); ``OneLineErrors`` gives
option-parsing errors the same form.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
import yaml
from typer.core import TyperGroup

from . import jsonio
from .config import MAX_SEED, MAX_WORKERS, METHOD_TRAIN_DEFAULTS, METHODS, TrainConfig
from .errors import EXIT_CODES, DrlError, UsageError

if TYPE_CHECKING:  # torch loads with the first command that runs, not for --help or --version
    from . import api

# "\b" keeps click from re-wrapping the list into one paragraph
EPILOG = "Exit codes:\n\n\b\n" + "\n".join(f"{code:>5}  {text}" for code, text in EXIT_CODES.items())
# click's exception base (typer vendors click in recent releases, so take it from typer's own class)
ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class OneLineErrors(TyperGroup):
    """Option-parsing errors follow the library errors' contract: one ``error:`` line on stderr,
    exit 2, and with ``--json`` the same JSON error object on stdout."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None, **extra: Any):
        argv = list(sys.argv[1:] if args is None else args)
        standalone = extra.pop("standalone_mode", True)
        if not argv or not standalone:  # bare `drl` shows the help
            return super().main(args, prog_name, complete_var, standalone_mode=standalone, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            _print_error("usage", f"{exc.format_message()}{hint}", exc.exit_code, "--json" in argv)
            sys.exit(exc.exit_code)
        except typer.Abort:
            _print_error("interrupted", "aborted", 130, "--json" in argv)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=OneLineErrors,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, powershell)
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts are plain: brackets such as [/key=value] are not markup
    help="Class-incremental learning on a frozen pre-trained ViT (DRL: IPA network + DAS).",
    epilog=EPILOG,
)
log = logging.getLogger("drlcli")

RunOpt = typer.Option(
    Path("."), "--run", "--run-dir", envvar="DRL_RUN", help="Run directory (env DRL_RUN; --run-dir under torchrun)."
)
JsonOpt = typer.Option(False, "--json", help="Print one machine-readable JSON object on stdout.")
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress or log lines on stderr (warnings and errors stay).")
VerboseOpt = typer.Option(
    False, "--verbose", "-v", help="More on stderr: per-epoch losses, timings, the trace of an internal error."
)
DeviceOpt = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N.")
WeightsOpt = typer.Option(
    None, "--ptm-weights", envvar="DRL_PTM_WEIGHTS", help="Local PTM weights (.safetensors); env DRL_PTM_WEIGHTS."
)


# choices that --help and shell completion show (the values are the library's own names)
MethodName = Enum("MethodName", {m: m for m in METHODS}, type=str)
ExportFormat = Enum("ExportFormat", {f: f for f in ("drl", "torchscript", "onnx")}, type=str)


def _train_default(field: str) -> str:
    """``field``'s effective default for learn-stage: the run's config, i.e. each method's default unless set."""
    drl_value = getattr(TrainConfig(), field)
    others = [f"{m} {getattr(c, field)}" for m, c in METHOD_TRAIN_DEFAULTS.items() if getattr(c, field) != drl_value]
    return (
        f"default: from the run's config ({drl_value}{''.join(f'; {o}' for o in others)} unless init --config set it)"
    )


RandomInitOpt = typer.Option(False, "--random-init", help="Random PTM weights, stored in the run (tests, demos).")
PtmArgOpt = typer.Option([], "--ptm-arg", help="timm create_model KEY=VALUE (repeatable).")

# ------------------------------------------------------------------------ output plumbing


class _Stderr:
    """sys.stderr as it is at each write, so log lines go above a live progress bar (rich swaps
    sys.stderr while the bar runs) and to whatever stream a test runner installed."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _LineFormatter(logging.Formatter):
    """Bare lines; a library warning reads like the CLI's own (``warning: ...``)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"warning: {text}" if record.levelno == logging.WARNING else text


def _setup_logging(*, quiet: bool, verbose: bool) -> None:
    """The ``drlcli`` loggers print bare lines on stderr: warnings only (quiet), info, or debug (verbose)."""
    if quiet and verbose:
        raise UsageError("--quiet and --verbose exclude each other; pass one")
    handler = logging.StreamHandler(_Stderr())
    handler.setFormatter(_LineFormatter("%(message)s"))
    log.handlers = [handler]
    log.propagate = False
    log.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    warnings.showwarning = _warning_line


def _warning_line(message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: Any) -> None:
    """A Python warning (ours or a dependency's) as one ``warning:`` line on stderr, never a source excerpt."""
    text = " ".join(str(message).split())
    log.warning("%s: %s (%s:%d)", category.__name__, text, Path(filename).name, lineno)


class Reporter:
    """Progress on stderr: a rich bar on a terminal, a plain log line every few seconds otherwise."""

    def __init__(self, *, quiet: bool, interval: float = 10.0):
        self.quiet = quiet
        self.interactive = sys.stderr.isatty()
        self.interval = interval
        self._last = 0.0  # when the last plain line was printed
        self._phase = ""
        self._step = 0
        self._first_step = 0
        self._bar: Any = None
        self._task: Any = None
        self._phase_start = 0.0

    def __call__(self, event: api.Progress) -> None:
        if event.phase == "warning":  # shown even with --quiet: the user must know
            self.warn(event.detail)
            return
        if self.quiet:
            return
        if self.interactive:
            self._rich(event)
        else:
            self._plain(event)

    def _plain(self, event: api.Progress) -> None:
        """A line when a phase starts, then at most one per ``interval``, and one at its last step."""
        now = time.monotonic()
        new_phase = event.phase != self._phase
        if new_phase or event.step < self._step:  # a new phase, or its next pass (e.g. the next eval set)
            self._phase, self._phase_start, self._first_step = event.phase, now, event.step
        self._step = event.step
        final = 0 < event.total <= event.step
        if not (new_phase or final or now - self._last >= self.interval):
            return
        self._last = now
        left = ""
        if self._first_step < event.step < event.total:
            rate = (now - self._phase_start) / (event.step - self._first_step)
            left = f", ~{rate * (event.total - event.step):.0f}s left"
        log.info("%s %d/%d %s%s", event.phase, event.step, event.total, event.detail, left)

    def warn(self, message: str) -> None:
        if self._bar is not None:
            self._bar.console.print(f"warning: {message}")
        else:
            print(f"warning: {message}", file=sys.stderr)

    def log(self, message: str) -> None:
        """A milestone line (e.g. the benchmark's variant/stage), above any progress bar."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.console.print(message)
        else:
            log.info("%s", message)

    def _rich(self, event: api.Progress) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        if self._bar is None:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[detail]}"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
                redirect_stdout=sys.stdout.isatty(),  # results piped to a file must stay there
            )
            self._bar.start()
        if event.phase != self._phase or self._task is None:
            if self._task is not None:
                self._bar.remove_task(self._task)
            self._phase = event.phase
            self._task = self._bar.add_task(event.phase, total=event.total or None, detail="")
        self._bar.update(self._task, completed=event.step, total=event.total or None, detail=event.detail)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _api() -> Any:
    from . import api

    return api


def _print_error(kind: str, message: str, code: int, as_json: bool) -> None:
    message = " ".join(message.split())  # one line, whatever the library or click wrote
    message = message.encode("utf-8", "backslashreplace").decode()  # a non-UTF-8 path: escapes, not a crash
    if as_json:
        print(jsonio.dumps({"ok": False, "error": {"kind": kind, "message": message, "exit_code": code}}))
    typer.echo(f"error: {message}", err=True)


def _fail(kind: str, message: str, code: int, as_json: bool) -> NoReturn:
    _print_error(kind, message, code, as_json)
    raise typer.Exit(code)


def _execute(
    as_json: bool,
    quiet: bool,
    action: Callable[[Reporter], Any],
    render: Callable[[Any], None],
    *,
    verbose: bool = False,
) -> None:
    from . import distributed

    main_rank = distributed.is_main()
    quiet = quiet or not main_rank  # under torchrun only rank 0 reports and prints results
    start = time.perf_counter()
    try:
        _setup_logging(quiet=quiet, verbose=verbose and main_rank)
    except UsageError as exc:
        _fail(exc.kind, str(exc), exc.exit_code, as_json)
    reporter = Reporter(quiet=quiet)
    try:
        result = action(reporter)
    except DrlError as exc:
        reporter.close()
        _fail(exc.kind, str(exc), exc.exit_code, as_json)
    except KeyboardInterrupt:
        reporter.close()
        _fail(
            "interrupted",
            "interrupted; the previous committed state is kept (re-run learn-stage to resume from its last finished epoch)",
            130,
            as_json,
        )
    except Exception as exc:  # a bug: keep the one-line contract, show the trace only when asked
        reporter.close()
        log.debug("internal error", exc_info=True)
        _fail("internal", f"internal error {exc.__class__.__name__}: {exc} (please report it)", 1, as_json)
    reporter.close()
    log.debug("done in %.1fs", time.perf_counter() - start)
    if not main_rank:
        return
    payload = result if isinstance(result, dict) else result.to_dict()
    if as_json:
        print(jsonio.dumps({"ok": True, **payload}))
    else:
        render(payload)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _history_lines(history: dict[str, Any]) -> list[str]:
    acc = history["accuracy"]
    lines = ["A_t by stage: " + "  ".join(f"A_{i + 1} {_pct(a)}" for i, a in enumerate(acc))]
    lines.append(f"average A (Ā): {_pct(history['average'])}   last A_T: {_pct(history['last'])}")
    if history["forgetting"]:
        lines.append(
            "forgetting by stage group: " + "  ".join(f"{g}: {v:.2f}" for g, v in history["forgetting"].items())
        )
    return lines


def _matrix_lines(matrix: list[list[float | None]]) -> list[str]:
    """The accuracy matrix as a table: row t after stage t, column g the classes of stage g."""
    if not any(v is not None for row in matrix for v in row):
        return []
    lines = ["accuracy matrix (row: after stage t; column: classes of stage g)"]
    lines.append("     " + "".join(f"{f'g{g}':>7}" for g in range(1, len(matrix) + 1)))
    for t, row in enumerate(matrix, 1):
        lines.append(f"{f't{t}':<5}" + "".join(f"{_pct(v):>7}" for v in row))
    return lines


def _growth_lines(stages: list[dict[str, Any]]) -> list[str]:
    """Per stage: what it added and the model's size so far (parameters trained, bytes on disk)."""
    head = f"{'stage':>5} {'classes':>8} {'images':>7} {'params':>10} {'cum.params':>11} {'MiB':>7} {'cum.MiB':>8} {'A_t':>6}"
    lines = [head]
    for s in stages:
        lines.append(
            f"{s['stage']:>5} {s['num_classes']:>8} {s['num_images']:>7} {s['num_params']:>10,} "
            f"{s['cumulative_params']:>11,} {s['bytes'] / 2**20:>7.2f} {s['cumulative_bytes'] / 2**20:>8.2f} "
            f"{_pct(s['accuracy']):>6}"
        )
    return lines


def _accuracy_lines(acc: dict[str, Any]) -> list[str]:
    lines = [f"top-1: {acc['top1']:.2f}% on {acc['num_images']} images"]
    lines.append("by stage group: " + "  ".join(f"stage {g}: {v:.2f}" for g, v in acc["groups"].items()))
    lines.append(f"old classes: {_pct(acc['old'])}   new classes: {_pct(acc['new'])}")
    return lines


def _parse_ptm_args(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--ptm-arg {item!r} must look like KEY=VALUE (e.g. img_size=32)")
        out[key] = yaml.safe_load(value)
    return out


# ------------------------------------------------------------------------------ commands


def _versions() -> dict[str, Any]:
    import timm
    import torch

    from . import __version__

    return {
        "drlcli": __version__,
        "torch": torch.__version__,
        "timm": timm.__version__,
        "cuda_available": torch.cuda.is_available(),
    }


@app.callback(invoke_without_command=True)
def _top_level(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", help="Print the versions of drlcli, torch and timm and whether CUDA is available."
    ),
    as_json: bool = typer.Option(False, "--json", help="With --version: one JSON object on stdout."),
) -> None:
    if version:
        versions = _versions()
        if as_json:
            print(jsonio.dumps({"ok": True, **versions}))
        else:
            print("\n".join(f"{name} {value}" for name, value in versions.items()))
        raise typer.Exit(0)
    if as_json:  # `drl --json eval` would silently drop --json: it belongs to the command
        _fail("usage", "--json goes after the command (e.g. drl eval --json) or with --version", 2, True)
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())


@app.command()
def init(
    ptm: str = typer.Option(..., "--ptm", help="timm ViT name, e.g. deit_tiny_patch16_224."),
    ptm_weights: Path | None = WeightsOpt,
    random_init: bool = RandomInitOpt,
    ptm_arg: list[str] = PtmArgOpt,
    method: MethodName | None = typer.Option(None, "--method", help="Method; default drl, or the --config file's."),
    config: Path | None = typer.Option(None, "--config", help="YAML with ipa/train/score sections."),
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
    from .config import RunConfig

    def action(_: Reporter) -> Any:
        from . import api

        name = method.value if method else None
        cfg = RunConfig.from_yaml(config, method=name) if config else RunConfig.for_method(name or "drl")
        return api.init_run(
            run,
            ptm=ptm,
            ptm_weights=ptm_weights,
            random_init=random_init,
            ptm_kwargs=_parse_ptm_args(ptm_arg),
            config=cfg,
            seed=seed,
            allow_nonempty=allow_nonempty,
        )

    def render(r: dict[str, Any]) -> None:
        print(
            f"initialised {r['run_dir']}: method {r['method']}, PTM {r['ptm']} ({r['ptm_source']}, sha256 {r['ptm_sha256'][:12]}...)"
        )

    _execute(as_json, quiet, action, render, verbose=verbose)


@app.command("learn-stage")
def learn_stage(
    data: Path = typer.Option(..., "--data", help="Folder with one sub-folder of images per new class."),
    eval_data: Path | None = typer.Option(None, "--eval-data", help="Test folder, registered for later evals."),
    epochs: int | None = typer.Option(
        None, "--epochs", min=1, show_default=False, help=f"Training epochs for this stage; {_train_default('epochs')}."
    ),
    batch_size: int | None = typer.Option(
        None, "--batch-size", min=1, show_default=False, help=f"Images per step; {_train_default('batch_size')}."
    ),
    lr: float | None = typer.Option(
        None, "--lr", min=0.0, show_default=False, help=f"SGD learning rate; {_train_default('lr')}."
    ),
    workers: int | None = typer.Option(
        None,
        "--workers",
        min=0,
        max=MAX_WORKERS,
        show_default=False,
        help=f"DataLoader worker processes; {_train_default('num_workers')}.",
    ),
    restart: bool = typer.Option(
        False, "--restart", help="Discard an interrupted run's epoch checkpoint instead of resuming it."
    ),
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
        from . import api

        return api.learn_stage(
            run,
            data_dir=data,
            eval_data_dir=eval_data,
            train_overrides=overrides,
            device=device,
            ptm_weights=ptm_weights,
            restart=restart,
            progress=reporter,
        )

    def render(r: dict[str, Any]) -> None:
        if r["status"] == "unchanged":
            print(f"stage {r['stage']} already learned exactly these images; nothing to do")
            return
        if r["resumed_from_epoch"]:
            print(f"resumed from the checkpoint after epoch {r['resumed_from_epoch']}")
        print(
            f"stage {r['stage']}: learned {len(r['classes'])} classes from {r['num_images']} images "
            f"in {r['total_seconds']:.1f}s (training {r['train_seconds']:.1f}s, {r['num_params']} parameters)"
        )
        if r["eval"]:
            print("\n".join(_accuracy_lines(r["eval"]) + _history_lines(r["history"])))

    _execute(as_json, quiet, action, render, verbose=verbose)


@app.command("eval")
def eval_(
    all_seen: bool = typer.Option(False, "--all-seen", help="Every eval set registered by learn-stage."),
    data: Path | None = typer.Option(None, "--data", help="A labelled folder of learned classes."),
    plot: Path | None = typer.Option(
        None, "--plot", help="Also draw A_t and each stage group's accuracy per stage (.png/.svg/.pdf; plot extra)."
    ),
    confusions: int = typer.Option(5, "--confusions", min=0, help="How many most-confused class pairs to list."),
    device: str = DeviceOpt,
    ptm_weights: Path | None = WeightsOpt,
    run: Path = RunOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Top-1 accuracy overall, per stage group and old/new, the most-confused class pairs, and the
    history: A_t, the accuracy matrix (row t: after stage t, column g: stage g's classes), forgetting."""

    def action(reporter: Reporter) -> Any:
        from . import api

        return api.evaluate(
            run,
            data_dir=data,
            all_seen=all_seen,
            device=device,
            ptm_weights=ptm_weights,
            confusions=confusions,
            plot_path=plot,
            progress=reporter,
        )

    def render(r: dict[str, Any]) -> None:
        print(f"{r['num_classes']} classes over {r['num_stages']} stages")
        print("\n".join(_accuracy_lines(r["accuracy"]) + _history_lines(r["history"])))
        print("\n".join(_matrix_lines(r["history"]["matrix"])))
        if r["confused"]:
            print(
                "most confused (true -> predicted): "
                + ", ".join(f"{c['true']} -> {c['predicted']} ({c['count']})" for c in r["confused"])
            )
        if r["plot"]:
            print(f"plot: {r['plot']}")

    _execute(as_json, quiet, action, render, verbose=verbose)


@app.command()
def export(
    out: Path = typer.Option(..., "--out", help="Output file (e.g. model.drl, model.pt, model.onnx)."),
    fmt: ExportFormat | None = typer.Option(
        None,
        "--format",
        help="drl (the run's model in one file; default), torchscript or onnx (images -> scores graph, "
        "for serving; onnx needs the export extra). Default: from the --out suffix (.pt/.ts, .onnx), else drl; "
        "a --format the suffix contradicts is refused.",
    ),
    ptm_weights: Path | None = WeightsOpt,
    run: Path = RunOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Write one self-contained inference file (weights, prototypes, classes, preprocessing). Reads the run only."""
    from .export import export_run

    def render(r: dict[str, Any]) -> None:
        check = "" if r["check_max_abs_diff"] is None else f", max |Δscore| {r['check_max_abs_diff']:.1e} vs the run"
        print(
            f"exported {r['num_classes']} classes, {r['num_stages']} stages to {r['path']} "
            f"({r['format']}, {r['bytes'] / 2**20:.1f} MiB{check})"
        )

    _execute(
        as_json,
        quiet,
        lambda _: export_run(run, out, fmt=fmt.value if fmt else None, ptm_weights=ptm_weights),
        render,
        verbose=verbose,
    )


@app.command()
def predict(
    sources: list[str] = typer.Argument(..., help="Image files, folders, .txt lists of paths, or - (paths on stdin)."),
    model: Path | None = typer.Option(
        None,
        "--model",
        help="An exported file instead of --run: .drl, .onnx, or .pt/.ts TorchScript (needs --trust-code). "
        "The format comes from the name; content that does not match it is refused (exit 5).",
    ),
    trust_code: bool = typer.Option(
        False,
        "--trust-code",
        help="Allow a TorchScript --model: loading and running it EXECUTES CODE FROM THE FILE (it can read, "
        "write or delete files). Only for files you made or trust; .drl and .onnx never need it.",
    ),
    top_k: int = typer.Option(5, "--top-k", min=1, help="Classes per image."),
    batch_size: int = typer.Option(64, "--batch-size", min=1),
    workers: int = typer.Option(0, "--workers", min=0, max=MAX_WORKERS, help="DataLoader worker processes."),
    device: str = DeviceOpt,
    ptm_weights: Path | None = WeightsOpt,
    run: Path = RunOpt,
    as_json: bool = typer.Option(False, "--json", help="JSON lines (one object per image) even on a terminal."),
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Top-k classes per image: JSON lines on stdout (a table on a terminal); exit 3 if any image failed."""
    from . import api
    from .export import load_model
    from .predict import PredictStats, expand_sources, timed
    from .predict import predict as run_predict

    lines = as_json or not sys.stdout.isatty()
    stats = PredictStats()
    reporter = Reporter(quiet=quiet)
    try:
        _setup_logging(quiet=quiet, verbose=verbose)
        start = time.perf_counter()
        paths = expand_sources(sources)
        loaded = (
            load_model(model, device=str(api.resolve_device(device)), trust_code=trust_code)
            if model is not None
            else api.load_run(run, device=device, ptm_weights=ptm_weights).model
        )
        log.debug("loaded %s (%d classes) in %.1fs", model or run, len(loaded.class_names), time.perf_counter() - start)
        results = run_predict(loaded, paths, top_k=top_k, batch_size=batch_size, num_workers=workers)
        for p in timed(results, stats):
            reporter(api.Progress("predict", stats.images, len(paths), f"{stats.failed} failed"))
            if lines:
                print(jsonio.dumps(p.to_dict()))
            elif p.error:
                print(f"{p.path}: error: {p.error}")
            else:
                print(f"{p.path}: " + ", ".join(f"{t['class']} {t['score']:.3f}" for t in p.top))
    except DrlError as exc:
        reporter.close()
        _fail(exc.kind, str(exc), exc.exit_code, as_json)
    except KeyboardInterrupt:
        reporter.close()
        _fail("interrupted", "interrupted", 130, as_json)
    except BrokenPipeError:  # `drl predict ... | head`: the reader has all it wanted
        raise
    except Exception as exc:  # a bug: the one-line contract, the trace with --verbose
        reporter.close()
        log.debug("internal error", exc_info=True)
        _fail("internal", f"internal error {exc.__class__.__name__}: {exc} (please report it)", 1, as_json)
    reporter.close()
    log.info("%d images, %d failed, %.1f images/s", stats.images, stats.failed, stats.images_per_second)
    if stats.failed:
        raise typer.Exit(3)


@app.command()
def verify(run: Path = RunOpt, as_json: bool = JsonOpt, quiet: bool = QuietOpt, verbose: bool = VerboseOpt) -> None:
    """Check every file of a run against its manifest (sizes, sha256, format); exit 5 naming any damage."""

    def render(r: dict[str, Any]) -> None:
        print(
            f"run {r['run_dir']} is intact: format v{r['format_version']}, generation {r['generation']}, "
            f"{r['num_stages']} stages, {r['files_checked']} files ({r['bytes_checked'] / 2**20:.2f} MiB) verified"
        )
        if r["interrupted_stage"]:
            w = r["interrupted_stage"]
            print(
                f"stage {w['stage']} was interrupted after epoch {w['epoch']}/{w['epochs']}: re-run the same "
                "learn-stage to resume it, or add --restart"
            )

    _execute(as_json, quiet, lambda _: _api().verify(run), render, verbose=verbose)


@app.command()
def info(run: Path = RunOpt, as_json: bool = JsonOpt, quiet: bool = QuietOpt, verbose: bool = VerboseOpt) -> None:
    """Stages, classes, PTM, and the model's growth per stage: parameters and bytes, cumulative (no PTM load)."""

    def render(r: dict[str, Any]) -> None:
        ptm = r["ptm"]
        print(f"run {r['run_dir']} (format v{r['format_version']}, generation {r['generation']}), method {r['method']}")
        print(
            f"PTM {ptm['name']} ({ptm['source']}, sha256 {ptm['sha256'][:12]}...), input {ptm['data_config']['input_size']}"
        )
        print(
            f"{r['num_stages']} stages, {r['num_classes']} classes, {r['total_bytes'] / 2**20:.2f} MiB "
            f"({r['base_bytes'] / 2**20:.2f} MiB before any stage)"
        )
        if r["stages"]:
            print("\n".join(_growth_lines(r["stages"])))
            print("\n".join(_history_lines(r["history"])))

    _execute(as_json, quiet, lambda _: _api().info(run), render, verbose=verbose)


@app.command()
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
        [], "--rescore", help="Also score each trained run with these options, no retraining (e.g. beta=0)."
    ),
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Run B-m Inc-n for several methods/variants; write results.json, results.md and a plot."""
    from .benchmark import BenchmarkSettings, parse_methods, parse_seeds, run_benchmark, run_seeds

    def action(reporter: Reporter) -> Any:
        settings = BenchmarkSettings(
            data_dir=data,
            out_dir=out,
            ptm=ptm,
            ptm_weights=ptm_weights,
            random_init=random_init,
            ptm_kwargs=_parse_ptm_args(ptm_arg),
            split=split,
            seed=1993 if seed is None else seed,
            shuffle=not no_shuffle,
            epochs=epochs,
            max_train_per_class=max_train,
            max_test_per_class=max_test,
            val_fraction=val_fraction,
            max_stages=max_stages,
            skip_classes=tuple(skip_class),
            device=device,
            rescore=tuple(rescore),
        )
        if seeds is None:
            return run_benchmark(settings, parse_methods(methods), progress=reporter, log=reporter.log)
        if seed is not None:
            raise UsageError("pass --seed or --seeds, not both")
        return run_seeds(settings, parse_methods(methods), parse_seeds(seeds), progress=reporter, log=reporter.log)

    def render(r: dict[str, Any]) -> None:
        from .benchmark import markdown_table

        print(markdown_table(r), end="")
        for name, path in r["artifacts"].items():
            print(f"{name}: {path if path else 'skipped (pip install drlcli[plot] for the plot)'}")

    _execute(as_json, quiet, action, render, verbose=verbose)


@app.command()
def demo(
    out: Path = typer.Option(Path("drl-demo"), "--out", help="Folder for generated data, run and export."),
    epochs: int = typer.Option(3, "--epochs", min=1),
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Offline end-to-end demo: generated images, a tiny random ViT, three stages."""
    from .demo import run_demo

    def render(r: dict[str, Any]) -> None:
        for s in r["stages"]:
            print(
                f"stage {s['stage']}: +{s['classes']} classes, accuracy on all seen {s['accuracy']:.2f}% ({s['seconds']:.1f}s)"
            )
        print("\n".join(_accuracy_lines(r["accuracy"]) + _history_lines(r["history"])))
        print(f"data: {r['data_dir']}\nrun directory: {r['run_dir']}\nexported model: {r['export']['path']}")

    _execute(
        as_json, quiet, lambda rep: run_demo(out, epochs=epochs, device=device, progress=rep), render, verbose=verbose
    )


def main() -> None:
    """Entry point; under torchrun (WORLD_SIZE > 1) every process joins the group first."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # distributed.launched(), without importing torch
        from . import distributed

        args = sys.argv[1:]
        cpu = (
            "--device" in args and args.index("--device") + 1 < len(args) and args[args.index("--device") + 1] == "cpu"
        )
        distributed.setup(cpu=cpu)
    try:
        app()
    finally:
        if "drlcli.distributed" in sys.modules:  # a command ran (or torchrun set up the group)
            sys.modules["drlcli.distributed"].teardown()


if __name__ == "__main__":
    main()
