"""What the benchmark measures beside accuracy: the inference time per image of a run, and its
stages rescored under other prototype-scoring options without training again."""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..data import ImageDataset, eval_transform, scan_class_folders
from ..evaluation import EVAL_BATCH_SIZE
from ..heads.prototypes import score, synthesize
from ..metrics import AccuracyReport, accuracy_report
from ..model import embed_images
from ..precision import autocast
from ..run.load import LoadedRun


def timing(loaded: LoadedRun, test_dir: Path, batch: int, *, precision: str = "fp32") -> float:
    """Median seconds per image of network + scoring on one batch of test images (after 1 warm-up),
    the network in ``precision``."""
    model = loaded.model
    images = scan_class_folders(test_dir, what="timing images")
    dataset = ImageDataset(images, eval_transform(model.data_config))
    n = min(batch, len(dataset))
    device = model.device
    x = torch.stack([dataset[i][0] for i in range(n)]).to(device)
    times = []
    with torch.inference_mode(), autocast(device, precision):
        for _ in range(6):  # the first is a warm-up
            start = time.perf_counter()
            model.score_images(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the run's GPU, not the current one
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / n


def rescore(
    loaded: LoadedRun,
    test_dirs: list[Path],
    scores: list[dict[str, Any]],
    *,
    num_workers: int = 0,
    precision: str = "fp32",
) -> list[tuple[dict[str, Any], list[AccuracyReport]]]:
    """A_t after every stage under other scoring options, without retraining.

    Stage t's model is the final one restricted to the classes of stages 1..t and their
    subspaces: a subspace never depends on later stages, so this is exact (with the run's own
    options it reproduces the recorded A_t). One pass of the final network over the test images.
    """
    model = loaded.model
    index = model.class_index()
    feats, targets = [], []
    for test_dir in test_dirs[: model.num_stages]:
        images = scan_class_folders(test_dir, what="test data")
        f, y = embed_images(
            model.network,
            images,
            model.data_config,
            batch_size=EVAL_BATCH_SIZE,
            num_workers=num_workers,
            precision=precision,
        )
        feats.append(f)
        targets.append(torch.tensor([index[name] for name in images.class_names])[y])
    features, target = torch.cat(feats), torch.cat(targets)
    stage_of = model.class_stage
    out = []
    for options in scores:
        cfg = dataclasses.replace(model.score_cfg, **options)
        reports = []
        for t in range(1, model.num_stages + 1):
            classes = stage_of <= t
            width = min(model.num_subspaces, model.offset + t)
            real = model.real_prototypes[classes][:, :width]
            bank = synthesize(real, stage_of[classes], tau=cfg.tau, offset=model.offset)
            rows = stage_of[target] <= t
            logits = score(
                features[rows][:, :width],
                bank,
                stage_of[classes],
                rule=cfg.rule,
                rho=cfg.rho,
                beta=cfg.beta,
                offset=model.offset,
            )
            # classes of stages <= t come first in the class list, so indices are unchanged
            reports.append(accuracy_report(logits.argmax(1), target[rows], stage_of, num_stages=t))
        out.append((options, reports))
    return out
