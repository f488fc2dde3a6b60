"""TorchScript and ONNX exports: the single-pass network and the prototype scoring as one graph.

The graph takes a preprocessed image batch ``images`` (B, 3, H, W) float32 (resized, centre-
cropped and normalised as the PTM's data config says) and returns ``scores`` (B, C), one column
per class in ``class_names`` order. The prototype bank (synthesised prototypes included) and the
scoring weights are constants of the graph, so serving needs neither drl nor the run directory:
``torch.jit.load`` or onnxruntime. The batch axis is dynamic; H and W are the PTM's input size.

What a server needs beside the graph is recorded in the file as one ``spec``: class names,
preprocessing (mean, std, input size, interpolation, crop), PTM name and sha256, the scoring
options, and ``payload_sha256`` over the weights, so a damaged file is refused, never used.
TorchScript keeps it in ``_extra_files["drl.json"]``; ONNX in ``metadata_props``, one key per
top-level entry (strings as they are, everything else as JSON).

A graph serves; it cannot learn more stages (export again from the run after ``learn-stage``).
``ease`` graphs run one ViT pass per stage, as the method does.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from . import __version__, backbone
from .config import RunConfig
from .errors import IntegrityError, RunStateError, StorageError, require
from .model import IncrementalModel
from .prototypes import concat_scores, score_weights, weighted_scores
from .rundir import write_durable

GRAPH_FORMATS = ("torchscript", "onnx")
FORMAT_VERSION = "1"
ONNX_OPSET = 18
SPEC_FILE = "drl.json"  # TorchScript extra file
JSON_KEYS = ("ptm", "num_stages", "class_names", "class_stage", "data_config", "score", "input", "output")
CHECK_TOLERANCE = 1e-3  # a graph that disagrees more with the eager model on a check batch is not written
ONNX_PACKAGES = ("onnx", "onnxruntime")  # the export extra
log = logging.getLogger(__name__)


class ScoringGraph(nn.Module):
    """Network + prototype scoring: images (B, 3, H, W) -> scores (B, C). Only constants besides the network."""

    def __init__(self, model: IncrementalModel):
        super().__init__()
        self.network = model.network
        bank = model.prototype_bank().detach().clone()  # (C, S, d), synthesised rows included
        self.register_buffer("bank", bank)
        self.concat = model.score_cfg.rule == "concat"
        cfg = model.score_cfg
        weights = score_weights(model.class_stage, bank.shape[1], rho=cfg.rho, beta=cfg.beta, offset=model.offset)
        self.register_buffer("weights", weights)  # (C, S)
        self.head = model.head  # an analytic head (ranpac) replaces the prototype scoring

    def forward(self, images: Tensor) -> Tensor:
        features = self.network(images)  # (B, S, d)
        if self.head is not None:
            return self.head(features)
        if self.concat:
            return concat_scores(features, self.bank)
        return weighted_scores(features, self.bank, self.weights)


@dataclass
class GraphModel:
    """A loaded TorchScript or ONNX export; offers what ``predict`` needs, like ``IncrementalModel``."""

    format: str
    spec: dict[str, Any]
    run: Callable[[Tensor], Tensor]  # images (B, 3, H, W) -> scores (B, C), on ``device``
    device: torch.device

    @property
    def class_names(self) -> list[str]:
        return list(self.spec["class_names"])

    @property
    def data_config(self) -> dict[str, Any]:
        return self.spec["data_config"]

    def score_images(self, images: Tensor) -> Tensor:
        return self.run(images)


# ------------------------------------------------------------------------------- writing


def graph_spec(model: IncrementalModel, ptm_record: dict[str, Any], config: RunConfig, fmt: str) -> dict[str, Any]:
    size = [int(v) for v in model.data_config["input_size"]]
    return {
        "format": f"drl-{fmt}",
        "format_version": FORMAT_VERSION,
        "drl_version": __version__,
        "method": config.method,
        "ptm": {k: ptm_record[k] for k in ("name", "kwargs", "sha256")},
        "num_stages": model.network.num_stages,
        "class_names": list(model.class_names),
        "class_stage": model.class_stage.tolist(),
        "data_config": model.data_config,
        "score": config.to_dict()["score"],
        "input": {
            "name": "images",
            "shape": ["batch", *size],
            "dtype": "float32",
            "preprocessing": "RGB, resize + centre crop (crop_pct, interpolation) to input_size, /255, "
            "then (x - mean) / std per channel: the data_config",
        },
        "output": {"name": "scores", "shape": ["batch", len(model.class_names)], "dtype": "float32"},
    }


def write_graph(
    model: IncrementalModel, ptm_record: dict[str, Any], config: RunConfig, out_path: Path, *, fmt: str
) -> tuple[int, float]:
    """Trace the model into ``out_path`` (atomically); returns (bytes, max |Δscore| of the check)."""
    if not model.class_names:
        raise RunStateError("the run has learned no stage yet; run `drl learn-stage` before exporting a graph")
    if fmt == "onnx":  # fail before any work when the extra is missing
        for package in ONNX_PACKAGES:
            require(package, extra="export", purpose="--format onnx")
    graph = ScoringGraph(model).eval()
    size = [int(v) for v in model.data_config["input_size"]]
    generator = torch.Generator().manual_seed(0)
    example = torch.randn(2, *size, generator=generator)
    check = torch.randn(3, *size, generator=generator)  # another batch size: the batch axis must be dynamic
    spec = graph_spec(model, ptm_record, config, fmt)
    out_path = Path(out_path)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # the tracer warns about shapes read as Python numbers (block and stage counts,
            # head sizes): they are fixed by the model; the batch axis stays dynamic (checked below)
            warnings.simplefilter("ignore")
            expected = graph(check)
            if fmt == "torchscript":
                data = _torchscript_bytes(graph, example, spec)
            else:
                data = _onnx_bytes(graph, example, spec)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        write_durable(tmp, data)
        loaded = load_graph(tmp, fmt=fmt)
        with torch.no_grad():
            diff = float((loaded.score_images(check).float().cpu() - expected).abs().max())
        if not diff <= CHECK_TOLERANCE:
            raise IntegrityError(
                f"the {fmt} graph disagrees with the model by {diff:.2e} on a check batch; nothing was written "
                "(please report it with `drl info --json`)"
            )
        os.replace(tmp, out_path)
    except OSError as exc:
        raise StorageError(
            f"cannot write export {out_path}: {exc.strerror or exc}; free space or pick another --out"
        ) from exc
    finally:
        tmp.unlink(missing_ok=True)
    return out_path.stat().st_size, diff


def _torchscript_bytes(graph: ScoringGraph, example: Tensor, spec: dict[str, Any]) -> bytes:
    traced = torch.jit.trace(graph, example, check_trace=False)
    spec = {**spec, "payload_sha256": backbone.tensors_sha256(traced.state_dict())}
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer, _extra_files={SPEC_FILE: json.dumps(spec)})
    return buffer.getvalue()


def _onnx_bytes(graph: ScoringGraph, example: Tensor, spec: dict[str, Any]) -> bytes:
    """PyTorch's TorchScript-based ONNX exporter (seconds, a compact graph). The network takes its
    functional path while traced (``ipa._tracing``); ``write_graph`` checks the result anyway."""
    onnx = require("onnx", extra="export", purpose="--format onnx")
    printed = io.StringIO()  # the exporter reports its steps on stdout, which belongs to results
    buffer = io.BytesIO()
    with contextlib.redirect_stdout(printed):
        torch.onnx.export(
            graph,
            (example,),
            buffer,
            dynamo=False,
            input_names=["images"],
            output_names=["scores"],
            opset_version=ONNX_OPSET,
            dynamic_axes={"images": {0: "batch"}, "scores": {0: "batch"}},
        )
    if printed.getvalue().strip():
        log.debug("%s", printed.getvalue().strip())
    proto = onnx.load_from_string(buffer.getvalue())
    spec = {**spec, "payload_sha256": _onnx_payload_sha256(proto)}
    for key, value in spec.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value if isinstance(value, str) else json.dumps(value)
    proto.producer_name, proto.producer_version = "drl", __version__
    onnx.checker.check_model(proto)
    return proto.SerializeToString()


def _onnx_session(data: bytes) -> Any:
    ort = require("onnxruntime", extra="export", purpose="running an ONNX export")
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: its warnings are coloured lines on stderr
    return ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])


def _onnx_payload_sha256(proto: Any) -> str:
    """sha256 over the graph's initializers (name, dtype, shape, bytes), in name order."""
    from onnx import numpy_helper

    digest = hashlib.sha256()
    for init in sorted(proto.graph.initializer, key=lambda t: t.name):
        array = numpy_helper.to_array(init)
        digest.update(f"{init.name}|{array.dtype}|{array.shape}\n".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------- loading


def sniff_format(path: Path) -> str:
    """drl (safetensors), torchscript (a zip archive) or onnx (anything else named .onnx)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(16)
    except OSError as exc:
        raise IntegrityError(f"cannot read model file {path}: {exc.strerror or exc}; pass an exported file") from exc
    if head.startswith(b"PK\x03\x04"):
        return "torchscript"
    if len(head) > 8 and head[8:9] == b"{":  # safetensors: 8-byte header length, then JSON
        return "drl"
    if Path(path).suffix.lower() == ".onnx" or head[:1] == b"\x08":  # ModelProto field 1 (ir_version)
        return "onnx"
    return "drl"  # let the drl reader name the problem


def load_graph(path: Path | str, *, fmt: str | None = None, device: str = "cpu") -> GraphModel:
    """Load a TorchScript or ONNX export and check its spec and weights."""
    path = Path(path)
    fmt = fmt or sniff_format(path)
    return _load_torchscript(path, device) if fmt == "torchscript" else _load_onnx(path)


def _load_torchscript(path: Path, device: str) -> GraphModel:
    extra = {SPEC_FILE: ""}
    try:
        with warnings.catch_warnings():  # TorchScript is deprecated upstream; loading still works
            warnings.simplefilter("ignore", FutureWarning)
            module = torch.jit.load(str(path), map_location=torch.device(device), _extra_files=extra)
        spec = json.loads(extra[SPEC_FILE])
    except (RuntimeError, ValueError, OSError) as exc:
        raise IntegrityError(
            f"{path} is not a readable drl TorchScript export ({_short(exc)}); export it again"
        ) from exc
    _check_spec(path, spec, "torchscript")
    if backbone.tensors_sha256(module.state_dict()) != spec.get("payload_sha256"):
        raise IntegrityError(f"{path} is damaged (checksum mismatch); export it again")
    module.eval()
    return GraphModel("torchscript", spec, module, torch.device(device))


def _load_onnx(path: Path) -> GraphModel:
    onnx = require("onnx", extra="export", purpose="reading an ONNX export")
    require("onnxruntime", extra="export", purpose="running an ONNX export")
    try:
        proto = onnx.load(str(path))
    except Exception as exc:  # protobuf's DecodeError and friends
        raise IntegrityError(f"{path} is not a readable ONNX file ({_short(exc)}); export it again") from exc
    spec: dict[str, Any] = {}
    for entry in proto.metadata_props:
        spec[entry.key] = json.loads(entry.value) if entry.key in JSON_KEYS else entry.value
    _check_spec(path, spec, "onnx")
    if _onnx_payload_sha256(proto) != spec.get("payload_sha256"):
        raise IntegrityError(f"{path} is damaged (checksum mismatch); export it again")
    try:
        session = _onnx_session(proto.SerializeToString())
    except Exception as exc:
        raise IntegrityError(f"onnxruntime cannot load {path} ({_short(exc)}); export it again") from exc

    def run(images: Tensor) -> Tensor:
        (scores,) = session.run(["scores"], {"images": images.detach().float().cpu().numpy()})
        return torch.from_numpy(scores)

    return GraphModel("onnx", spec, run, torch.device("cpu"))


def _check_spec(path: Path, spec: dict[str, Any], fmt: str) -> None:
    if spec.get("format") != f"drl-{fmt}":
        raise IntegrityError(f"{path} is a {fmt} file but not a drl export; pass a file written by `drl export`")
    if spec.get("format_version") != FORMAT_VERSION:
        raise IntegrityError(
            f"{path} has {fmt} export format {spec.get('format_version')}, this drl reads {FORMAT_VERSION}; "
            "use the drl release that wrote it"
        )
    missing = [k for k in ("class_names", "data_config", "payload_sha256") if k not in spec]
    if missing:
        raise IntegrityError(f"{path} has an incomplete spec (no {', '.join(missing)}); export it again")


def _short(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else exc.__class__.__name__
