"""ONNX graphs (see ``graph.py``): written by the torch.export-based exporter (the TorchScript-based
one only as a fallback), stripped of the exporters' notes and sealed (``model_sha256`` over the
whole model); read only when the seal holds and every operator is one the exporters write, and run
by onnxruntime with its own logging silenced."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import jsonio
from ..errors import IntegrityError, require
from ..version import __version__
from . import modelfile
from .graph import JSON_KEYS, MODEL_SHA256, GraphModel, ScoringGraph, batch_dim, check_spec, short

log = logging.getLogger(__name__)


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


ONNX_PACKAGES = ("onnx", "onnxruntime")  # the export extra (onnxscript too: the dynamo exporter)


def onnx_bytes(graph: ScoringGraph, example: Tensor, spec: dict[str, Any]) -> bytes:
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
            log.warning("the torch.export-based ONNX exporter failed (%s); using the TorchScript-based one", short(exc))
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
        dynamic_shapes=batch_dim(),
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


def load_onnx(path: Path, device: str = "cpu") -> GraphModel:
    onnx = require("onnx", extra="export", purpose="reading an ONNX export")
    require("onnxruntime", extra="export", purpose="running an ONNX export")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise IntegrityError(f"{path} is not a readable ONNX file ({short(exc)}); export it again") from exc
    sealed = _take_entries(proto, MODEL_SHA256)
    _check_onnx_graph(path, proto)
    spec: dict[str, Any] = {}
    for entry in proto.metadata_props:
        spec[entry.key] = modelfile.parse_json(path, entry.value) if entry.key in JSON_KEYS else entry.value
    check_spec(path, spec, "onnx")
    data = proto.SerializeToString(deterministic=True)  # what onnxruntime gets: the bytes checked here
    if sealed != [hashlib.sha256(data).hexdigest()]:
        raise IntegrityError(f"{path} is damaged (graph checksum mismatch); export it again")
    if _onnx_payload_sha256(proto) != spec["payload_sha256"]:
        raise IntegrityError(f"{path} is damaged (checksum mismatch); export it again")
    try:
        session = _onnx_session(data, device)
    except Exception as exc:
        raise IntegrityError(f"onnxruntime cannot load {path} ({short(exc)}); export it again") from exc
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
