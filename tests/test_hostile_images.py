"""Hostile image inputs: extreme aspect ratios (cut to MAX_ASPECT before any transform), and FIFOs,
devices, folders and dangling links where an image file is expected (each said as what it is, never
opened in a way that waits)."""

import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import Pairs
from PIL import Image
from typer.testing import CliRunner

from drlcli.cli import app
from drlcli.commands.predict import _PathDataset, expand_sources
from drlcli.data import decode
from drlcli.data.decode import (
    MAX_ASPECT,
    MAX_DECODE_SIDE,
    ImagePathError,
    aspect_box,
    load_rgb,
    open_image_file,
    to_rgb,
)
from drlcli.data.images import dataset_images, scan_class_folders, validate_images
from drlcli.data.loading import ImageDataset, eval_transform, train_transform
from drlcli.errors import DataError

# a 224 px PTM's evaluation transform: shorter side to int(224 / 0.875) = 256, then the middle 224
CFG = {"input_size": [3, 224, 224], "interpolation": "bicubic", "mean": [0.5] * 3, "std": [0.5] * 3, "crop_pct": 0.875}
RESIZED = 256


def _before(image: Image.Image, max_side: int = MAX_DECODE_SIDE) -> Image.Image:
    """How drl decoded an image before the aspect bound: reduced to ``max_side`` only."""
    image = image.copy()
    image.draft("RGB", (max_side, max_side))
    if max(image.size) > max_side:
        image.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
    return decode.eight_bit(image).convert("RGB")


def _smooth(width: int, height: int, seed: int = 0) -> Image.Image:
    """Random content without pixel-level noise (blocks of about 8 px, bicubic-smoothed)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)


def _steps(transform, image):
    """Each intermediate result of a Compose (PIL images, then tensors), the input first."""
    out = [image]
    for step in transform.transforms:
        out.append(step(out[-1]))
    return out


def _pixels(x) -> int:
    return x.width * x.height if isinstance(x, Image.Image) else x.numel()


# ------------------------------------------------------------------------------ aspect ratio


def test_aspect_box_keeps_the_middle():
    assert aspect_box(40, 30) is None and aspect_box(16, 1) is None and aspect_box(1, 16) is None
    assert aspect_box(100_000, 1) == (49_992, 0, 50_008, 1)
    assert aspect_box(1, 100_000) == (0, 49_992, 1, 50_008)
    assert aspect_box(2_000, 50) == (600, 0, 1_400, 50)
    assert aspect_box(999, 37) == (203, 0, 796, 37)  # an odd cut keeps one pixel more: the middle stays the middle
    assert aspect_box(0, 5) is None


@pytest.mark.parametrize("size", [(1, 100_000), (100_000, 1), (2, 50_000)])
def test_a_strip_is_cut_before_any_transform(tmp_path, size):
    """Before: a 1x100000 PNG decoded at 1x2048, which the eval transform resized to 256x524288 (+540 MB,
    2.3 s per image and worker). Now every step of both transforms stays within 256 x (16 * 256) pixels."""
    path = tmp_path / "strip.png"
    Image.new("L", size, 128).save(path)
    image = load_rgb(path)
    short = min(size)
    assert sorted(image.size) == [short, MAX_ASPECT * short]
    bound = RESIZED * RESIZED * (MAX_ASPECT + 1) * 3  # a resized image, or its tensor (3 channels)
    for transform in (eval_transform(CFG), train_transform(CFG, crop_scale_min=0.08, hflip=True)):
        steps = _steps(transform, image)
        assert max(_pixels(x) for x in steps) <= bound, [getattr(x, "size", None) for x in steps]
        assert steps[-1].shape == (3, 224, 224)
    resized = eval_transform(CFG).transforms[0](image)
    assert sorted(resized.size) == [RESIZED, RESIZED * MAX_ASPECT]  # was 256 x 524288


def test_every_decode_path_cuts_a_strip(tmp_path):
    """Folders (training, evaluation, validation), predict and datasets (PIL images and tensors)."""
    folder = tmp_path / "d" / "strips"
    folder.mkdir(parents=True)
    Image.new("RGB", (100_000, 1), (9, 9, 9)).save(folder / "a.png")
    images = scan_class_folders(tmp_path / "d")
    validate_images(images)
    assert images.load(0).size == (16, 1)
    (x, label), *_ = ImageDataset(images, eval_transform(CFG))
    assert x.shape == (3, 224, 224) and label == 0
    index, x, error = _PathDataset([folder / "a.png"], eval_transform(CFG))[0]
    assert error is None and x.shape == (3, 224, 224)
    pil = Image.new("RGB", (3, 50_000))
    tensor = torch.zeros(1, 2, 50_000, dtype=torch.uint8)
    assert to_rgb(pil).size == (3, 48) and pil.size == (3, 50_000)  # the caller's image is not changed
    assert to_rgb(tensor).size == (32, 2)
    assert [dataset_images(Pairs([(pil, "a"), (tensor, "a")])).load(i).size for i in (0, 1)] == [(3, 48), (32, 2)]


@pytest.mark.parametrize("suffix", [".png", ".jpg"])
@pytest.mark.parametrize("size", [(40, 30), (16, 1), (1, 16), (2048, 128), (3000, 200), (4096, 256), (300, 2048)])
def test_images_within_the_aspect_bound_decode_bit_for_bit_as_before(tmp_path, suffix, size):
    """Aspect at most MAX_ASPECT (16:1 included), reduced to MAX_DECODE_SIDE or not: no change at all."""
    path = tmp_path / f"a{suffix}"
    _smooth(*size).save(path)
    with Image.open(path) as image:
        expected = _before(image).tobytes()
    assert load_rgb(path).tobytes() == expected
    with Image.open(path) as image:
        image.load()
        assert to_rgb(image).tobytes() == _before(image).tobytes()


@pytest.mark.parametrize("size", [(2000, 50), (50, 2000), (1700, 100), (1050, 25), (32, 2048)])
def test_the_eval_crop_of_a_cut_image_is_the_same_pixels(size):
    """The eval transform keeps the middle 224/256 of the short side; the cut keeps 16 short sides
    around the same middle, so where the resize scale is exact (256 * long / short an integer) the
    input the network sees is bit for bit what it was."""
    image = _smooth(*size)
    assert aspect_box(*size) is not None  # the image is cut
    transform = eval_transform(CFG)
    assert torch.equal(transform(to_rgb(image)), transform(_before(image)))


@pytest.mark.parametrize("size", [(1999, 100), (37, 1001), (3000, 101), (999, 37), (5000, 120)])
def test_the_eval_crop_of_a_cut_image_is_where_it_was(size):
    """Elsewhere timm's resize rounds the long side down, which moves its center crop by under a pixel
    (and an image over MAX_DECODE_SIDE was reduced before, and is now cut first): on a ramp of 2 grey
    levels per source pixel along the long side, the inputs differ by at most 1 level, 2 beyond
    MAX_DECODE_SIDE: the crop is where it was to within a source pixel."""
    width, height = size
    along = np.clip((np.arange(max(size)) - max(size) // 2) * 2 + 128, 0, 255)
    pixels = np.broadcast_to(along[None, :] if width > height else along[:, None], (height, width))
    image = Image.fromarray(np.repeat(pixels[..., None], 3, axis=2).astype(np.uint8))
    transform = eval_transform(CFG)
    a, b = transform(to_rgb(image)), transform(_before(image))
    levels = (a - b).abs() * 255 * 0.5  # back from mean/std 0.5 to grey levels
    assert float(levels.max()) <= (2 if max(size) > MAX_DECODE_SIDE else 1) + 1e-3, float(levels.max())


# ------------------------------------------------------------------ FIFOs, devices, folders


def _returns_promptly(call, *args):
    """``call(*args)``'s result or exception, failing the test (not hanging it) if it blocks."""
    outcome = {}

    def target():
        try:
            outcome["value"] = call(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), f"{call.__name__} blocked"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe.png"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(
    "make, kind, message",
    [
        (lambda p, fifo: fifo, "special", "is a FIFO (named pipe), not an image file"),
        (lambda p, fifo: Path("/dev/null"), "special", "is a character device, not an image file"),
        (lambda p, fifo: p, "folder", "is a folder, not an image file"),
        (lambda p, fifo: p / "gone.png", "missing", "does not exist"),
        (
            lambda p, fifo: (p / "link.png").symlink_to(p / "gone.png") or p / "link.png",
            "dangling",
            "link to a missing file",
        ),
    ],
)
def test_load_rgb_says_what_a_path_is_without_opening_it(tmp_path, fifo, make, kind, message):
    path = make(tmp_path, fifo)
    with pytest.raises(ImagePathError, match=re.escape(message)) as err:
        _returns_promptly(load_rgb, path)
    assert err.value.kind == kind and isinstance(err.value, OSError)


def test_a_file_swapped_for_a_fifo_after_the_check_is_refused_not_waited_on(fifo, monkeypatch):
    """``os.stat`` saw a regular file; the open is non-blocking and ``fstat`` sees the FIFO."""
    monkeypatch.setattr(decode, "path_problem", lambda path: None)
    with pytest.raises(ImagePathError, match="is a FIFO"):
        _returns_promptly(open_image_file, fifo)


def test_the_error_survives_pickling_and_a_worker_re_raise():
    import pickle

    error = ImagePathError("is a FIFO (named pipe), not an image file", Path("p"), "special")
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.path, copy.kind) == (str(error), Path("p"), "special")
    assert str(ImagePathError("Caught ImagePathError in a worker")) == "Caught ImagePathError in a worker"


def test_a_regular_file_opens_blocking_as_ever(tmp_path):
    path = tmp_path / "a.png"
    Image.new("RGB", (4, 4)).save(path)
    with open_image_file(path) as fp:
        assert os.get_blocking(fp.fileno()) and fp.read(4) == b"\x89PNG"


@pytest.mark.parametrize(
    "plant, message",
    [
        (lambda cls: os.mkfifo(cls / "pipe.png"), r"pipe.png is a FIFO \(named pipe\), not an image file"),
        (lambda cls: (cls / "null.png").symlink_to("/dev/null"), "null.png is a character device, not an image file"),
        (lambda cls: (cls / "link.png").symlink_to(cls / "gone.png"), "link.png is a symbolic link to a missing file"),
    ],
)
def test_special_files_in_a_data_folder_are_named_as_what_they_are(make_folder, plant, message):
    """Once skipped without a word (a class of only a FIFO was "empty"); now refused, naming the file."""
    root = make_folder("d", [0, 1], n=2)
    plant(root / "class_01")
    with pytest.raises(DataError, match=f"{message}; remove it or move it out of --data"):
        _returns_promptly(scan_class_folders, root)
    for path in (root / "class_01").iterdir():
        if path.name.startswith("img"):
            path.unlink()
    with pytest.raises(DataError, match=message):  # not "class folder ... is empty"
        scan_class_folders(root)


def test_a_fifo_directly_under_the_data_folder_is_not_called_a_file(make_folder):
    root = make_folder("d", [0], n=1)
    os.mkfifo(root / "pipe")
    with pytest.raises(DataError, match=r"pipe directly under --data .* is a FIFO \(named pipe\), not an image file"):
        scan_class_folders(root)


def test_a_fifo_found_at_validation_is_named_and_never_opened(make_folder):
    """A file swapped for a FIFO between the scan and the validation."""
    root = make_folder("d", [0], n=2)
    images = scan_class_folders(root)
    images.paths[1].unlink()
    os.mkfifo(images.paths[1])
    with pytest.raises(DataError, match=r"img_001.png is a FIFO \(named pipe\), not an image file; fix or remove"):
        _returns_promptly(validate_images, images)


def test_learn_stage_on_a_data_folder_with_a_fifo_exits_3(run_dir, make_folder):
    root = make_folder("d", [0, 1], n=2)
    os.mkfifo(root / "class_00" / "pipe.jpg")
    result = CliRunner().invoke(app, ["learn-stage", "--run", str(run_dir), "--data", str(root), "--device", "cpu"])
    assert result.exit_code == 3
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {root / 'class_00' / 'pipe.jpg'} is a FIFO (named pipe), not an image file; "
        "remove it or move it out of --data"
    )


def test_predict_lines_say_what_each_path_is(tmp_path, fifo):
    good = tmp_path / "good.png"
    Image.new("RGB", (20, 20)).save(good)
    folder = tmp_path / "folder"
    folder.mkdir()
    listing = tmp_path / "list.txt"
    listing.write_text("folder\npipe.png\n")
    paths = expand_sources([str(fifo), "/dev/null", str(listing), str(tmp_path / "gone.png"), str(good), "-"], stdin=[])
    errors = [_returns_promptly(_PathDataset(paths, eval_transform(CFG)).__getitem__, i)[2] for i in range(len(paths))]
    assert errors == [
        "is a FIFO (named pipe), not an image file; pass the image file itself",
        "is a character device, not an image file; pass the image file itself",
        "is a folder, not an image file: pass it as a folder source (drl predict FOLDER) to predict every image in it",
        "is a FIFO (named pipe), not an image file; pass the image file itself",
        "no such file",
        None,
    ]


def test_predict_folder_sources_list_a_fifo_named_as_an_image(tmp_path, fifo):
    """Listed (so its line says what it is) rather than skipped; sub-folders are walked, not listed."""
    (tmp_path / "sub.png").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "sub.png" / "a.png")
    (tmp_path / "notes").write_text("not an image name: skipped as ever")
    assert expand_sources([str(tmp_path)]) == [fifo, tmp_path / "sub.png" / "a.png"]
