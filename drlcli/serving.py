"""Serving graphs: the TorchScript, torch.export (``.pt2``) and ONNX exports of the single-pass
network and its scoring.

The graph takes a preprocessed image batch ``images`` (B, 3, H, W) float32 (resized, centre-
cropped and normalised as the PTM's data config says) and returns ``scores`` (B, C), one column
per class in ``class_names`` order, and ``known`` (B,), the open-set score of ``openset.py``
(below 0: no learned class claims the image; the spec's ``open_set.calibrated`` says whether the
run calibrated it, else ``known`` is meaningless and ignored). The prototype bank (synthesised prototypes included) and the
scoring weights are constants of the graph, so serving needs neither drl nor the run directory:
``torch.jit.load``, ``torch.export.load`` or onnxruntime. The batch axis is dynamic; H and W are
the PTM's input size.

What a server needs beside the graph is recorded in the file as one ``spec``: class names,
preprocessing (mean, std, input size, interpolation, crop), PTM name and sha256, the scoring
options, ``payload_sha256`` over the weights and ``spec_sha256`` over the spec (``modelfile.py``),
so a damaged file is refused, never used. TorchScript keeps it in ``_extra_files["drl.json"]``;
``.pt2`` in the archive's extra files (``torch.export.save(..., extra_files={"drl.json": ...})``,
``payload_sha256`` over the program's state_dict and tensor constants); ONNX in
``metadata_props``, one key per top-level entry (strings as they are, everything else as JSON).
Graph format 2 added ``spec_sha256``. In an ONNX file the graph itself decides every answer (one
attribute or input name changes them), so ONNX format 4 adds ``model_sha256``: sha256 over the
whole ModelProto (every node, name, attribute, subgraph, initializer, opset import, graph
input/output, metadata entry), deterministically serialized without that one entry, checked before
onnxruntime sees the model; older ONNX exports are refused with "export it again".

Loading a TorchScript file runs its code, and ``torch.export.load`` unpickles (falling back to
``weights_only=False``), so ``load_graph`` needs ``trust_code=True`` for both; an ONNX file is data
for onnxruntime, loaded freely, but only what drl writes: the standard operators its exporters emit
(``ONNX_OPS``: no loops, no functions, no custom-op domains), weights inside the file. The exporters'
notes (stack traces with the exporting machine's source paths, doc strings) are stripped before
the file is sealed.

ONNX is written by the torch.export-based exporter (``torch.onnx.export(dynamo=True)``, needs
onnxscript); the TorchScript-based one (deprecated upstream) is only the fallback when that fails.

While a graph is traced or exported, the network runs its functional path (``exportable``: no
in-place writes into ``out=`` slices, no cached parameter copies), chosen explicitly here, never
by asking the tracer; ``write_graph`` still checks the result against the eager model before writing it.

A graph serves; it cannot learn more stages (export again from the run after ``learn-stage``).
``ease`` graphs run one ViT pass per stage, as the method does.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from . import __version__, backbone, jsonio, modelfile, storage
from .config import RunConfig
from .errors import IntegrityError, RunStateError, StorageError, require
from .model import IncrementalModel
from .modelfile import format_of
from .openset import CosineKnown, split_probe
from .precision import autocast
from .prototypes import concat_scores, score_weights, weighted_scores

GRAPH_FORMATS = ("torchscript", "pt2", "onnx")
FORMAT_VERSION = "3"  # TorchScript and .pt2
READABLE_VERSIONS = ("2",)  # older TorchScript and .pt2 formats still loaded (no ``known`` output)
ONNX_FORMAT_VERSION = "4"  # model_sha256 over the whole model; no older ONNX format is read (unsealed graphs)
MODEL_SHA256 = "model_sha256"  # the ONNX metadata entry sealing the whole model (``seal_onnx``)
ONNX_DOMAINS = ("", "ai.onnx")  # standard operators only: no custom-op libraries
# The op types drl's exporters write (torch.export-based and TorchScript-based, every method and ViT
# option), plus QuickGELU's Sigmoid and tanh-GELU's Tanh: anything else (Loop, Scan, ...) is a file drl
# did not write. If is the TorchScript-based exporter's squeeze of a dynamic axis: it runs one branch
# once, and its branches are held to this list too.
ONNX_OPS = frozenset(
    "Add AveragePool Cast Clip Concat Constant ConstantOfShape Conv Div Einsum Equal Erf Expand Flatten Gather "  # noqa: SIM905
    "Gemm Identity If LayerNormalization MatMul Mul Pow ReduceL2 ReduceMax ReduceMean ReduceSum Relu Reshape "
    "Shape Sigmoid Slice Softmax Split Sqrt Squeeze Sub Tanh Transpose Unsqueeze Where".split()
)
ONNX_OUTPUTS = ["scores", "known"]
ONNX_NOTES = ("doc_string", "metadata_props")  # exporter notes in any ONNX message: stack traces, source paths
ONNX_QUIET = 4  # onnxruntime logs fatal errors only: its lines quote the file's node names raw
ONNX_OPSET = 18
SPEC_FILE = "drl.json"  # TorchScript and .pt2 extra file
JSON_KEYS = ("ptm", "num_stages", "class_names", "class_stage", "data_config", "score", "input", "output", "open_set")
CHECK_TOLERANCE = 1e-3  # a graph that disagrees more with the eager model on a check batch is not written
ONNX_PACKAGES = ("onnx", "onnxruntime")  # the export extra (onnxscript too: the dynamo exporter)
PT2_CONSTANT = "constant."  # prefix of a .pt2 program's tensor constants in its payload checksum
log = logging.getLogger(__name__)


class ScoringGraph(nn.Module):
    """Network + prototype scoring: images (B, 3, H, W) -> scores (B, C). Only constants besides the network."""

    def __init__(self, model: IncrementalModel):
        super().__init__()
        self.network = model.network
        self.head = model.head  # an analytic head (ranpac) replaces the prototype scoring
        self.stages = model.stages_scored  # the head's subspaces only: the others are not computed
        self.layout = model.layout_scored  # and its PTM layout rows, if any
        self.probes = model.probes_read  # and the class tokens the open-set score reads
        self.probe_weight = model.probe_weight
        bank = model.prototype_bank().detach()  # (C, S, d), synthesised rows included
        cfg = model.score_cfg
        weights = score_weights(model.class_stage, bank.shape[1], rho=cfg.rho, beta=cfg.beta, offset=model.offset)
        if self.head is not None:  # it reads the bank only for the open-set score, in subspace 0
            bank, weights = bank[:, :1], weights[:, :1]
        self.register_buffer("bank", bank.clone())
        self.register_buffer("weights", weights.clone())  # (C, S)
        self.concat = model.score_cfg.rule == "concat"
        known = model.known_module()  # uncalibrated: a cosine against a zero bias, flagged in the spec
        self.known = known if known is not None else CosineKnown(bank[:, 0], torch.zeros(len(model.class_names)))
        self.known.to(bank.device)

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        features = self.network(images, self.stages, self.layout, self.probes)  # (B, S [+ g²] [+ 1], d)
        features, inputs = split_probe(features, len(self.probes), self.probe_weight)  # f_0: never synthesised
        known = self.known(inputs)
        if self.head is not None:
            return self.head(features), known
        if self.concat:
            return concat_scores(features, self.bank), known
        return weighted_scores(features, self.bank, self.weights), known


@dataclass
class GraphModel:
    """A loaded TorchScript or ONNX export; offers what ``predict`` needs, like ``IncrementalModel``."""

    format: str
    spec: dict[str, Any]
    run: Callable[[Tensor], Any]  # images (B, 3, H, W) -> scores (B, C) [format 2] or (scores, known (B,))
    device: torch.device

    @property
    def class_names(self) -> list[str]:
        return list(self.spec["class_names"])

    @property
    def data_config(self) -> dict[str, Any]:
        return self.spec["data_config"]

    @property
    def num_stages(self) -> int:
        """The stages the spec says the export holds, as ``IncrementalModel.num_stages`` (predict logs it);
        0 where a crafted spec says no int (the spec is checksummed: nothing else reads it)."""
        value = self.spec.get("num_stages")
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    @property
    def calibrated(self) -> bool:
        entry = self.spec.get("open_set")
        return isinstance(entry, dict) and entry.get("calibrated") is True

    def score_images(self, images: Tensor) -> Tensor:
        return self.classify(images)[0]

    def classify(self, images: Tensor) -> tuple[Tensor, Tensor | None]:
        """Class scores (B, C) and known(x) (B,) (None when the export is not calibrated)."""
        try:
            out = self.run(images)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # the file's own graph fails on input its own data_config describes
            raise IntegrityError(
                f"the {self.format} graph cannot score {tuple(images.shape)} images ({_short(exc)}); export it again"
            ) from exc
        scores, known = out if isinstance(out, (tuple, list)) else (out, None)
        if scores.dim() != 2 or scores.shape[1] != len(self.spec["class_names"]):
            raise IntegrityError(
                f"the {self.format} graph gives {tuple(scores.shape)} scores for {len(self.spec['class_names'])} "
                "class names; export it again"
            )
        if not self.calibrated:
            return scores, None
        if known is None or tuple(known.shape) != (scores.shape[0],):
            found = None if known is None else tuple(known.shape)
            raise IntegrityError(f"the {self.format} graph gives known scores of shape {found}; export it again")
        return scores, known


# ------------------------------------------------------------------------------- writing


def graph_spec(model: IncrementalModel, ptm_record: dict[str, Any], config: RunConfig, fmt: str) -> dict[str, Any]:
    size = [int(v) for v in model.data_config["input_size"]]
    return {
        "format": f"drl-{fmt}",
        "format_version": ONNX_FORMAT_VERSION if fmt == "onnx" else FORMAT_VERSION,
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
        "open_set": {
            "calibrated": model.open_set_answer is not None,
            "score": model.open_set_answer,  # openset.RULES; null when uncalibrated
            "output": {"name": "known", "shape": ["batch"], "dtype": "float32"},
            "rule": "unknown when known < 0 (no learned class claims the image)",
        },
    }


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
        expected = _joined(*graph(check))  # the eager model, as predict runs it
        with exportable(graph.network):
            data = GRAPH_WRITERS[fmt](graph, example, spec)
    diffs = []

    def agrees(tmp: Path) -> None:
        for device in check_devices(fmt):  # a graph must run wherever it may be loaded, not only here
            loaded = load_graph(tmp, fmt=fmt, device=device, trust_code=True)  # just traced from our own model
            # in IEEE fp32 on CUDA too, as drl runs fp32 there (precision.autocast): TF32 convolutions
            # alone move the ridge head's scores by about the tolerance
            with torch.no_grad(), autocast(torch.device(device), "fp32"):
                got = _joined(*loaded.classify(check.to(loaded.device)))
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


def _joined(scores: Tensor, known: Tensor | None) -> Tensor:
    """Scores (B, C) with known(x) as one more column when there is one: what a check compares."""
    scores = scores.float().cpu()
    return scores if known is None else torch.cat([scores, known.float().cpu()[:, None]], dim=1)


@contextlib.contextmanager
def exportable(network: nn.Module) -> Iterator[None]:
    """Run ``network`` on its functional path for the block (``IPANetwork.exportable``): what a
    tracer or exporter must record. Networks without the flag (ease) have one path only."""
    if not hasattr(network, "exportable"):
        yield
        return
    before = network.exportable
    network.exportable = True
    try:
        yield
    finally:
        network.exportable = before


def check_devices(fmt: str) -> list[str]:
    """The device types a fresh export is checked on: CPU always; for TorchScript and pt2 CUDA too when this
    host has it (an ONNX graph is checked on onnxruntime's CPU provider)."""
    return ["cpu", "cuda"] if fmt in ("torchscript", "pt2") and torch.cuda.is_available() else ["cpu"]


def _torchscript_bytes(graph: ScoringGraph, example: Tensor, spec: dict[str, Any]) -> bytes:
    with warnings.catch_warnings():
        # only the tracer's own notes on shapes read as Python numbers (block and stage counts, head
        # sizes, fixed by the model; the batch axis stays dynamic, checked by write_graph); torch's
        # deprecation warnings for TorchScript go through
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(graph, example, check_trace=False)
    spec = modelfile.with_checksum({**spec, "payload_sha256": backbone.tensors_sha256(traced.state_dict())})
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer, _extra_files={SPEC_FILE: jsonio.dumps(spec)})
    return buffer.getvalue()


def _batch_dim() -> dict[str, dict[int, Any]]:
    """The images' batch axis, dynamic (``torch.export.Dim``); every other axis is the PTM's."""
    return {"images": {0: torch.export.Dim("batch", min=1)}}


def _pt2_payload(program: Any) -> dict[str, Tensor]:
    """What ``payload_sha256`` covers in a .pt2: the program's state_dict and its tensor constants."""
    tensors = dict(program.state_dict)
    tensors.update({PT2_CONSTANT + k: v for k, v in program.constants.items() if isinstance(v, Tensor)})
    return tensors


def _pt2_bytes(graph: ScoringGraph, example: Tensor, spec: dict[str, Any]) -> bytes:
    """``torch.export`` (strict=False: no TorchDynamo bytecode tracing) of the graph, saved with the spec."""
    program = torch.export.export(graph, (example,), dynamic_shapes=_batch_dim(), strict=False)
    spec = modelfile.with_checksum({**spec, "payload_sha256": backbone.tensors_sha256(_pt2_payload(program))})
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files={SPEC_FILE: jsonio.dumps(spec)})
    return buffer.getvalue()


def _onnx_bytes(graph: ScoringGraph, example: Tensor, spec: dict[str, Any]) -> bytes:
    """PyTorch's torch.export-based ONNX exporter; its TorchScript-based one only as the fallback.
    The network takes its functional path while exported (``exportable``); ``write_graph`` checks
    the result against the eager model anyway, whichever exporter wrote it."""
    onnx = require("onnx", extra="export", purpose="--format onnx")
    printed = io.StringIO()  # the exporters report their steps on stdout, which belongs to results
    with contextlib.redirect_stdout(printed):
        try:
            data = _onnx_dynamo(graph, example)
        except Exception as exc:
            # The dynamo exporter needs onnxscript (the export extra installs it) and covers fewer
            # cases than the tracer; the TorchScript-based exporter (deprecated upstream, still in
            # torch) keeps `drl export --format onnx` working where it fails. Its deprecation
            # warning is let through.
            log.warning(
                "the torch.export-based ONNX exporter failed (%s); using the TorchScript-based one", _short(exc)
            )
            data = _onnx_torchscript(graph, example)
    if printed.getvalue().strip():
        log.debug("%s", printed.getvalue().strip())
    proto = onnx.load_from_string(data)
    _strip_notes(proto)
    unknown = _unknown_ops(proto)
    if unknown:  # a new torch writes an op drl does not load: fail here, not in the check below
        raise IntegrityError(
            f"the ONNX exporter wrote operators {unknown} that drl does not load (serving.ONNX_OPS); "
            "nothing was written (please report it with `drl info --json`)"
        )
    spec = modelfile.with_checksum({**spec, "payload_sha256": _onnx_payload_sha256(proto)})
    for key, value in spec.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value if isinstance(value, str) else jsonio.dumps(value)
    proto.producer_name, proto.producer_version = "drl", __version__
    onnx.checker.check_model(proto)
    return seal_onnx(proto)


def _strip_notes(message: Any) -> None:
    """Clear ``doc_string`` and ``metadata_props`` in ``message`` and every message below it. The
    torch.export-based exporter notes each node's Python stack trace (the exporting machine's absolute
    source paths) and its graph signature there; nothing reads them, and a shared file must not carry them."""
    for field, value in message.ListFields():
        if field.name in ONNX_NOTES:
            message.ClearField(field.name)
        elif field.message_type is not None:
            for item in [value] if hasattr(value, "ListFields") else value:
                _strip_notes(item)


def seal_onnx(proto: Any) -> bytes:
    """The ONNX file's bytes: ``proto`` with ``model_sha256`` over all of it (``onnx_model_sha256``),
    replacing any entry it had."""
    _take_entries(proto, MODEL_SHA256)
    digest = onnx_model_sha256(proto)
    entry = proto.metadata_props.add()
    entry.key, entry.value = MODEL_SHA256, digest
    return proto.SerializeToString(deterministic=True)


def onnx_model_sha256(proto: Any) -> str:
    """sha256 over the whole model as protobuf serializes it deterministically (field order, no map
    reordering): every byte onnxruntime reads. ``proto`` must hold no ``model_sha256`` entry."""
    return hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()


def _take_entries(proto: Any, key: str) -> list[str]:
    """Remove the model's ``key`` metadata entries; their values, in file order."""
    props = proto.metadata_props
    values = [entry.value for entry in props if entry.key == key]
    for index in reversed([i for i, entry in enumerate(props) if entry.key == key]):
        del props[index]
    return values


def _graph_ops(graph: Any) -> Iterator[tuple[str, str]]:
    """(domain, op_type) of every node of ``graph`` and of the graphs its nodes hold (an If's branches)."""
    for node in graph.node:
        yield node.domain, node.op_type
        for attr in node.attribute:
            for sub in [attr.g, *attr.graphs] if attr.HasField("g") else attr.graphs:
                yield from _graph_ops(sub)


def _unknown_ops(proto: Any) -> list[str]:
    """The op types of ``proto`` outside ``ONNX_OPS`` (with their domain when it is not the standard one)."""
    found = {op if domain in ONNX_DOMAINS else f"{domain}.{op}" for domain, op in _graph_ops(proto.graph)}
    return sorted(found - ONNX_OPS)


def _onnx_dynamo(graph: ScoringGraph, example: Tensor) -> bytes:
    program = torch.onnx.export(
        graph,
        (example,),
        dynamo=True,
        input_names=["images"],
        output_names=["scores", "known"],
        opset_version=ONNX_OPSET,
        dynamic_shapes=_batch_dim(),
        optimize=True,
        verbose=False,
    )
    return program.model_proto.SerializeToString()


def _onnx_torchscript(graph: ScoringGraph, example: Tensor) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # as in _torchscript_bytes
        torch.onnx.export(
            graph,
            (example,),
            buffer,
            dynamo=False,
            input_names=["images"],
            output_names=["scores", "known"],
            opset_version=ONNX_OPSET,
            dynamic_axes={"images": {0: "batch"}, "scores": {0: "batch"}, "known": {0: "batch"}},
        )
    return buffer.getvalue()


GRAPH_WRITERS = {"torchscript": _torchscript_bytes, "pt2": _pt2_bytes, "onnx": _onnx_bytes}


def onnx_providers(device: str, available: list[str]) -> list[str]:
    """onnxruntime's execution providers for ``device``: CUDA first when the device is a GPU and this
    onnxruntime has the CUDA provider (onnxruntime-gpu), then the CPU one (always)."""
    wants_gpu = torch.device(device).type == "cuda"
    if wants_gpu and "CUDAExecutionProvider" not in available:
        log.warning("onnxruntime has no CUDA provider (install onnxruntime-gpu): the ONNX graph runs on the CPU")
    if wants_gpu and "CUDAExecutionProvider" in available:
        index = torch.device(device).index or 0
        return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]  # type: ignore[list-item]
    return ["CPUExecutionProvider"]


def _onnx_session(data: bytes, device: str = "cpu") -> Any:
    ort = require("onnxruntime", extra="export", purpose="running an ONNX export")
    options = ort.SessionOptions()
    # fatal only: onnxruntime's warnings and errors are coloured lines on stderr that quote node and
    # tensor names from the file raw (escape sequences included); an error reaches the user as drl's
    # own one line (IntegrityError), escaped by the CLI
    options.log_severity_level = ONNX_QUIET
    # as many CPU threads as torch uses (torch.set_num_threads), not onnxruntime's own default
    # (every physical core): an ONNX export runs on the same CPU budget as the other formats
    options.intra_op_num_threads = max(1, torch.get_num_threads())
    providers = onnx_providers(device, list(ort.get_available_providers()))
    return ort.InferenceSession(data, sess_options=options, providers=providers)


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


def load_graph(
    path: Path | str, *, fmt: str | None = None, device: str = "cpu", trust_code: bool = False
) -> GraphModel:
    """Load a TorchScript or .pt2 (only with ``trust_code``: loading may run the file's code) or ONNX
    export and check its content, spec and weights. ``fmt`` defaults to what the file name says."""
    path = Path(path)
    fmt = fmt or format_of(path)
    modelfile.require_trust(path, fmt, trust_code)
    modelfile.check_content(path, fmt)
    loader = {"torchscript": _load_torchscript, "pt2": _load_pt2}.get(fmt, _load_onnx)
    return loader(path, device)


def _load_torchscript(path: Path, device: str) -> GraphModel:
    extra = {SPEC_FILE: ""}
    try:
        module = torch.jit.load(str(path), map_location=torch.device(device), _extra_files=extra)
    except (RuntimeError, ValueError, OSError) as exc:
        raise IntegrityError(
            f"{path} is not a readable drl TorchScript export ({_short(exc)}); export it again"
        ) from exc
    if not extra[SPEC_FILE]:
        raise IntegrityError(
            f"{path} is a torchscript file but not a drl export (no {SPEC_FILE}); pass a file written by `drl export`"
        )
    spec = modelfile.parse_spec(path, extra[SPEC_FILE])
    _check_spec(path, spec, "torchscript")
    if backbone.tensors_sha256(module.state_dict()) != spec["payload_sha256"]:
        raise IntegrityError(f"{path} is damaged (checksum mismatch); export it again")
    module.eval()
    return GraphModel("torchscript", spec, module, torch.device(device))


def _load_pt2(path: Path, device: str) -> GraphModel:
    extra = {SPEC_FILE: ""}
    program = _pt2_step(path, "not a readable drl pt2 export", lambda: _read_pt2(path, extra))
    text = extra[SPEC_FILE]
    if not text:
        raise IntegrityError(
            f"{path} is a pt2 file but not a drl export (no {SPEC_FILE}); pass a file written by `drl export`"
        )
    spec = modelfile.parse_spec(path, text.decode() if isinstance(text, bytes) else text)
    _check_spec(path, spec, "pt2")
    if backbone.tensors_sha256(_pt2_payload(program)) != spec["payload_sha256"]:
        raise IntegrityError(f"{path} is damaged (checksum mismatch); export it again")
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        # the program's metadata asserts then name the GPU the inputs will be on: some torch releases
        # compare devices exactly, and "cuda" is not "cuda:0" there
        target = torch.device("cuda", torch.cuda.current_device())
    if target.type != "cpu":
        from torch.export import passes  # a submodule `import torch` leaves unimported

        program = _pt2_step(path, f"not movable to {target}", lambda: passes.move_to_device_pass(program, target))
    module = _pt2_step(path, "not a runnable drl pt2 export", program.module)
    return GraphModel("pt2", spec, module, target)


def _read_pt2(path: Path, extra: dict[str, Any]) -> Any:
    with open(path, "rb") as handle, _quiet("torch.export"):
        zipfile.ZipFile(handle).namelist()  # an unreadable archive is refused here, before torch reads it
        handle.seek(0)
        # a handle, not the path: torch.export.load takes a path by its suffix, a handle as pt2;
        # its own failures are logged as warnings with a trace: the IntegrityError says it
        return torch.export.load(handle, extra_files=extra)


def _pt2_step(path: Path, what: str, step: Callable[[], Any]) -> Any:
    """One step of reading a .pt2: whatever torch raises on a damaged or crafted archive is exit 5."""
    try:
        return step()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # torch's deserializer meets a file: any failure means damage
        raise IntegrityError(f"{path} is {what} ({_short(exc)}); export it again") from exc


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Logger ``name`` says errors only for the block."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)


def _load_onnx(path: Path, device: str = "cpu") -> GraphModel:
    onnx = require("onnx", extra="export", purpose="reading an ONNX export")
    require("onnxruntime", extra="export", purpose="running an ONNX export")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise IntegrityError(f"{path} is not a readable ONNX file ({_short(exc)}); export it again") from exc
    sealed = _take_entries(proto, MODEL_SHA256)
    _check_onnx_graph(path, proto)
    spec: dict[str, Any] = {}
    for entry in proto.metadata_props:
        spec[entry.key] = modelfile.parse_json(path, entry.value) if entry.key in JSON_KEYS else entry.value
    _check_spec(path, spec, "onnx")
    data = proto.SerializeToString(deterministic=True)  # what onnxruntime gets: the bytes checked here
    if sealed != [hashlib.sha256(data).hexdigest()]:
        raise IntegrityError(f"{path} is damaged (graph checksum mismatch); export it again")
    if _onnx_payload_sha256(proto) != spec["payload_sha256"]:
        raise IntegrityError(f"{path} is damaged (checksum mismatch); export it again")
    try:
        session = _onnx_session(data, device)
    except Exception as exc:
        raise IntegrityError(f"onnxruntime cannot load {path} ({_short(exc)}); export it again") from exc
    names = [o.name for o in session.get_outputs()]
    if names != ONNX_OUTPUTS:
        raise IntegrityError(f"{path} has graph outputs {names}, not a drl export's; export it again")
    ort = require("onnxruntime", extra="export", purpose="running an ONNX export")
    quiet = ort.RunOptions()
    quiet.log_severity_level = ONNX_QUIET  # as the session's (_onnx_session)

    def run(images: Tensor) -> Any:
        outputs = session.run(names, {"images": images.detach().float().cpu().numpy()}, quiet)
        return tuple(torch.from_numpy(o) for o in outputs)

    return GraphModel("onnx", spec, run, torch.device("cpu"))


def _check_onnx_graph(path: Path, proto: Any) -> None:
    """Only what drl writes: standard operators its exporters emit (no loops: a crafted trip count
    would hang predict), no functions, weights inside the file (no paths to other files)."""
    from onnx import TensorProto

    domains = {op.domain for op in proto.opset_import} | {f.domain for f in proto.functions}
    if not domains <= set(ONNX_DOMAINS):
        raise IntegrityError(
            f"{path} uses operator domains {sorted(domains - set(ONNX_DOMAINS))}; drl exports use standard operators only"
        )
    if any(t.data_location == TensorProto.EXTERNAL for t in proto.graph.initializer):
        raise IntegrityError(f"{path} refers to external weight files; drl exports hold their weights inside")
    if len(proto.functions):
        raise IntegrityError(f"{path} defines ONNX functions, which drl exports never hold; export it again")
    unknown = _unknown_ops(proto)
    if unknown:
        raise IntegrityError(
            f"{path} uses operators {unknown[:5]} that drl exports never hold (no loops, no custom ops); "
            "export the model again with `drl export`"
        )


def _check_spec(path: Path, spec: dict[str, Any], fmt: str) -> None:
    if spec.get("format") != f"drl-{fmt}":
        raise IntegrityError(f"{path} is a {fmt} file but not a drl export; pass a file written by `drl export`")
    if fmt == "onnx":  # format 4 seals the whole model: an older ONNX file's graph is covered by no checksum
        modelfile.check_version(
            path,
            spec.get("format_version"),
            ONNX_FORMAT_VERSION,
            what="drl ONNX export",
            older="whose checksums leave its graph out",
        )
    else:
        modelfile.check_version(
            path, spec.get("format_version"), FORMAT_VERSION, what=f"{fmt} export", also=READABLE_VERSIONS
        )
    modelfile.check_spec_sha256(path, spec)
    modelfile.require_keys(path, spec, {"class_names": list, "data_config": dict, "payload_sha256": str})
    modelfile.check_class_names(path, spec["class_names"])
    modelfile.check_data_config(path, spec["data_config"])


def _short(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else exc.__class__.__name__
