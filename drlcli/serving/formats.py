"""Every export format by name: writing a serving graph (traced, checked against the eager model on
every device it may run on, then written atomically) and loading any model file (``.drl``, ``.pt``,
``.pt2``, ``.onnx``) by its name alone, never its content."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .. import storage
from ..config import RunConfig
from ..errors import IntegrityError, RunStateError, StorageError, UsageError, require
from ..model import IncrementalModel
from ..precision import autocast
from . import modelfile
from .drlfile import load_export
from .graph import CHECK_TOLERANCE, GraphModel, ScoringGraph, check_devices, exportable, graph_spec, joined
from .modelfile import format_of
from .onnx import ONNX_PACKAGES, load_onnx, onnx_bytes
from .torchformats import load_pt2, load_torchscript, pt2_bytes, torchscript_bytes


def check_extras(fmt: str) -> None:
    """Fail before any work (exit 2 naming the pip command) when ``fmt`` needs a missing extra."""
    if fmt == "onnx":
        for package in ONNX_PACKAGES:
            require(package, extra="export", purpose="--format onnx")


def write_graph(
    model: IncrementalModel, ptm_record: dict[str, Any], config: RunConfig, out_path: Path, *, fmt: str
) -> tuple[int, float]:
    """Trace or export the model into ``out_path`` (atomically); returns (bytes, max |Δscore| of the check)."""
    if not model.class_names:
        raise RunStateError("the run has learned no stage yet; run `drl learn-stage` before exporting a graph")
    check_extras(fmt)
    graph = ScoringGraph(model).eval()
    size = [int(v) for v in model.data_config["input_size"]]
    generator = torch.Generator().manual_seed(0)
    example = torch.randn(2, *size, generator=generator)
    check = torch.randn(3, *size, generator=generator)  # another batch size: the batch axis must be dynamic
    spec = graph_spec(model, ptm_record, config, fmt)
    out_path = Path(out_path)
    with torch.no_grad():
        expected = joined(*graph(check))  # the eager model, as predict runs it
        with exportable(graph.network):
            data = GRAPH_WRITERS[fmt](graph, example, spec)
    diffs = []

    def agrees(tmp: Path) -> None:
        for device in check_devices(fmt):  # a graph must run wherever it may be loaded, not only here
            loaded = load_graph(tmp, fmt=fmt, device=device, trust_code=True)  # just traced from our own model
            # in IEEE fp32 on CUDA too, as drl runs fp32 there (precision.autocast): TF32 convolutions
            # alone move the ridge head's scores by about the tolerance
            with torch.no_grad(), autocast(torch.device(device), "fp32"):
                got = joined(*loaded.classify(check.to(loaded.device)))
            on = float((got - expected[:, : got.shape[1]]).abs().max())
            if not on <= CHECK_TOLERANCE:
                raise IntegrityError(
                    f"the {fmt} graph disagrees with the model by {on:.2e} on a check batch on {device}; "
                    "nothing was written (please report it with `drl info --json`)"
                )
            diffs.append(on)

    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        storage.write_atomic(out_path, data, check=agrees)
    except OSError as exc:
        raise StorageError(
            f"cannot write export {out_path}: {exc.strerror or exc}; free space or pick another --out"
        ) from exc
    return out_path.stat().st_size, max(diffs)


GRAPH_WRITERS = {"torchscript": torchscript_bytes, "pt2": pt2_bytes, "onnx": onnx_bytes}


def load_graph(
    path: Path | str, *, fmt: str | None = None, device: str = "cpu", trust_code: bool = False
) -> GraphModel:
    """Load a TorchScript or .pt2 (only with ``trust_code``: loading may run the file's code) or ONNX
    export and check its content, spec and weights. ``fmt`` defaults to what the file name says."""
    path = Path(path)
    fmt = fmt or format_of(path)
    modelfile.require_trust(path, fmt, trust_code)
    modelfile.check_content(path, fmt)
    loader = {"torchscript": load_torchscript, "pt2": load_pt2}.get(fmt, load_onnx)
    return loader(path, device)


def load_model(path: Path | str, *, device: str = "cpu", trust_code: bool = False) -> IncrementalModel | GraphModel:
    """Any export, ready for ``predict``: the format comes from the name (``.drl``; ``.pt``/``.ts``
    TorchScript; ``.pt2`` torch.export; ``.onnx``), never from the content. TorchScript runs the
    file's own code and torch.export.load unpickles, so both load only with ``trust_code=True``; a file whose content is not what its name says is refused."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"model file {path} not found; pass a file written by `drl export`")
    fmt = format_of(path)
    if fmt == "drl":
        return load_export(path, device=device)
    return load_graph(path, fmt=fmt, device=device, trust_code=trust_code)
