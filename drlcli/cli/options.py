"""Options that several ``drl`` commands share, the choices ``--help`` and shell completion show,
and the top-level help's exit-code table. Imports no torch: ``drl --help`` stays fast."""

from __future__ import annotations

import functools
from enum import Enum
from pathlib import Path
from typing import Any

import typer

from ..config import RunConfig, config_sections
from ..errors import EXIT_CODES, UsageError, shown
from ..methods import METHODS
from ..options import MAX_WORKERS, PRECISIONS, TrainConfig, parse_value
from ..recipes import presets_of

# "\b" keeps click from re-wrapping the list into one paragraph
EPILOG = "Exit codes:\n\n\b\n" + "\n".join(f"{code:>5}  {text}" for code, text in EXIT_CODES.items())

RunOpt = typer.Option(
    Path("."), "--run", "--run-dir", envvar="DRL_RUN", help="Run directory (env DRL_RUN; --run-dir under torchrun)."
)
JsonOpt = typer.Option(False, "--json", help="Print one machine-readable JSON object on stdout.")
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress or log lines on stderr (warnings and errors stay).")
VerboseOpt = typer.Option(
    False, "--verbose", "-v", help="More on stderr: per-epoch losses, timings, the trace of an internal error."
)
CardOpt = typer.Option(False, "--card", help="Print the run's model card (Markdown, as export writes beside a file).")
DeviceOpt = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N.")
WeightsOpt = typer.Option(
    None, "--ptm-weights", envvar="DRL_PTM_WEIGHTS", help="Local PTM weights (.safetensors); env DRL_PTM_WEIGHTS."
)
RandomInitOpt = typer.Option(False, "--random-init", help="Random PTM weights, stored in the run (tests, demos).")
PtmArgOpt = typer.Option([], "--ptm-arg", help="timm create_model KEY=VALUE (repeatable).")

# the sections of a run config file (init --config): every field of RunConfig but the method's name
CONFIG_SECTIONS = tuple(config_sections())

# choices that --help and shell completion show (the values are the library's own names)
MethodName = Enum("MethodName", {m: m for m in METHODS}, type=str)
# every method's listed presets, for --preset's help: "drl: default, frozen, paper; ..."
PRESETS = "; ".join(f"{name}: {', '.join(presets_of(name))}" for name in METHODS if presets_of(name))
ExportFormat = Enum("ExportFormat", {f: f for f in ("drl", "torchscript", "pt2", "onnx")}, type=str)
PrecisionName = Enum("PrecisionName", {p: p for p in PRECISIONS}, type=str)

PrecisionOpt = typer.Option(
    PrecisionName("fp32"),
    "--precision",
    help="dtype of the network's forward: fp32 (default: exact, the numbers of a run without it), bf16 or fp16 "
    "(autocast; fp16 needs CUDA, bf16 also runs on CPU). Scoring stays fp32.",
)
WorkersOpt = typer.Option(
    0, "--workers", min=0, max=MAX_WORKERS, help="DataLoader worker processes that load the images (default 0: none)."
)
TensorBoardOpt = typer.Option(
    None,
    "--tensorboard",
    help="Also write TensorBoard event files to this folder (outside any run): per-epoch loss and learning rate, "
    "per-stage A_t, Ā and forgetting (tensorboard extra).",
)


@functools.cache
def _new_run_train() -> dict[str, TrainConfig]:
    """Each method's train section of a new run (its default preset's), built once per process."""
    return {name: RunConfig.for_method(name).train for name in METHODS}


def train_default(field: str) -> str:
    """``field``'s effective default for learn-stage: the run's config, i.e. each method's default unless set."""
    value = {name: getattr(train, field) for name, train in _new_run_train().items()}
    drl_value = value.pop("drl")
    others = [f"{name} {v}" for name, v in value.items() if v != drl_value]
    return (
        f"default: from the run's config ({drl_value}{''.join(f'; {o}' for o in others)} unless init --config set it)"
    )


def parse_ptm_args(items: list[str]) -> dict[str, Any]:
    """``--ptm-arg KEY=VALUE`` items as timm keyword arguments (values parsed as YAML scalars)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--ptm-arg {shown(item)} must look like KEY=VALUE (e.g. img_size=32)")
        out[key] = parse_value(value, f"--ptm-arg {key}")
    return out


# drl predict --format: JSON lines, text lines (a person's terminal) or CSV (csvsafe.prediction_rows)
PredictFormat = Enum("PredictFormat", {f: f for f in ("jsonl", "text", "csv")}, type=str)
PredictFormatOpt = typer.Option(
    None,
    "--format",
    help="jsonl (one JSON object per image), text (a line per image) or csv (header path,class_1,score_1,...,"
    "unknown,error; formula-like names get a leading '). Default: jsonl when stdout is a file or pipe, text on a "
    "terminal.",
)
ReportOpt = typer.Option(
    None,
    "--report",
    help="Also write per_class.csv (precision, recall, F1, support), confusion.csv, confusion.png and stages.csv "
    "into this folder (created; outside any run; the png needs the plot extra).",
)


def predict_style(fmt: Any, as_json: bool) -> str:
    """predict's output format: ``--format``, ``--json`` (= ``--format jsonl``), else by stdout."""
    if as_json and fmt is not None and fmt.value != "jsonl":
        raise UsageError(f"--json is --format jsonl; it contradicts --format {fmt.value}: pass one of them")
    if fmt is not None:
        return fmt.value
    from .output import stdout_is_a_terminal

    return "jsonl" if as_json or not stdout_is_a_terminal() else "text"
