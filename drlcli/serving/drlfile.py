"""The single-file inference artifact: PTM weights, stage weights, real prototypes, class names,
data config and scoring options in one safetensors file, loadable without the run directory.
``export_run`` also writes the serving graphs (``--format torchscript|pt2|onnx``, see ``serving.py``),
and ``load_model`` reads any of the four, the format told by the file name (``modelfile.py``).

The file's metadata holds ``format``/``format_version`` and a JSON ``spec`` (class names, config,
PTM identity, data config) that carries ``payload_sha256`` over every tensor (name, dtype, shape,
bytes) and ``spec_sha256`` over the spec itself, so a damaged file is refused, never used.
Format 2 added ``spec_sha256``; a format-1 file is refused with "export it again". Format 3 keeps a
low-rank head's factor in float16 with its scale (older releases refuse it; this one reads 2).
It is written atomically (``storage.write_atomic``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from .. import jsonio, storage
from ..config import RunConfig
from ..errors import IntegrityError, PTMError, StorageError, UsageError
from ..heads import PROTOTYPES
from ..methods import method_of
from ..model import CLASS_STAGE, IncrementalModel, model_tensors, restore_model, with_prefix
from ..ptm import backbone
from ..ptm.backbone import PTMSource
from ..ptm.record import check_input_size
from ..run.files import TENSOR_DTYPES
from ..version import __version__
from . import modelfile

FORMAT = "drl-export"
FORMAT_VERSION = "3"  # 3: the low-rank class covariances' factor in float16 with its scale
READS = ("2",)  # format 2 (F_c in float32) loads as it was written
PTM_PREFIX = "ptm."  # the PTM's weights; every other tensor is named as restore.py says
STAGE_PREFIX = "stage."  # restore.STAGE's prefix: stage.<i>.<param>
SPEC_TYPES = {
    "method": str,
    "config": dict,
    "ptm": dict,
    "data_config": dict,
    "num_stages": int,
    "class_names": list,
    "payload_sha256": str,
}


def write_export(model: IncrementalModel, ptm_record: dict[str, Any], config: RunConfig, out_path: Path) -> int:
    """Write ``model`` as one ``.drl`` file (atomically); returns its size in bytes."""
    network = model.network
    tensors = {PTM_PREFIX + k: v for k, v in network.ptm.state_dict().items()}
    tensors.update(model_tensors(model))  # the file's names are restore.py's
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    spec = {
        "drl_version": __version__,
        "method": config.method,
        "config": config.to_dict(),
        "ptm": {k: ptm_record[k] for k in ("name", "kwargs", "sha256")},
        "data_config": model.data_config,
        "num_stages": network.num_stages,
        "class_names": model.class_names,
        "payload_sha256": backbone.tensors_sha256(tensors),
    }
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "spec": jsonio.dumps(modelfile.with_checksum(spec)),
    }
    out_path = Path(out_path)
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        storage.write_atomic(out_path, save(tensors, metadata=metadata))  # mode 0644 less the umask
    except OSError as exc:
        raise StorageError(
            f"cannot write export {out_path}: {exc.strerror or exc}; free space or pick another --out"
        ) from exc
    return out_path.stat().st_size


def load_export(path: Path | str, *, device: str = "cpu") -> IncrementalModel:
    """Rebuild the model from an exported ``.drl`` file alone (checksums and structure verified)."""
    path = Path(path)
    modelfile.check_content(path, "drl")
    tensors, spec = _read_export(path)
    kwargs = backbone.check_ptm_kwargs(spec["ptm"].get("kwargs"), origin=str(path), error=IntegrityError)
    ptm = backbone.create_ptm(
        spec["ptm"]["name"], source=PTMSource(random_init=True), kwargs=kwargs, unsupported=IntegrityError
    )
    config = _config(path, spec["config"])
    try:
        check_input_size(spec["data_config"], ptm)
    except UsageError as exc:
        raise IntegrityError(f"{path} has a malformed data_config ({exc}); export it again") from exc
    with _fitting(path):
        backbone.load_state(ptm, with_prefix(tensors, PTM_PREFIX), origin=str(path))
    offset = method_of(config).offset
    _check_class_tensors(path, tensors, len(spec["class_names"]), spec["num_stages"], backbone.width(ptm), offset)

    def fit_error(position: int | None, exc: Exception) -> IntegrityError:
        return _fit_error(path)

    model = restore_model(
        ptm,
        config,
        tensors,
        class_names=list(spec["class_names"]),
        num_stages=spec["num_stages"],
        data_config=spec["data_config"],
        fit_error=fit_error,
    )
    model.network.to(torch.device(device))
    if model.head is not None:
        model.head.to(torch.device(device))
    return model


def _read_export(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and spec of a .drl file, every checksum and the spec's structure verified."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(str(path))
    except Exception as exc:  # the safetensors parser meets untrusted bytes: any failure means damage
        raise IntegrityError(f"{path} is not a readable drl export ({str(exc)[:100]}); export it again") from exc
    if metadata.get("format") != FORMAT:
        raise IntegrityError(f"{path} is not a drl export; pass a file written by `drl export`")
    _check_tensors(path, tensors)
    modelfile.check_version(path, metadata.get("format_version"), FORMAT_VERSION, what="drl export", also=READS)
    spec = modelfile.parse_spec(path, metadata.get("spec", ""))
    modelfile.check_spec_sha256(path, spec)
    if backbone.tensors_sha256(tensors) != spec.get("payload_sha256"):
        raise IntegrityError(f"{path} is damaged (checksum mismatch); export it again")
    modelfile.require_keys(path, spec, SPEC_TYPES)
    modelfile.require_keys(path, spec["ptm"], {"name": str, "sha256": str})
    modelfile.check_class_names(path, spec["class_names"])
    modelfile.check_data_config(path, spec["data_config"])
    stored = {name.split(".", 2)[1] for name in tensors if name.startswith(STAGE_PREFIX)}
    # at most one stage per stored stage's parameters (a stage may have no class left: drl forget)
    if not 0 <= spec["num_stages"] <= len(stored):
        raise IntegrityError(f"{path} has a malformed spec (num_stages {spec['num_stages']}); export it again")
    return tensors, spec


def _check_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor of a dtype drl writes, and finite."""
    odd = next((f"{k} ({v.dtype})" for k, v in tensors.items() if v.dtype not in TENSOR_DTYPES), None)
    if odd is not None:
        raise IntegrityError(f"{path} holds tensor {odd} of a dtype drl never writes; export it again")
    bad = next((k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    if bad is not None:  # a run refuses the same tensors: an export never answers from them
        raise IntegrityError(f"{path} holds tensor {bad} with NaN or infinite values; export it again")


def _config(path: Path, data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.from_dict(data)
    except UsageError as exc:
        raise IntegrityError(f"{path} has an invalid config ({exc}); export it again") from exc


def _check_class_tensors(
    path: Path, tensors: dict[str, torch.Tensor], num_classes: int, num_stages: int, width: int, offset: int
) -> None:
    """``class_stage`` (C,) and ``prototypes`` (C, S, d), checked against the class names and the network."""
    class_stage, prototypes = tensors.get(CLASS_STAGE), tensors.get(PROTOTYPES)
    # num_stages counts stage networks: none for a method that trains nothing, or a stage nothing reads
    fits = (
        class_stage is not None
        and prototypes is not None
        and class_stage.dtype == torch.long
        and tuple(class_stage.shape) == (num_classes,)
        and bool((class_stage >= 1).all())
        and prototypes.is_floating_point()
        and tuple(prototypes.shape) == (num_classes, offset + num_stages, width)
    )
    if not fits:
        raise IntegrityError(f"{path}: class names, class stages and prototypes do not fit together; export it again")


def _fit_error(path: Path) -> IntegrityError:
    return IntegrityError(f"{path}: its weights do not fit the model its spec describes; export it again")


@contextlib.contextmanager
def _fitting(path: Path) -> Iterator[None]:
    """Weights that do not fit the network the spec describes: a damaged or crafted file (exit 5)."""
    try:
        yield
    except (PTMError, RuntimeError, KeyError) as exc:
        raise _fit_error(path) from exc
