"""The single-file inference artifact: PTM weights, stage weights, real prototypes, class names,
data config and scoring options in one safetensors file, loadable without the run directory.
``export_run`` also writes the serving graphs (``--format torchscript|onnx``, see ``traced.py``),
and ``load_model`` reads any of the three.

The file's metadata holds ``format``/``format_version`` and a JSON ``spec``; ``payload_sha256``
covers every tensor (name, dtype, shape, bytes), so a damaged file is refused, never used.
It is written to a temporary name beside the target and renamed into place.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import __version__, backbone
from .backbone import PTMSource
from .config import RunConfig
from .errors import IntegrityError, StorageError, UsageError
from .methods import method_of
from .model import IncrementalModel
from .traced import GRAPH_FORMATS, GraphModel, load_graph, sniff_format, write_graph

FORMAT = "drl-export"
FORMAT_VERSION = "1"
FORMATS = ("drl", *GRAPH_FORMATS)
SUFFIX_FORMATS = {".onnx": "onnx", ".pt": "torchscript", ".ts": "torchscript", ".torchscript": "torchscript"}


@dataclass(frozen=True)
class ExportResult:
    path: str
    bytes: int
    num_stages: int
    num_classes: int
    format: str = "drl"
    run_dir: str | None = None
    check_max_abs_diff: float | None = None  # graphs: |scores - eager scores| on a random check batch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_export(
    model: IncrementalModel, ptm_record: dict[str, Any], config: RunConfig, out_path: Path
) -> ExportResult:
    network = model.network
    tensors = {f"ptm.{k}": v for k, v in network.ptm.state_dict().items()}
    for i, stage in enumerate(network.stages):
        tensors.update({f"stage.{i}.{k}": v for k, v in stage.state_dict().items()})
    if model.head is not None:
        tensors.update({f"head.{k}": v for k, v in model.head.state_dict().items()})
    tensors["prototypes"] = model.real_prototypes
    tensors["class_stage"] = model.class_stage
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    spec = {
        "drl_version": __version__,
        "method": config.method,
        "config": config.to_dict(),
        "ptm": {k: ptm_record[k] for k in ("name", "kwargs", "sha256")},
        "data_config": model.data_config,
        "num_stages": network.num_stages,
        "class_names": model.class_names,
    }
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "spec": json.dumps(spec),
        "payload_sha256": backbone.tensors_sha256(tensors),
    }
    out_path = Path(out_path)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, out_path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StorageError(
            f"cannot write export {out_path}: {exc.strerror or exc}; free space or pick another --out"
        ) from exc
    return ExportResult(str(out_path), out_path.stat().st_size, model.num_stages, len(model.class_names))


def resolve_format(fmt: str | None, out_path: Path) -> str:
    """The export format: as given, else from the file suffix (.onnx, .pt/.ts/.torchscript), else drl."""
    if fmt is None:
        return SUFFIX_FORMATS.get(Path(out_path).suffix.lower(), "drl")
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    return fmt


def export_run(
    run_dir: Path | str, out_path: Path, *, fmt: str | None = None, ptm_weights: Path | None = None
) -> ExportResult:
    """Write the run's current model as one file: ``drl`` (see module docstring), or a serving
    graph with the scoring baked in (``torchscript``, ``onnx``). Reads the run, never writes it."""
    from .api import load_run

    fmt = resolve_format(fmt, out_path)
    loaded = load_run(run_dir, device="cpu", ptm_weights=ptm_weights)
    if fmt == "drl":
        result = write_export(loaded.model, loaded.record["ptm"], loaded.config, out_path)
        return replace(result, run_dir=str(loaded.run.path))
    size, diff = write_graph(loaded.model, loaded.record["ptm"], loaded.config, Path(out_path), fmt=fmt)
    model = loaded.model
    return ExportResult(str(out_path), size, model.num_stages, len(model.class_names), fmt, str(loaded.run.path), diff)


def load_export(path: Path | str, *, device: str = "cpu") -> IncrementalModel:
    """Rebuild the model from an exported file alone (checksums verified)."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(str(path))
    except (OSError, SafetensorError, ValueError) as exc:
        raise IntegrityError(f"{path} is not a readable drl export ({exc}); export it again") from exc
    if metadata.get("format") != FORMAT:
        raise IntegrityError(f"{path} is not a drl export; pass a file written by `drl export`")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise IntegrityError(
            f"{path} has export format {metadata.get('format_version')}, this drl reads {FORMAT_VERSION}; "
            "use the drl release that wrote it"
        )
    if backbone.tensors_sha256(tensors) != metadata.get("payload_sha256"):
        raise IntegrityError(f"{path} is damaged (checksum mismatch); export it again")
    try:
        spec = json.loads(metadata["spec"])
        spec["config"], spec["ptm"], spec["class_names"]  # noqa: B018 (keys this format writes)
    except (KeyError, ValueError, TypeError) as exc:
        raise IntegrityError(f"{path} has an incomplete spec ({exc}); export it again with this drl") from exc
    ptm = backbone.create_ptm(spec["ptm"]["name"], source=PTMSource(random_init=True), kwargs=spec["ptm"]["kwargs"])
    backbone.load_state(ptm, {k[4:]: v for k, v in tensors.items() if k.startswith("ptm.")}, origin=str(path))
    config = RunConfig.from_dict(spec["config"])
    method = method_of(config)
    network = method.build(ptm, config)
    for i in range(spec["num_stages"]):
        stage = network.new_stage(seed=0)
        prefix = f"stage.{i}."
        stage.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
        stage.requires_grad_(False)
        stage.eval()
    head_state = {k[len("head.") :]: v for k, v in tensors.items() if k.startswith("head.")}
    head = method.head.from_state(head_state) if method.head is not None else None
    network.to(torch.device(device))
    return IncrementalModel(
        network=network,
        class_names=list(spec["class_names"]),
        class_stage=tensors["class_stage"],
        real_prototypes=tensors["prototypes"],
        score_cfg=config.score,
        data_config=spec["data_config"],
        offset=method.offset,
        head=head,
    )


def load_model(path: Path | str, *, device: str = "cpu") -> IncrementalModel | GraphModel:
    """Any export (``.drl``, TorchScript or ONNX, told apart by content) ready for ``predict``."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"model file {path} not found; pass a file written by `drl export`")
    fmt = sniff_format(path)
    return load_export(path, device=device) if fmt == "drl" else load_graph(path, fmt=fmt, device=device)
