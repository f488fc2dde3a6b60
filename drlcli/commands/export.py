"""``drl export``: the run's current model as one file, ``.drl`` or a serving graph (TorchScript,
``.pt2``, ONNX: ``serving/``); the format comes from the file's name; its model card beside it
(``FILE.md``, ``commands/card.py``). Reads the run, never writes it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import RunStateError, UsageError
from ..progress import Progress, ProgressFn
from ..ptm.hub import file_sha256
from ..run.access import refuse_inside_run
from ..run.load import answering_head, load_run
from ..serving.drlfile import write_export
from ..serving.formats import check_extras, write_graph
from ..serving.graph import GRAPH_FORMATS
from ..serving.modelfile import FORMAT_SUFFIX, format_of
from .card import ExportFacts, card_text, read_facts, write_card

FORMATS = ("drl", *GRAPH_FORMATS)


@dataclass(frozen=True)
class ExportResult:
    path: str
    bytes: int
    num_stages: int
    num_classes: int
    format: str = "drl"
    run_dir: str | None = None
    check_max_abs_diff: float | None = None  # graphs: |scores - eager scores| on a random check batch
    answers: str | None = None  # a switched run: the head exported (``run.load.answering_head``)
    card: str | None = None  # the model card written beside the file (``commands/card.py``): FILE.md

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_format(fmt: str | None, out_path: Path) -> str:
    """The export format: as given, else from the file name (.onnx, .pt2, .pt/.ts/.torchscript, else drl).
    A format the name contradicts is refused: ``load_model`` tells formats by name alone."""
    named = format_of(out_path)
    if fmt is None:
        return named
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt != named:
        raise UsageError(
            f"--out {Path(out_path).name} names a {named} file but --format is {fmt}; "
            f"name it *{FORMAT_SUFFIX[fmt]} (drl tells a model file's format by its name)"
        )
    return fmt


def export_run(
    run_dir: Path | str,
    out_path: Path,
    *,
    fmt: str | None = None,
    ptm_weights: Path | None = None,
    progress: ProgressFn | None = None,
) -> ExportResult:
    """Write the run's current model as one file: ``drl`` (``serving/drlfile.py``), or a serving
    graph with the scoring baked in (``torchscript``, ``pt2``, ``onnx``). Reads the run, never writes it, and
    refuses an ``out_path`` inside any run directory (it could replace that run's files)."""
    fmt = resolve_format(fmt, out_path)
    refuse_inside_run(out_path, option="--out")
    check_extras(fmt)  # before a minute of loading, not after
    if progress is not None:
        progress(Progress("load", 0, 0, "the PTM and the run's stages"))
    loaded = load_run(run_dir, device="cpu", ptm_weights=ptm_weights)
    if progress is not None:
        progress(Progress("export", 0, 0, f"writing {out_path}" + ("" if fmt == "drl" else " and checking it")))
    facts = read_facts(loaded.run)  # the model card's records: of the generation exported
    if facts.generation != loaded.manifest["generation"]:
        raise RunStateError(
            f"{loaded.run.path} changed while it was exported (a forget or restore committed); export again"
        )
    model, diff = loaded.model, None
    if fmt == "drl":
        size = write_export(model, loaded.record["ptm"], loaded.config, out_path)
    else:
        size, diff = write_graph(model, loaded.record["ptm"], loaded.config, Path(out_path), fmt=fmt)
    written = ExportFacts(Path(out_path).name, fmt, size, file_sha256(Path(out_path)))
    card = write_card(Path(out_path), card_text(facts, written))
    return ExportResult(
        str(out_path),
        size,
        model.num_stages,
        len(model.class_names),
        fmt,
        str(loaded.run.path),
        diff,
        answering_head(loaded),
        str(card),
    )
