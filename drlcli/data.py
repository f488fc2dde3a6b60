"""Class-folder image sets: discovery, validation, fingerprints, datasets and transforms.

A data folder holds one sub-folder per class (ImageFolder layout); images may sit at any depth
inside their class folder. Every problem is a ``DataError`` naming the file and the fix, raised
before anything is trained or written.
"""

from __future__ import annotations

import hashlib
import os
import unicodedata
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset

from .errors import DataError, UsageError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
# Longest side an image is decoded at. Every PTM input (224-518 px) and its training crops are
# far smaller, so nothing is lost; a huge image (a 140 KB PNG can hold 89 megapixels) is
# reduced before it is converted, and a JPEG is decoded at 1/2, 1/4 or 1/8 scale to begin with.
MAX_DECODE_SIDE = 2048


@dataclass(frozen=True)
class ImageSet:
    """Labelled images: ``paths[i]`` belongs to class ``class_names[labels[i]]``."""

    root: Path
    class_names: tuple[str, ...]
    paths: tuple[Path, ...]
    labels: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.paths)

    def fingerprint(self) -> str:
        """sha256 over class names, relative paths and file sizes: identifies a data drop."""
        digest = hashlib.sha256()
        for path, label in zip(self.paths, self.labels):
            rel = path.relative_to(self.root).as_posix()
            digest.update(f"{self.class_names[label]}\0{rel}\0{path.stat().st_size}\n".encode())
        return digest.hexdigest()

    def without_classes(self, names: set[str]) -> ImageSet | None:
        """The same set without the images of the classes ``names`` (None: no class is left)."""
        keep = [name for name in self.class_names if name not in names]
        if not keep:
            return None
        label = {self.class_names.index(name): k for k, name in enumerate(keep)}
        pairs = [(path, label[old]) for path, old in zip(self.paths, self.labels) if old in label]
        return ImageSet(self.root, tuple(keep), tuple(p for p, _ in pairs), tuple(k for _, k in pairs))

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(self.class_names, 0)
        for label in self.labels:
            out[self.class_names[label]] += 1
        return out


def _hidden(path: Path) -> bool:
    return path.name.startswith(".")


def scan_class_folders(root: Path | str, *, what: str = "--data") -> ImageSet:
    """List the class folders under ``root`` and their images, failing on anything unusable."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{what} {root} is not a directory; pass a folder with one sub-folder per class")
    entries = sorted(p for p in root.iterdir() if not _hidden(p))
    stray = [p for p in entries if not p.is_dir()]
    if stray:
        raise DataError(f"{stray[0]} is a file directly under {what} {root}; put images in one sub-folder per class")
    if not entries:
        raise DataError(f"{what} {root} has no class folders; add one sub-folder of images per class")
    class_names, paths, labels = [], [], []
    for label, class_dir in enumerate(entries):
        _require_utf8(class_dir, root)
        files = sorted(
            p
            for p in class_dir.rglob("*")
            if p.is_file() and not any(q.startswith(".") for q in p.relative_to(class_dir).parts)
        )
        for path in files:
            _require_utf8(path, root)
            if path.suffix.lower() not in IMAGE_EXTENSIONS:
                raise DataError(
                    f"{path} is not an image ({', '.join(IMAGE_EXTENSIONS)}); remove it or move it out of {what}"
                )
        if not files:
            raise DataError(f"class folder {class_dir} is empty; add images to it or remove it")
        class_names.append(class_dir.name)
        paths.extend(files)
        labels.extend([label] * len(files))
    refuse_near_duplicates(class_names, {}, what=f"{what} {root}")
    return ImageSet(root, tuple(class_names), tuple(paths), tuple(labels))


def _require_utf8(path: Path, root: Path) -> None:
    """Class and file names go into stage.json, fingerprints and output: they must be UTF-8."""
    rel = path.relative_to(root)
    try:
        str(rel).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(rel).decode("utf-8", "backslashreplace")
        raise DataError(f"the name '{shown}' under {root} is not valid UTF-8; rename it") from None


def class_key(name: str) -> str:
    """What a class name means to a person: Unicode-normalised (NFKC), case-folded, stripped."""
    return unicodedata.normalize("NFKC", name).casefold().strip()


def refuse_near_duplicates(names: Iterable[str], learned: dict[str, int], *, what: str = "--data") -> None:
    """Refuse a class name that differs from another one (in ``names`` or already ``learned``, name
    → stage) only by case, surrounding whitespace or Unicode normalisation: it is a typo, not a class."""
    seen = {class_key(name): (name, f"learned in stage {stage}") for name, stage in learned.items()}
    for name in names:
        other = seen.get(class_key(name))
        if other is not None and other[0] != name:
            raise DataError(
                f"class {name!r} in {what} differs from class {other[0]!r} ({other[1]}) only by case, "
                "whitespace or Unicode form; give it a distinct name, or leave it out if it is the same class"
            )
        seen.setdefault(class_key(name), (name, f"in {what}"))


def _check_image(path: Path) -> str | None:
    try:
        image = load_rgb(path)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        return f"cannot be decoded ({exc.__class__.__name__}: {exc})"
    if image.width < 1 or image.height < 1:
        return "has no pixels"
    return None


def validate_images(images: ImageSet, *, num_threads: int | None = None) -> None:
    """Decode every image once; the first failure is a DataError naming the file."""
    threads = num_threads or min(8, (os.cpu_count() or 1) + 2)
    with ThreadPoolExecutor(threads) as pool:
        for path, problem in zip(images.paths, pool.map(_check_image, images.paths)):
            if problem:
                raise DataError(f"image {path} {problem}; fix or remove the file")


def load_rgb(path: Path, *, max_side: int = MAX_DECODE_SIDE) -> Image.Image:
    """Open an image as RGB (grayscale, palette, alpha and 16-bit images are converted), its
    longest side at most ``max_side``: memory stays bounded however many pixels the file claims."""
    with Image.open(path) as image:
        image.draft("RGB", (max_side, max_side))  # JPEG: decode at a reduced scale, never below max_side
        if max(image.size) > max_side:
            image.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)  # in the file's own mode
        return image.convert("RGB")


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

    def __init__(self, images: ImageSet, transform: Any, *, label_map: list[int] | None = None):
        self.images = images
        self.transform = transform
        self.label_map = label_map

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = self.images.labels[index]
        if self.label_map is not None:
            label = self.label_map[label]
        return self.transform(load_rgb(self.images.paths[index])), label


def eval_transform(data_config: dict[str, Any]) -> Any:
    """The PTM's own evaluation transform (resize, center crop, normalise) from its data config."""
    from timm.data import create_transform

    return create_transform(**_timm_config(data_config), is_training=False)


def train_transform(data_config: dict[str, Any], *, crop_scale_min: float, hflip: bool) -> Any:
    """Random resized crop (+ flip) at the PTM's input size, then the PTM's normalisation."""
    from torchvision import transforms as T

    size = tuple(data_config["input_size"][-2:])
    interpolation = T.InterpolationMode(data_config.get("interpolation", "bicubic"))
    steps = [T.RandomResizedCrop(size, scale=(crop_scale_min, 1.0), interpolation=interpolation)]
    if hflip:
        steps.append(T.RandomHorizontalFlip())
    steps += [T.ToTensor(), T.Normalize(data_config["mean"], data_config["std"])]
    return T.Compose(steps)


def _timm_config(data_config: dict[str, Any]) -> dict[str, Any]:
    keys = ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode")
    out = {k: data_config[k] for k in keys if k in data_config}
    out["input_size"] = tuple(out["input_size"])
    out["mean"], out["std"] = tuple(out["mean"]), tuple(out["std"])
    return out
