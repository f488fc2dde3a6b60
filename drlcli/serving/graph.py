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
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..config import RunConfig
from ..errors import IntegrityError
from ..heads.openset.rmd import CosineKnown, split_probe
from ..heads.prototypes import concat_scores, score_weights, weighted_scores
from ..model import IncrementalModel
from ..version import __version__
from . import modelfile

GRAPH_FORMATS = ("torchscript", "pt2", "onnx")
FORMAT_VERSION = "3"  # TorchScript and .pt2
ONNX_FORMAT_VERSION = "4"  # model_sha256 over the whole model; no older ONNX format is read (unsealed graphs)
READABLE_VERSIONS = ("2",)  # older TorchScript and .pt2 formats still loaded (no ``known`` output)
MODEL_SHA256 = "model_sha256"  # the ONNX metadata entry sealing the whole model (``seal_onnx``)
SPEC_FILE = "drl.json"  # TorchScript and .pt2 extra file
JSON_KEYS = ("ptm", "num_stages", "class_names", "class_stage", "data_config", "score", "input", "output", "open_set")
CHECK_TOLERANCE = 1e-3  # a graph that disagrees more with the eager model on a check batch is not written
PT2_CONSTANT = "constant."  # prefix of a .pt2 program's tensor constants in its payload checksum
log = logging.getLogger(__name__)


class ScoringGraph(nn.Module):
    """Network + prototype scoring: images (B, 3, H, W) -> scores (B, C). Only constants besides the network."""

    def __init__(self, model: IncrementalModel):
        super().__init__()
        self.network = model.network
        self.head = model.head  # an analytic head (heads/) replaces the prototype scoring
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
                f"the {self.format} graph cannot score {tuple(images.shape)} images ({short(exc)}); export it again"
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


def joined(scores: Tensor, known: Tensor | None) -> Tensor:
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


# ------------------------------------------------------------------------------- loading


def check_spec(path: Path, spec: dict[str, Any], fmt: str) -> None:
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


def short(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else exc.__class__.__name__


def batch_dim() -> dict[str, dict[int, Any]]:
    """The images' batch axis, dynamic (``torch.export.Dim``); every other axis is the PTM's."""
    return {"images": {0: torch.export.Dim("batch", min=1)}}


@contextlib.contextmanager
def quiet(name: str) -> Iterator[None]:
    """Logger ``name`` says errors only for the block."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)
