"""benchmarks/make_corrupted.py (Caltech-101-C): the Caltech layout written for ``drl benchmark``,
every corruption visibly changing the image, the same bytes on every run."""

import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from drlcli.synthetic import class_image

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "make_corrupted.py"


def _module():
    spec = importlib.util.spec_from_file_location("make_corrupted", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def caltech(tmp_path):
    root = tmp_path / "caltech101"
    lines = {"train": [], "test": []}
    for c in range(3):
        folder = root / "101_ObjectCategories" / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(4):
            class_image(c, i, size=64).save(folder / f"image_{i:04d}.jpg")
            lines["train" if i < 3 else "test"].append(f"class{c}/image_{i:04d}.jpg")
    for split, names in lines.items():
        (root / f"{split}.txt").write_text("\n".join(names) + "\n")
    return root


@pytest.mark.parametrize("kind", ["noise", "blur", "jpeg", "pixelate", "fog"])
def test_each_corruption_changes_the_image_and_keeps_its_size(kind):
    module = _module()
    image = class_image(1, 0, size=96)
    out = module.corrupt(image, kind, np.random.default_rng(0))
    a, b = (np.asarray(x, dtype=np.float32) for x in (image, out))
    assert out.size == image.size and out.mode == "RGB"
    assert np.abs(a - b).mean() > 2.0  # visibly corrupted (pixel values 0..255)


def test_the_data_set_is_laid_out_for_drl_benchmark_and_reproducible(caltech, tmp_path):
    outs = [tmp_path / "c1", tmp_path / "c2"]
    for out in outs:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--caltech", str(caltech), "--out", str(out), "--workers", "1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    first = outs[0]
    assert (first / "train.txt").read_text().splitlines()[0] == "class0/image_0000.png"
    files = sorted((first / "101_ObjectCategories").rglob("*.png"))
    assert len(files) == 12 and all(Image.open(f).size == (64, 64) for f in files)

    def digest(root):
        return {p.relative_to(root): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*.png")}

    assert digest(outs[0]) == digest(outs[1])
    kinds = {_module().corruption_of(f.relative_to(first / "101_ObjectCategories").as_posix()) for f in files}
    assert len(kinds) >= 3  # a class holds a mix of corruptions
