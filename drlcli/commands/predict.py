"""``drl predict``: top-k classes for images, from a run directory or an exported file (``.drl``,
TorchScript, .pt2 or ONNX: anything with class names, a data config and ``score_images``).

Sources are image files, folders (every image below them, sorted), list files (``.txt``, one
path per line, relative paths taken from the list's folder) or ``-`` (paths on stdin). Results
stream in input order, one per image; an image that cannot be read gives an error entry and the
batch goes on.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from ..data import (
    ImagePathError,
    check_workers,
    eval_transform,
    image_extensions,
    load_rgb,
    make_loader,
    start_workers,
)
from ..data.images import hidden
from ..device import resolve_device
from ..errors import DataError, UsageError
from ..precision import autocast, check_precision
from ..progress import Progress, ProgressFn
from ..run.load import HEAD_NAMES, answering_head, load_run
from ..serving.formats import load_model
from ..serving.modelfile import format_of

log = logging.getLogger(__name__)


class Classifier(Protocol):
    """What predict needs: ``IncrementalModel`` (run, .drl) and ``serving.GraphModel`` offer it."""

    class_names: list[str]
    data_config: dict[str, Any]
    device: torch.device

    def score_images(self, images: torch.Tensor) -> torch.Tensor: ...

    def classify(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass(frozen=True)
class Prediction:
    path: str
    top: list[dict[str, Any]] = field(default_factory=list)  # [{"class", "score"}], best first
    error: str | None = None
    unknown: bool | None = None  # no learned class claims the image (openset.py); None: model uncalibrated
    known_score: float | None = None  # known(x): below 0 is unknown

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path}
        if self.error is not None:
            out["error"] = self.error
        else:
            out["top"] = self.top
            out["unknown"] = self.unknown
            out["known_score"] = self.known_score
        return out


def expand_sources(sources: Iterable[str], *, stdin: Iterable[str] | None = None) -> list[Path]:
    """Image paths from files, folders, list files and ``-`` (stdin), in the order given."""
    paths: list[Path] = []
    for source in sources:
        path = Path(source)
        if source == "-":
            paths.extend(Path(line.strip()) for line in (stdin if stdin is not None else sys.stdin) if line.strip())
        elif path.is_dir():
            paths.extend(_folder_images(path))
        elif path.suffix.lower() == ".txt" and path.is_file():
            paths.extend(_listed(path))
        else:
            paths.append(path)  # an image (a missing one is reported in its own result line)
    if not paths:
        raise UsageError("no images to predict; pass image files, folders, a .txt list or - for stdin")
    return paths


def _listed(list_file: Path) -> list[Path]:
    """The paths a .txt list names, one per line; relative ones are relative to the list's folder."""
    entries = [Path(line.strip()) for line in list_file.read_text().splitlines() if line.strip()]
    return [entry if entry.is_absolute() else list_file.parent / entry for entry in entries]


def _folder_images(folder: Path) -> list[Path]:
    """Every image below ``folder`` (by extension; hidden names skipped), sorted. A FIFO, device or
    dangling link named as an image is listed too, so its result line says what it is rather than
    the image vanishing without a word."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.suffix.lower() in image_extensions()
        and not p.is_dir()
        and not any(hidden(Path(q)) for q in p.relative_to(folder).parts)
    )


def image_error(exc: ImagePathError) -> str:
    """A result line's error for a path that is no image file, with its fix ("no such file" as ever
    for a missing one): a folder from a list or stdin is a folder source, a FIFO or device is not an
    image at all."""
    if exc.kind == "missing":
        return "no such file"
    if exc.kind == "dangling":
        return f"{exc}; fix the link or pass the image itself"
    if exc.kind == "folder":
        return f"{exc}: pass it as a folder source (drl predict FOLDER) to predict every image in it"
    if exc.kind == "special":
        return f"{exc}; pass the image file itself"
    return f"{exc}; check the path and its permissions"


class _PathDataset(Dataset):
    def __init__(self, paths: list[Path], transform: Any):
        self.paths, self.transform = paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor | None, str | None]:
        path = self.paths[index]
        try:
            return index, self.transform(load_rgb(path)), None
        except ImagePathError as exc:  # checked before anything opens it: a FIFO is never waited on
            return index, None, image_error(exc)
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            return index, None, f"cannot be decoded ({exc.__class__.__name__}: {exc})"


def _collate(
    items: list[tuple[int, torch.Tensor | None, str | None]],
) -> list[tuple[int, torch.Tensor | None, str | None]]:
    return items


def predict(
    model: Classifier,
    paths: list[Path],
    *,
    top_k: int = 5,
    batch_size: int = 64,
    num_workers: int = 0,
    precision: str = "fp32",
) -> Iterator[Prediction]:
    """Yield one ``Prediction`` per path, in order; images load in ``num_workers`` worker processes and
    the network runs in ``precision`` (the scores are fp32 whatever it is)."""
    if top_k < 1:
        raise UsageError(f"--top-k must be >= 1, got {top_k}")
    if not model.class_names:
        raise DataError("the model has learned no class yet; run `drl learn-stage` first")
    class_names = model.class_names
    k = min(top_k, len(class_names))
    device = model.device
    loader = make_loader(
        _PathDataset(paths, eval_transform(model.data_config)),
        batch_size=batch_size,
        device=device,
        num_workers=num_workers,
        shuffle=False,
        collate_fn=_collate,
    )
    with torch.inference_mode():
        for items in start_workers(loader):
            good = [(i, x) for i, x, err in items if err is None]
            scores, known = _classify(model, [x for _, x in good], precision) if good else (None, None)
            row = {i: r for r, (i, _) in enumerate(good)}
            for index, _, err in items:
                if err is not None:
                    yield Prediction(str(paths[index]), error=err)
                else:
                    margin = float(known[row[index]]) if known is not None else None
                    yield _answer(str(paths[index]), scores[row[index]], margin, class_names, k)


def _classify(model: Classifier, images: list[Tensor], precision: str) -> tuple[Tensor, Tensor | None]:
    """Class scores (B, C) and known(x) (B,) (None when uncalibrated) of a batch, fp32 on the CPU."""
    batch = torch.stack(images).to(model.device, non_blocking=True)  # (B, 3, H, W)
    with autocast(model.device, precision):
        scores, known = model.classify(batch)
    return scores.float().cpu(), known.float().cpu() if known is not None else None


def _answer(path: str, scores: Tensor, margin: float | None, class_names: list[str], k: int) -> Prediction:
    """One image's top ``k`` classes and whether it is unknown."""
    values, classes = scores.topk(k)
    return Prediction(
        path,
        top=[{"class": class_names[c], "score": round(float(v), 6)} for v, c in zip(values.tolist(), classes.tolist())],
        unknown=None if margin is None else margin < 0,
        known_score=None if margin is None else round(margin, 6),
    )


@dataclass
class PredictStats:
    images: int = 0
    failed: int = 0
    seconds: float = 0.0

    @property
    def predicted(self) -> int:
        """Images that got an answer (not an error line)."""
        return self.images - self.failed

    @property
    def images_per_second(self) -> float:
        """Over the images that got an answer: a batch of unreadable files has no rate."""
        return self.predicted / self.seconds if self.seconds and self.predicted else 0.0


def timed(predictions: Iterator[Prediction], stats: PredictStats) -> Iterator[Prediction]:
    start = time.perf_counter()
    for p in predictions:
        stats.images += 1
        stats.failed += p.error is not None
        stats.seconds = time.perf_counter() - start
        yield p


def load_classifier(
    *,
    model_path: Path | None = None,
    run_dir: Path | str = ".",
    device: str = "auto",
    ptm_weights: Path | None = None,
    trust_code: bool = False,
) -> tuple[Classifier, str | None]:
    """An exported file (``model_path``; TorchScript and .pt2 only with ``trust_code``), else the run's
    model, with the head a switched run answers from (``run.load.answering_head``; None otherwise)."""
    if model_path is not None:
        return load_model(model_path, device=str(resolve_device(device)), trust_code=trust_code), None
    loaded = load_run(run_dir, device=device, ptm_weights=ptm_weights)
    return loaded.model, answering_head(loaded)


def _log_loaded(model: Classifier, head: str | None, source: Any, seconds: float) -> None:
    """What was loaded: an export older than its run shows here (fewer classes and stages than
    `drl info` lists); a graph export records no stages; a switched run says which head answers."""
    stages = f" from {model.num_stages} stages" if model.num_stages else ""
    answering = f", answering from {HEAD_NAMES[head]}" if head in HEAD_NAMES else ""
    log.info("model %s: %d classes%s%s (loaded in %.1fs)", source, len(model.class_names), stages, answering, seconds)


def predict_sources(
    sources: Iterable[str],
    *,
    model_path: Path | None = None,
    run_dir: Path | str = ".",
    device: str = "auto",
    ptm_weights: Path | None = None,
    trust_code: bool = False,
    top_k: int = 5,
    batch_size: int = 64,
    num_workers: int = 0,
    precision: str = "fp32",
    stats: PredictStats | None = None,
    progress: ProgressFn | None = None,
) -> Iterator[Prediction]:
    """``drl predict``: expand ``sources`` (see ``expand_sources``), load the model (``load_classifier``)
    and yield one ``Prediction`` per image in order, counting them in ``stats``. ``precision`` (fp32,
    bf16, fp16 on CUDA) is for a run or a ``.drl`` file; TorchScript, .pt2 and ONNX graphs run as exported."""
    stats = stats if stats is not None else PredictStats()
    start = time.perf_counter()
    check_workers(num_workers)
    check_precision(precision, resolve_device(device))
    if precision != "fp32" and model_path is not None and format_of(model_path) != "drl":
        raise UsageError(
            f"--precision {precision} applies to a run or a .drl model; {Path(model_path).name} is a graph that runs "
            "as exported (fp32): leave --precision out"
        )
    paths = expand_sources(sources)
    if progress is not None:
        progress(Progress("load", 0, 0, str(model_path or run_dir)))
    model, head = load_classifier(
        model_path=model_path, run_dir=run_dir, device=device, ptm_weights=ptm_weights, trust_code=trust_code
    )
    _log_loaded(model, head, model_path or run_dir, time.perf_counter() - start)
    results = predict(model, paths, top_k=top_k, batch_size=batch_size, num_workers=num_workers, precision=precision)
    for p in timed(results, stats):
        if progress is not None:
            progress(Progress("predict", stats.images, len(paths), num_failed=stats.failed))
        yield p
    if stats.predicted > batch_size:  # a rate after the first batch's one-off costs are spread over more
        log.info("%d images, %d failed, %.1f images/s", stats.images, stats.failed, stats.images_per_second)
    else:
        log.info("%d image%s, %d failed", stats.images, "" if stats.images == 1 else "s", stats.failed)
