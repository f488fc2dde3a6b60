"""Decoding an image, bounded: a regular file only (a FIFO or device is refused, never waited on),
at most ``MAX_DECODE_SIDE`` on its longest side and ``MAX_ASPECT`` times its shortest, converted
to 8-bit RGB."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from PIL import Image

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
