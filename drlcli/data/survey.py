"""A drop surveyed before it is learned (``drl check-data``): its class folders listed and every image
decoded and hashed, each problem collected as a ``Finding`` instead of stopping at the first, as
``scan_class_folders`` and ``validate_images`` do (their checks and messages, reused)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from ..errors import DataError
from .decode import MAX_ASPECT, MAX_DECODE_SIDE, aspect_box, open_image_file
from .images import (
    ImageSet,
    _check_image,
    _class_files,
    _refuse_split_folders,
    _require_utf8,
    class_key,
    hidden,
    image_extensions,
    refuse_near_duplicates,
    scan_class_folders,
)


@dataclass(frozen=True)
class Finding:
    """One thing wrong with (or worth knowing about) a drop: what kind, the message naming it and its
    fix, the files and classes it concerns, and the exit code learn-stage gives for it."""

    kind: str
    message: str
    paths: list[str] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)
    exit_code: int = DataError.exit_code

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ImageFacts:
    """One image file: the sha256 of its bytes (None: unreadable), why it cannot be used (None: it
    decodes), and what decoding does to a large or very long one (None: nothing)."""

    sha256: str | None
    problem: str | None
    note: str | None


def survey_folder(root: Path | str, *, what: str) -> tuple[ImageSet | None, list[Finding]]:
    """``root``'s class folders and images as learn-stage lists them, with every layout problem (stray
    files, split folders, empty classes, files that are no image, names that are no UTF-8 or only
    differ in case) as findings; the listing keeps the usable images (None: none)."""
    root = Path(root)
    try:
        return scan_class_folders(root, what=what), []
    except DataError:
        pass  # list again, collecting every problem
    if not root.is_dir():
        return None, [
            Finding("layout", f"{what} {root} is not a directory; pass a folder with one sub-folder per class")
        ]
    entries = sorted(p for p in root.iterdir() if not hidden(p))
    findings = [_stray(p, root, what) for p in entries if not p.is_dir()]
    folders = [p for p in entries if p.is_dir()]
    try:
        _refuse_split_folders(folders, root, what)
    except DataError as exc:
        return None, [*findings, Finding("split_folders", str(exc), [str(root)])]
    if not folders:
        return None, [*findings, Finding("layout", f"{what} {root} has no class folders; add one sub-folder per class")]
    listing, found = _listing(folders, root, what)
    return listing, findings + found


def _listing(folders: list[Path], root: Path, what: str) -> tuple[ImageSet | None, list[Finding]]:
    """The usable images of ``folders`` as one listing (None: none), and every class folder's findings."""
    names, paths, labels, findings = [], [], [], []
    for class_dir in folders:
        files, found = _class_listing(class_dir, root, what)
        findings += found
        if files:
            labels += [len(names)] * len(files)
            names.append(class_dir.name)
            paths += files
    findings += near_duplicate_names(names, {}, what=f"{what} {root}")
    return (ImageSet(root, tuple(names), tuple(paths), tuple(labels)) if names else None), findings


def _stray(path: Path, root: Path, what: str) -> Finding:
    problem = os.path.lexists(path) and not path.exists()
    kind = "is a symbolic link to a missing file" if problem else "is a file"
    return Finding(
        "layout", f"{path} {kind} directly under {what} {root}; put images in one sub-folder per class", [str(path)]
    )


def _class_listing(class_dir: Path, root: Path, what: str) -> tuple[list[Path], list[Finding]]:
    """A class folder's usable image files, and a finding for each file that is no image."""
    try:
        _require_utf8(class_dir, root)
        files = _class_files(class_dir, what)
    except DataError as exc:
        return [], [Finding("layout", str(exc), [str(class_dir)])]
    if not files:
        return [], [Finding("empty_class", f"class folder {class_dir} is empty; add images to it or remove it")]
    good, found = [], []
    for path in files:
        try:
            _require_utf8(path, root)
        except DataError as exc:
            found.append(Finding("layout", str(exc), classes=[class_dir.name]))
            continue
        if path.suffix.lower() in image_extensions():
            good.append(path)
        else:
            found.append(
                Finding(
                    "not_an_image",
                    f"{path} is not an image (no format Pillow reads has the extension {path.suffix or '(none)'!r}); "
                    f"remove it or move it out of {what}",
                    [str(path)],
                    [class_dir.name],
                )
            )
    return good, found


def near_duplicate_names(
    names: Sequence[str], learned: dict[str, int], *, what: str, within: bool = True
) -> list[Finding]:
    """Every class name that differs from a learned one (``learned``: name -> stage), or else from an
    earlier one of ``names``, only by case, whitespace or Unicode form: ``refuse_near_duplicates``,
    which stops at the first, asked of each name (``within`` False: against ``learned`` only)."""
    found = []
    for k, name in enumerate(names):
        earlier = (
            next((n for n in names[:k] if class_key(n) == class_key(name) and n != name), None) if within else None
        )
        try:
            refuse_near_duplicates([name], learned, what=what)
            if earlier is not None:
                refuse_near_duplicates([earlier, name], {}, what=what)
        except DataError as exc:
            found.append(Finding("near_duplicate_name", str(exc), classes=[name]))
    return found


def inspect_images(
    paths: Sequence[Path], *, num_threads: int | None = None, progress: Callable[[int, int], None] | None = None
) -> list[ImageFacts]:
    """``inspect_image`` of every path, in order (``progress(step, total)`` after each)."""
    threads = num_threads or min(8, (os.cpu_count() or 1) + 2)
    facts = []
    with ThreadPoolExecutor(threads) as pool:
        for step, fact in enumerate(pool.map(inspect_image, paths), 1):
            facts.append(fact)
            if progress is not None:
                progress(step, len(paths))
    return facts


def inspect_image(path: Path) -> ImageFacts:
    """The sha256 of the file's bytes, whether it decodes as learn-stage decodes it (``_check_image``)
    and, if it does, whether the decode bounds reduce or cut it."""
    try:
        with open_image_file(path) as fp:
            digest = hashlib.sha256()
            for chunk in iter(lambda: fp.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as exc:
        return ImageFacts(None, str(exc), None)
    problem = _check_image(path)
    return ImageFacts(digest.hexdigest(), problem, None if problem else _bounds_note(path))


def _bounds_note(path: Path) -> str | None:
    """What the decode bounds do to the image: reduced past ``MAX_DECODE_SIDE``, cut past ``MAX_ASPECT``."""
    try:
        with open_image_file(path) as fp, Image.open(fp) as image:
            width, height = image.size
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    if aspect_box(width, height) is not None:
        return f"is {width}x{height}: longer than {MAX_ASPECT}:1, only its middle is used"
    if max(width, height) > MAX_DECODE_SIDE:
        return f"is {width}x{height}: decoded reduced to {MAX_DECODE_SIDE} px on its longest side"
    return None
