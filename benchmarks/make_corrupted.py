"""Build Caltech-101-C: every Caltech-101 image under one ImageNet-C-style corruption, a second
shifted domain beside the sketches (``../shared/data/caltech101-sketch/make.py``).

The sketches are a rendition shift (contours, no colour or texture). Users' shifts are more often
the camera's: sensor noise, focus, compression, low resolution, haze or low contrast. Each image gets
one of those five (ImageNet-C's families: noise, blur, digital, digital, weather), at one fixed
severity, the corruption and its random draws seeded by the image's path, so the data set is the same
on every machine and a class holds a mix of them, as a camera fleet's images would:

- ``noise``: Gaussian noise on [0, 1] pixels, std ``NOISE``;
- ``blur``: Gaussian blur, radius ``BLUR`` of a 224-pixel side (scaled to the image);
- ``jpeg``: JPEG re-encoding at quality ``JPEG``;
- ``pixelate``: down to ``PIXELATE`` of the size (box filter) and back up (nearest);
- ``fog``: contrast to ``CONTRAST`` of itself, blended towards a smooth random haze.

    python benchmarks/make_corrupted.py --caltech ../shared/data/caltech101 --out DIR [--only NAME]

Writes DIR/101_ObjectCategories/<class>/<image>.png, DIR/train.txt and DIR/test.txt (the source's
lines with .png for .jpg), read by ``drl benchmark --data DIR`` as the Caltech layout; ``--only NAME``
puts every image under one corruption. Deterministic: the same source gives byte-identical output.
Severity 3 of ImageNet-C's five, in its parameters' spirit (not its exact code, which needs scikit-image
and Wand): clearly visible, most objects still recognisable to a person.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

CORRUPTIONS = ("noise", "blur", "jpeg", "pixelate", "fog")
NOISE = 0.18  # std of the Gaussian noise on [0, 1] pixels
BLUR = 3.0  # Gaussian blur radius at a 224-pixel side
JPEG = 10  # JPEG quality
PIXELATE = 0.25  # fraction of the side kept
CONTRAST = 0.4  # the image's contrast kept by fog
SEED = 2026


def _rng(name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{SEED}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def corruption_of(name: str) -> str:
    """The corruption an image gets, from its path relative to the data set (seeded)."""
    return CORRUPTIONS[int(_rng(name).integers(len(CORRUPTIONS)))]


def corrupt(image: Image.Image, kind: str, rng: np.random.Generator) -> Image.Image:
    """``image`` (RGB) under corruption ``kind`` at the fixed severity."""
    side = min(image.size)
    if kind == "blur":
        return image.filter(ImageFilter.GaussianBlur(BLUR * side / 224))
    if kind == "jpeg":
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=JPEG)
        return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    if kind == "pixelate":
        small = (max(1, round(image.width * PIXELATE)), max(1, round(image.height * PIXELATE)))
        return image.resize(small, Image.Resampling.BOX).resize(image.size, Image.Resampling.NEAREST)
    pixels = np.asarray(image, dtype=np.float32) / 255.0  # (H, W, 3)
    if kind == "noise":
        pixels = pixels + rng.normal(0.0, NOISE, pixels.shape)
    elif kind == "fog":
        coarse = rng.random((4, 4)).astype(np.float32)
        haze = np.asarray(Image.fromarray(coarse).resize(image.size, Image.Resampling.BICUBIC))[..., None]
        mean = pixels.mean(axis=(0, 1), keepdims=True)
        pixels = (pixels - mean) * CONTRAST + mean
        pixels = 0.6 * pixels + 0.4 * (0.5 + 0.5 * haze)
    else:
        raise ValueError(f"unknown corruption {kind!r}; one of {', '.join(CORRUPTIONS)}")
    return Image.fromarray((np.clip(pixels, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8))


def _write(job: tuple[Path, Path, str, str]) -> None:
    src, dst, name, only = job
    if dst.exists():
        return
    kind = only or corruption_of(name)
    with Image.open(src) as image:
        out = corrupt(image.convert("RGB"), kind, _rng(f"{name}:{kind}"))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    out.save(tmp, format="PNG")
    tmp.replace(dst)


def jobs(caltech: Path, out: Path, only: str = "") -> list[tuple[Path, Path, str, str]]:
    """One job per image of train.txt and test.txt; writes the two lists with .png names."""
    found = []
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        lines = [line.strip() for line in (caltech / f"{split}.txt").read_text().splitlines() if line.strip()]
        (out / f"{split}.txt").write_text("".join(line.rsplit(".", 1)[0] + ".png\n" for line in lines))
        for line in lines:
            src = caltech / "101_ObjectCategories" / line
            if src.is_file():
                name = line.rsplit(".", 1)[0] + ".png"
                found.append((src, out / "101_ObjectCategories" / name, name, only))
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--caltech", type=Path, required=True, help="Caltech-101 (101_ObjectCategories, train.txt, test.txt)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", choices=CORRUPTIONS, default="", help="every image under this corruption")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    todo = jobs(args.caltech, args.out, args.only)
    with ProcessPoolExecutor(args.workers) as pool:
        for i, _ in enumerate(pool.map(_write, todo, chunksize=64)):
            if i % 1000 == 0:
                print(f"{i}/{len(todo)}", file=sys.stderr)
    print(f"wrote {len(todo)} corrupted images to {args.out}")


if __name__ == "__main__":
    main()
