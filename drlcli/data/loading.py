"""From images to batches: timm's transforms of the PTM (evaluation and training), the dataset of
(tensor, label) pairs and every pass's DataLoader (workers, pinned memory)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from ..errors import UsageError
from ..options import MAX_WORKERS

if TYPE_CHECKING:
    from .images import LabelledImages


def make_loader(
    dataset: Dataset, *, batch_size: int, device: torch.device, num_workers: int = 0, **options: Any
) -> DataLoader:
    """Every pass's DataLoader (training, prototypes and statistics, evaluation, predict): ``num_workers``
    worker processes, and page-locked batches when they go to a GPU (``pin_memory``: the copy to the
    device can then overlap the next batch's loading)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=torch.device(device).type == "cuda",
        **options,
    )


def check_workers(num_workers: int) -> None:
    """``UsageError`` unless ``num_workers`` is a worker count a loader can take (``--workers``)."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or not 0 <= num_workers <= MAX_WORKERS:
        raise UsageError(f"--workers must be an integer in [0, {MAX_WORKERS}], got {num_workers!r}")


def start_workers(loader: DataLoader) -> Any:
    """``iter(loader)``, which starts its worker processes; a refusal by the OS is a usage error."""
    try:
        return iter(loader)
    except OSError as exc:
        raise UsageError(
            f"cannot start {loader.num_workers} data-loading worker processes ({exc.strerror or exc}); "
            "pass a smaller --workers"
        ) from exc


class ImageDataset(Dataset):
    """(image tensor, label) pairs; labels are offset into a global class index if asked."""

    def __init__(self, images: LabelledImages, transform: Any, *, label_map: list[int] | None = None):
        self.images = images
        self.transform = transform
        self.label_map = label_map

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = self.images.labels[index]
        if self.label_map is not None:
            label = self.label_map[label]
        return self.transform(self.images.load(index)), label


def eval_transform(data_config: dict[str, Any]) -> Any:
    """The PTM's own evaluation transform (resize, center crop, normalise) from its data config."""
    from timm.data import create_transform

    return create_transform(**_timm_config(data_config), is_training=False)


def train_transform(data_config: dict[str, Any], *, crop_scale_min: float, hflip: bool) -> Any:
    """timm's training transform: a random resized crop (area scale [crop_scale_min, 1], aspect
    ratio 3/4 to 4/3) to the PTM's input size with its interpolation, a horizontal flip (p 0.5) if
    ``hflip``, then the PTM's normalisation; none of timm's other augmentations (colour jitter,
    auto-augment, random erasing). timm's crop draws from Python's ``random``, its flip from
    torch's generator: ``train.py`` seeds and checkpoints both."""
    from timm.data import create_transform

    cfg = _timm_config(data_config)
    return create_transform(
        input_size=cfg["input_size"],
        is_training=True,
        scale=(crop_scale_min, 1.0),
        ratio=(3 / 4, 4 / 3),
        hflip=0.5 if hflip else 0.0,
        color_jitter=None,
        interpolation=cfg.get("interpolation", "bicubic"),
        mean=cfg["mean"],
        std=cfg["std"],
    )


def _timm_config(data_config: dict[str, Any]) -> dict[str, Any]:
    keys = ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode")
    out = {k: data_config[k] for k in keys if k in data_config}
    out["input_size"] = tuple(out["input_size"])
    out["mean"], out["std"] = tuple(out["mean"]), tuple(out["std"])
    return out
