"""Generated image folders for the offline demo and the tests: no downloads, seeded.

Each class has its own colour and stripe pattern; each image adds jitter and noise, so classes are
separable but not identical copies.
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
    root: Path, *, num_stages: int, classes_per_stage: int, train: int, test: int, size: int = 32
) -> list[tuple[Path, Path]]:
    """Train/test folders per stage: ``root/stage{k}/{train,test}``; returns their paths."""
    out = []
    for k in range(num_stages):
        ids = list(range(k * classes_per_stage, (k + 1) * classes_per_stage))
        train_dir = make_class_folders(Path(root) / f"stage{k + 1}" / "train", ids, images_per_class=train, size=size)
        test_dir = make_class_folders(
            Path(root) / f"stage{k + 1}" / "test", ids, images_per_class=test, size=size, offset=train
        )
        out.append((train_dir, test_dir))
    return out


# A small randomly initialised ViT: the built-in offline default for the demo and the tests.
TINY_PTM = "vit_tiny_patch16_224"
TINY_PTM_KWARGS = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 4, "num_heads": 4}
