"""Generated image folders for the offline demo, the examples and the tests: no downloads, seeded.

Each class has its own colour and stripe pattern; each image adds jitter and noise, so classes are
separable but not identical copies. From a shell (``examples/nightly.sh``):

    python -m drlcli.synthetic drops DIR --stages 2 [--first 3]   # DIR/drop003/{train,test}/class_XX/
    python -m drlcli.synthetic init-args    # `drl init` options for the tiny random ViT that fits them
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def class_image(class_id: int, index: int, *, size: int = 32, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng((seed, class_id, index))
    palette = np.random.default_rng((seed, class_id)).uniform(0, 255, size=(2, 3))
    frequency = 1 + class_id % 4
    angle = (class_id * 0.7) % np.pi + rng.normal(0, 0.1)
    yy, xx = np.mgrid[0:size, 0:size] / size
    wave = 0.5 + 0.5 * np.sin(2 * np.pi * frequency * (xx * np.cos(angle) + yy * np.sin(angle)) + rng.uniform(0, 6.28))
    pixels = palette[0] * wave[..., None] + palette[1] * (1 - wave[..., None])
    pixels += rng.normal(0, 12, size=pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def make_class_folders(
    root: Path,
    class_ids: list[int],
    *,
    images_per_class: int,
    size: int = 32,
    seed: int = 0,
    offset: int = 0,
) -> Path:
    """Write ``root/class_XX/img_NNN.png`` for each class id; ``offset`` shifts image indices."""
    for class_id in class_ids:
        folder = Path(root) / f"class_{class_id:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(offset, offset + images_per_class):
            class_image(class_id, i, size=size, seed=seed).save(folder / f"img_{i:03d}.png")
    return Path(root)


def make_stages(
    root: Path,
    *,
    num_stages: int,
    classes_per_stage: int,
    train: int,
    test: int,
    size: int = 32,
    first: int = 1,
    name: str = "stage{}",
) -> list[tuple[Path, Path]]:
    """Train/test folders of stages ``first .. first+num_stages-1``: ``root/<name>/{train,test}``
    with ``name.format(k)``; stage k has classes (k-1)·n .. k·n-1. Returns their paths."""
    out = []
    for k in range(first, first + num_stages):
        ids = list(range((k - 1) * classes_per_stage, k * classes_per_stage))
        folder = Path(root) / name.format(k)
        train_dir = make_class_folders(folder / "train", ids, images_per_class=train, size=size)
        test_dir = make_class_folders(folder / "test", ids, images_per_class=test, size=size, offset=train)
        out.append((train_dir, test_dir))
    return out


# A small randomly initialised ViT: the built-in offline default for the demo and the tests.
TINY_PTM = "vit_tiny_patch16_224"
TINY_PTM_KWARGS = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 4, "num_heads": 4}


def init_args() -> list[str]:
    """``drl init`` options for the tiny random ViT (the offline default)."""
    ptm_args = [a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")]
    return ["--ptm", TINY_PTM, *ptm_args, "--random-init"]


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m drlcli.synthetic", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    drops = sub.add_parser("drops", help="write generated data drops DIR/dropNNN/{train,test}")
    drops.add_argument("dir", type=Path)
    drops.add_argument("--stages", type=int, default=2, help="how many drops")
    drops.add_argument("--first", type=int, default=1, help="number of the first drop (its classes follow on)")
    drops.add_argument("--classes", type=int, default=3, help="new classes per drop")
    drops.add_argument("--train", type=int, default=12, help="training images per class")
    drops.add_argument("--test", type=int, default=4, help="test images per class")
    sub.add_parser("init-args", help="print the `drl init` options of the tiny random ViT")
    args = parser.parse_args(argv)
    if args.command == "init-args":
        print(" ".join(init_args()))
        return
    for train_dir, _ in make_stages(
        args.dir,
        num_stages=args.stages,
        classes_per_stage=args.classes,
        train=args.train,
        test=args.test,
        first=args.first,
        name="drop{:03d}",
    ):
        print(train_dir.parent)


if __name__ == "__main__":
    main()
