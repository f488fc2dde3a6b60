"""Labelled images as drl reads them: class folders (ImageFolder layout; images at any depth inside
their class folder, in any format Pillow reads) or a torch ``Dataset`` of (image, label) pairs
(``dataset_images``); their listing, class names and fingerprints. Every problem is a
``DataError`` naming the file or item and the fix, raised before anything is trained or written."""

from __future__ import annotations

import functools
import hashlib
import operator
import os
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from ..errors import DataError, UsageError
from .decode import ImagePathError, load_rgb, path_problem, to_rgb


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
class ImageSubset(LabelledImages):
    """Some of another source's images (``indices``), under the same class names."""

    source: LabelledImages
    indices: tuple[int, ...]
    class_names: tuple[str, ...] = field(init=False)
    labels: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "class_names", self.source.class_names)
        object.__setattr__(self, "labels", tuple(self.source.labels[i] for i in self.indices))

    @property
    def origin(self) -> str:
        return f"{self.source.origin} ({len(self.indices)} of its images)"

    def load(self, index: int) -> Image.Image:
        return self.source.load(self.indices[index])

    def fingerprint(self) -> str:
        digest = hashlib.sha256(self.source.fingerprint().encode())
        digest.update(",".join(map(str, self.indices)).encode())
        return digest.hexdigest()


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


def hidden(path: Path) -> bool:
    return path.name.startswith(".")


def scan_class_folders(root: Path | str, *, what: str = "--data") -> ImageSet:
    """List the class folders under ``root`` and their images, failing on anything unusable."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{what} {root} is not a directory; pass a folder with one sub-folder per class")
    entries = sorted(p for p in root.iterdir() if not hidden(p))
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
    _refuse_split_folders(entries, root, what)
    class_names, paths, labels = [], [], []
    for label, class_dir in enumerate(entries):
        files = _class_images(class_dir, root, what)
        class_names.append(class_dir.name)
        paths.extend(files)
        labels.extend([label] * len(files))
    refuse_near_duplicates(class_names, {}, what=f"{what} {root}")
    return ImageSet(root, tuple(class_names), tuple(paths), tuple(labels))


SPLIT_NAMES = frozenset({"train", "training", "test", "testing", "val", "valid", "validation", "eval"})


def _holds_folders(path: Path) -> bool:
    return path.name.lower() in SPLIT_NAMES and any(child.is_dir() for child in path.iterdir())


def _refuse_split_folders(entries: list[Path], root: Path, what: str) -> None:
    """A drop's folder handed instead of its ``train/`` (class folders named like splits that hold
    class folders themselves) would learn "train" and "test" as classes, test images included."""
    splits = [p for p in entries if _holds_folders(p)]
    if not splits:
        return
    trains = [p for p in splits if p.name.lower() in ("train", "training")]
    train = (trains or splits)[0]
    others = [p for p in splits if p != train]
    hint = f" (and --eval-data {others[0]})" if others and what == "--data" else ""
    raise DataError(
        f"{what} {root} holds split folders ({', '.join(p.name for p in splits)}) of class folders, not "
        f"classes: pass --data {train}{hint}"
    )


def _class_images(class_dir: Path, root: Path, what: str) -> list[Path]:
    """A class folder's images: every file an image by its extension, names in UTF-8, at least one."""
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
    return files


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


MAX_NAMED = 10  # failed images named in one error


def validate_images(
    images: LabelledImages,
    *,
    num_threads: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Decode every image of a folder once; every failure is named in one DataError (the first
    ``MAX_NAMED`` of them, with their count). (A dataset's items were all decoded and checked when it
    was read: ``dataset_images``.) ``progress(step, total)`` is called from the calling thread after
    each image is checked, in order (step 1 to total; a dataset: once, total of total), so a bar can
    move during the minutes a large folder takes; it sees no image after a failure."""
    if not isinstance(images, ImageSet):
        if progress is not None:
            progress(len(images), len(images))
        return
    threads = num_threads or min(8, (os.cpu_count() or 1) + 2)
    total = len(images.paths)
    failed: list[str] = []
    with ThreadPoolExecutor(threads) as pool:
        for step, (path, problem) in enumerate(zip(images.paths, pool.map(_check_image, images.paths)), 1):
            if problem:
                failed.append(f"image {path} {problem}")
            elif progress is not None and not failed:
                progress(step, total)
    if len(failed) == 1:
        raise DataError(f"{failed[0]}; fix or remove the file")
    if failed:
        more = f"; and {len(failed) - MAX_NAMED} more" if len(failed) > MAX_NAMED else ""
        raise DataError(
            f"{len(failed)} images cannot be used: {'; '.join(failed[:MAX_NAMED])}{more}; fix or remove them"
        )
