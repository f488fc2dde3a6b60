"""Labelled images: class folders and torch datasets; discovery, validation, fingerprints, transforms.

A data folder holds one sub-folder per class (ImageFolder layout); images may sit at any depth
inside their class folder, in any format Pillow reads. The Python API also takes a torch
``Dataset`` of (image, label) pairs (``dataset_images``). Either way every problem is a
``DataError`` naming the file or item and the fix, raised before anything is trained or written.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import os
import stat
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset

from .config import MAX_WORKERS
from .errors import DataError, UsageError

# Longest side an image is decoded at. Every PTM input (224-518 px) and its training crops are
# far smaller, so nothing is lost; a huge image (a 140 KB PNG can hold 89 megapixels) is
# reduced before it is converted, and a JPEG is decoded at 1/2, 1/4 or 1/8 scale to begin with.
MAX_DECODE_SIDE = 2048

# Longest side of a decoded image, at most this many times its shortest: beyond it only the middle
# is kept (``aspect_box``), before any transform. The PTM's transforms scale the short side to about
# the input size, so a 1x100000 strip (a tiny PNG) became 256x524288 in the eval resize: +540 MB and
# seconds per image, per loader worker. At 16 that resize is at most 256x4096 (3 MiB), while photos,
# scans and phone panoramas (at most about 10:1) are far inside the bound and decode bit for bit as
# before. The evaluation transform center-crops (224/256 of the short side) well inside the kept
# middle, so what the network sees of a cut image is the same to within a pixel of resampling (bit
# for bit where timm's resize scale is exact); a PTM whose ``crop_mode`` is "squash" or "border"
# sees all of the kept middle instead of a whole strip squashed beyond recognition.
MAX_ASPECT = 16


@functools.cache
def image_extensions() -> frozenset[str]:
    """Every file extension (lower case, with the dot) of a format Pillow can open: .jpg, .png,
    .webp, .tif, .bmp, .gif, ... as this Pillow was built (its plugins register them)."""
    Image.init()
    return frozenset(ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN)


class LabelledImages:
    """What training, prototypes and evaluation read from a data source: the class names, each
    image's label (an index into them), image ``i`` as RGB (``load``), and a fingerprint of the
    whole (the run records it, so the same data again is recognised)."""

    class_names: tuple[str, ...]
    labels: tuple[int, ...]

    @property
    def origin(self) -> str:
        """Where the images come from, as messages name it."""
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.labels)

    def load(self, index: int) -> Image.Image:
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(self.class_names, 0)
        for label in self.labels:
            out[self.class_names[label]] += 1
        return out


@dataclass(frozen=True)
class ImageSet(LabelledImages):
    """A class folder's images: ``paths[i]`` belongs to class ``class_names[labels[i]]``."""

    root: Path
    class_names: tuple[str, ...]
    paths: tuple[Path, ...]
    labels: tuple[int, ...]

    @property
    def origin(self) -> str:
        return str(self.root)

    def load(self, index: int) -> Image.Image:
        return load_rgb(self.paths[index])

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


@dataclass(frozen=True, eq=False)
class DatasetImages(LabelledImages):
    """A torch ``Dataset`` of (image, label) pairs as labelled images; made by ``dataset_images``,
    which has read and checked every item once."""

    dataset: Any  # a map-style torch Dataset: __len__ and __getitem__
    class_names: tuple[str, ...]
    labels: tuple[int, ...]
    digest: str  # the fingerprint, computed while reading every item
    what: str = "data"

    @property
    def origin(self) -> str:
        return f"(a {type(self.dataset).__name__} of {len(self)} images)"

    def load(self, index: int) -> Image.Image:
        image, _ = _item(self.dataset, index, self.what)
        return _item_rgb(image, index, self.what)

    def fingerprint(self) -> str:
        """sha256 over every item in index order: its class name, its size and its RGB pixels as
        drl decodes them (8 bits per channel, longest side at most ``MAX_DECODE_SIDE`` and at most
        ``MAX_ASPECT`` times the shortest)."""
        return self.digest


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
        problem = path_problem(stray[0])  # a FIFO, device or dangling link: say so, not "a file"
        if problem is not None:
            raise DataError(
                f"{stray[0]} directly under {what} {root} {problem}; remove it: {what} holds one sub-folder per class"
            )
        raise DataError(f"{stray[0]} is a file directly under {what} {root}; put images in one sub-folder per class")
    if not entries:
        raise DataError(f"{what} {root} has no class folders; add one sub-folder of images per class")
    class_names, paths, labels = [], [], []
    for label, class_dir in enumerate(entries):
        _require_utf8(class_dir, root)
        files = _class_files(class_dir, what)
        for path in files:
            _require_utf8(path, root)
            if path.suffix.lower() not in image_extensions():
                raise DataError(
                    f"{path} is not an image (no format Pillow reads has the extension {path.suffix or '(none)'!r}); "
                    f"remove it or move it out of {what}"
                )
        if not files:
            raise DataError(f"class folder {class_dir} is empty; add images to it or remove it")
        class_names.append(class_dir.name)
        paths.extend(files)
        labels.extend([label] * len(files))
    refuse_near_duplicates(class_names, {}, what=f"{what} {root}")
    return ImageSet(root, tuple(class_names), tuple(paths), tuple(labels))


def _class_files(class_dir: Path, what: str) -> list[Path]:
    """Every file below ``class_dir`` (sub-folders are walked; hidden names skipped), sorted. A FIFO,
    device, socket or dangling link there is a DataError saying what it is: skipping it silently
    could leave a class folder "empty", and opening it could wait forever."""
    files = []
    for path in sorted(class_dir.rglob("*")):
        if any(part.startswith(".") for part in path.relative_to(class_dir).parts):
            continue
        problem = path_problem(path)
        if problem is None:
            files.append(path)
        elif problem.kind != "folder":
            raise DataError(f"{path} {problem}; remove it or move it out of {what}")
    return files


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
    except ImagePathError as exc:  # gone, or swapped for a FIFO or a folder, since the scan
        return str(exc)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        return f"cannot be decoded ({exc.__class__.__name__}: {exc})"
    if image.width < 1 or image.height < 1:
        return "has no pixels"
    return None


def validate_images(
    images: LabelledImages,
    *,
    num_threads: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Decode every image of a folder once; the first failure is a DataError naming the file. (A
    dataset's items were all decoded and checked when it was read: ``dataset_images``.)
    ``progress(step, total)`` is called from the calling thread after each image is checked, in
    order (step 1 to total; a dataset: once, total of total), so a bar can move during the minutes
    a large folder takes; it sees no image after a failure."""
    if not isinstance(images, ImageSet):
        if progress is not None:
            progress(len(images), len(images))
        return
    threads = num_threads or min(8, (os.cpu_count() or 1) + 2)
    total = len(images.paths)
    with ThreadPoolExecutor(threads) as pool:
        for step, (path, problem) in enumerate(zip(images.paths, pool.map(_check_image, images.paths)), 1):
            if problem:
                raise DataError(f"image {path} {problem}; fix or remove the file")
            if progress is not None:
                progress(step, total)


def load_rgb(path: Path, *, max_side: int = MAX_DECODE_SIDE) -> Image.Image:
    """Open an image as RGB (grayscale, palette, alpha and 16-bit images are converted), its
    longest side at most ``max_side`` and at most ``MAX_ASPECT`` times its shortest (``bounded``):
    memory and the transforms' work stay bounded however many pixels the file claims. A path that
    is not a regular file is an ``ImagePathError`` saying what it is, and is never waited on."""
    with open_image_file(path) as fp, Image.open(fp) as image:
        image.draft("RGB", (max_side, max_side))  # JPEG: decode at a reduced scale, never below max_side
        return eight_bit(bounded(image, max_side, in_place=True)).convert("RGB")


def bounded(image: Image.Image, max_side: int = MAX_DECODE_SIDE, *, in_place: bool = False) -> Image.Image:
    """``image``, in its own mode, cut to its middle part at most ``MAX_ASPECT`` times as long as
    it is wide (``aspect_box``), then reduced to at most ``max_side`` on its longest side. An image
    within both bounds is returned as it is, so ordinary images decode bit for bit as before. A
    reduction of an uncut image happens in place only if ``in_place`` (a file's image: no copy of a
    huge decode); a cut image is always a new one, cut and scaled in one resize from the box."""
    box = aspect_box(*image.size)
    if box is not None:
        return _cut(image, box, max_side)
    if max(image.size) > max_side:
        image = image if in_place else image.copy()
        image.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
    return image


def aspect_box(width: int, height: int, *, max_aspect: int = MAX_ASPECT) -> tuple[int, int, int, int] | None:
    """The middle part of a ``width`` x ``height`` image whose long side is ``max_aspect`` times its
    short side (one pixel more where the cut is odd, so the middle stays exactly the middle and a
    center crop of the part is the same pixels as of the whole), as a PIL box (left, upper, right,
    lower); None when the whole image is within that. The PTM's transforms scale the short side to
    the input size, so this bounds their work too."""
    short, long = min(width, height), max(width, height)
    if short < 1 or long <= max_aspect * short:
        return None
    keep = max_aspect * short + (long - max_aspect * short) % 2
    start = (long - keep) // 2
    return (start, 0, start + keep, height) if width > height else (0, start, width, start + keep)


def _cut(image: Image.Image, box: tuple[int, int, int, int], max_side: int) -> Image.Image:
    """``box`` of ``image`` as a new image, at most ``max_side`` on its longest side (scaled as
    ``thumbnail`` does: bicubic, in two steps; never a full-size intermediate copy)."""
    width, height = box[2] - box[0], box[3] - box[1]
    if max(width, height) <= max_side:
        return image.crop(box)
    scale = max_side / max(width, height)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC, box=box, reducing_gap=2.0)


class ImagePathError(OSError):
    """A path that cannot be read as an image file whatever its content: missing, a dangling link, a
    folder, a FIFO, a device, a socket, no permission. ``str()`` says what it is ("is a FIFO (named
    pipe), not an image file"); ``kind`` ("missing", "dangling", "folder", "special", "unreadable")
    lets each caller name its own fix (predict: pass a folder as a folder source; a data folder:
    remove it). Built from its message alone it still works (pickling, torch's worker re-raise)."""

    def __init__(self, what: str, path: Path | None = None, kind: str = "unreadable"):
        super().__init__(what)
        self.what, self.path, self.kind = what, path, kind

    def __str__(self) -> str:
        return self.what


_SPECIAL_FILES = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def path_problem(path: Path) -> ImagePathError | None:
    """Why ``path`` (its links followed) is not a regular file, from ``os.stat`` alone; None if it
    is one. Nothing is opened: opening a FIFO for reading waits for a writer, opening a device can
    act on it."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        if os.path.islink(path):
            return ImagePathError("is a symbolic link to a missing file", path, "dangling")
        return ImagePathError("does not exist", path, "missing")
    except OSError as exc:
        return ImagePathError(f"cannot be read ({exc.strerror or exc})", path, "unreadable")
    except ValueError as exc:  # a NUL byte in the path (a list file or stdin can hold one)
        return ImagePathError(f"is not a usable path ({exc})", path, "unreadable")
    return _mode_problem(path, mode)


def _mode_problem(path: Path, mode: int) -> ImagePathError | None:
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return ImagePathError("is a folder, not an image file", path, "folder")
    noun = next((noun for is_kind, noun in _SPECIAL_FILES if is_kind(mode)), "a special file")
    return ImagePathError(f"is {noun}, not an image file", path, "special")


_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # POSIX; Windows has no FIFOs to wait on


def open_image_file(path: Path) -> IO[bytes]:
    """``path`` open for reading if it is a regular file, else ``ImagePathError``. Checked with
    ``os.stat`` before the open and ``os.fstat`` after it, the open itself non-blocking: a file
    swapped for a FIFO in between is refused, never waited on."""
    problem = path_problem(path)
    if problem is not None:
        raise problem
    try:
        fp = open(path, "rb", opener=lambda name, flags: os.open(name, flags | _O_NONBLOCK))  # noqa: SIM115
    except OSError as exc:
        unreadable = ImagePathError(f"cannot be read ({exc.strerror or exc})", path, "unreadable")
        raise path_problem(path) or unreadable from exc
    try:
        problem = _mode_problem(path, os.fstat(fp.fileno()).st_mode)
        if problem is not None:
            raise problem
        if _O_NONBLOCK:
            os.set_blocking(fp.fileno(), True)
    except BaseException:
        fp.close()
        raise
    return fp


_WIDE_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I", "F"})  # one channel, more than 8 bits


def eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit, 32-bit integer or floating-point image as 8-bit grey, scaled rather than clipped
    (PIL's own conversion clips at 255, which turns a 16-bit photo white and a [0, 1] float image
    black): integers by their full 16-bit scale (or their maximum beyond it), floats in [0, 1] by
    255 and other floats by their range. Other modes are returned as they are."""
    if image.mode not in _WIDE_MODES:
        return image
    x = np.asarray(image, dtype=np.float64)
    if image.mode == "F":
        x = np.where(np.isfinite(x), x, 0.0)
        low, high = float(x.min()), float(x.max())
        if low < 0 or high > 1:
            x = (x - low) / (high - low) if high > low else np.zeros_like(x)
    else:
        x = np.clip(x, 0, None) / max(65535.0, float(x.max()))
    return Image.fromarray(np.round(x * 255).astype(np.uint8), mode="L")


def to_rgb(image: Any, *, max_side: int = MAX_DECODE_SIDE) -> Image.Image:
    """A dataset's image as ``load_rgb`` gives a file's: RGB, longest side at most ``max_side`` and
    at most ``MAX_ASPECT`` times its shortest (``bounded``).
    ``image`` is a PIL image (never changed) or a tensor (H, W) or (C, H, W) with C 1, 3 or 4:
    uint8 in [0, 255] or floating point in [0, 1] (rounded to 8 bits, the inverse of ToTensor).
    Anything else is a ValueError saying what it is."""
    if isinstance(image, torch.Tensor):
        image = _tensor_to_pil(image)
    if not isinstance(image, Image.Image):
        raise ValueError(f"is a {type(image).__name__}, not a PIL image or a tensor")
    if image.width < 1 or image.height < 1:
        raise ValueError("has no pixels")
    return eight_bit(bounded(image, max_side)).convert("RGB")  # a copy if reduced: the caller's stays as it was


_TENSOR_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def _tensor_to_pil(tensor: torch.Tensor) -> Image.Image:
    x = tensor.detach().cpu()
    x = x[None] if x.ndim == 2 else x  # (H, W) -> (1, H, W)
    if x.ndim != 3 or x.shape[0] not in _TENSOR_MODES:
        raise ValueError(f"is a tensor of shape {tuple(tensor.shape)}; give (C, H, W) with C 1, 3 or 4, or (H, W)")
    if x.is_floating_point():
        if not (torch.isfinite(x).all() and x.min() >= 0 and x.max() <= 1):
            raise ValueError("is a floating-point tensor with values outside [0, 1]; scale it to [0, 1] or give uint8")
        x = (x.float() * 255).round().to(torch.uint8)
    elif x.dtype != torch.uint8:
        raise ValueError(f"is a {x.dtype} tensor; give uint8 (0-255) or floating point (0-1)")
    pixels = x.permute(1, 2, 0).contiguous().numpy()  # (H, W, C)
    return Image.fromarray(pixels[..., 0] if x.shape[0] == 1 else pixels, mode=_TENSOR_MODES[x.shape[0]])


def dataset_images(dataset: Any, *, class_names: Sequence[str] | None = None, what: str = "data") -> DatasetImages:
    """Read every item of ``dataset`` (map-style: ``len`` and ``[i]``) once: each must be an (image,
    label) pair (image as ``to_rgb`` takes it; label a class name, or an int indexing ``class_names``).
    The classes are those present, in ``class_names`` order when given, else sorted. The same pass
    computes the fingerprint (``DatasetImages.fingerprint``). The dataset must give the same items
    every time (no random augmentation of its own: drl adds its own while training)."""
    names = _check_class_names(class_names, what)
    try:
        size = len(dataset)
    except TypeError:
        raise UsageError(f"{what} must be a map-style torch Dataset (with __len__ and __getitem__)") from None
    if size == 0:
        raise DataError(f"{what} is an empty dataset; give it at least one image")
    digest, item_classes = hashlib.sha256(), []
    for index in range(size):
        image, label = _item(dataset, index, what)
        name = _label_name(label, names, index, what)
        rgb = _item_rgb(image, index, what)
        digest.update(f"{name}\0{rgb.width}x{rgb.height}\n".encode())
        digest.update(rgb.tobytes())
        item_classes.append(name)
    present = set(item_classes)
    classes = [c for c in names if c in present] if names is not None else sorted(present)
    refuse_near_duplicates(classes, {}, what=what)
    position = {name: i for i, name in enumerate(classes)}
    return DatasetImages(dataset, tuple(classes), tuple(position[c] for c in item_classes), digest.hexdigest(), what)


def _check_class_names(class_names: Sequence[str] | None, what: str) -> tuple[str, ...] | None:
    if class_names is None:
        return None
    names = tuple(class_names) if isinstance(class_names, (list, tuple)) else None
    if not names or not all(isinstance(n, str) and n.strip() and _utf8(n) for n in names):
        raise UsageError(f"class_names for {what} must be a non-empty list of class names (non-empty UTF-8 strings)")
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise UsageError(f"class_names for {what} names {twice!r} twice; each class once")
    return names


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _item(dataset: Any, index: int, what: str) -> tuple[Any, Any]:
    try:
        item = dataset[index]
    except Exception as exc:  # the dataset's own code: whatever it raises, the item is unusable
        raise DataError(
            f"item {index} of {what} cannot be read ({exc.__class__.__name__}: {exc}); fix the dataset"
        ) from exc
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise DataError(f"item {index} of {what} is a {type(item).__name__}, not an (image, label) pair")
    return item[0], item[1]


def _item_rgb(image: Any, index: int, what: str) -> Image.Image:
    try:
        return to_rgb(image)
    except (ValueError, OSError, Image.DecompressionBombError) as exc:
        raise DataError(f"the image of item {index} of {what} {exc}; fix the dataset") from exc


def _label_name(label: Any, names: tuple[str, ...] | None, index: int, what: str) -> str:
    """An item's class name: its label if a str, else ``names[label]``."""
    where = f"item {index} of {what}"
    if isinstance(label, str):
        if not label.strip() or not _utf8(label):
            raise DataError(f"{where} has the class name {label!r}; class names are non-empty UTF-8 strings")
        if names is not None and label not in names:
            raise DataError(f"{where} has class {label!r}, which class_names does not list; add it or fix the label")
        return label
    try:
        number = None if isinstance(label, bool) else operator.index(label)  # int, numpy int, 0-d int tensor
    except TypeError:
        number = None
    if number is None:
        raise DataError(
            f"{where} has a label of type {type(label).__name__}; give a class name (str) or an int index into class_names"
        )
    if names is None:
        raise UsageError(f"{where} has an int label ({number}); pass class_names=[...] to name the classes")
    if not 0 <= number < len(names):
        raise DataError(f"{where} has label {number}, outside class_names (0 to {len(names) - 1})")
    return names[number]


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
