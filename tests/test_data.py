import pytest
import torch
from PIL import Image

from drlcli.data import ImageDataset, eval_transform, scan_class_folders, train_transform, validate_images
from drlcli.errors import DataError

CFG = {"input_size": [3, 32, 32], "interpolation": "bicubic", "mean": [0.5] * 3, "std": [0.5] * 3, "crop_pct": 0.875}


def test_scan_lists_classes_and_images(make_folder):
    root = make_folder("d", [0, 1], n=3)
    (root / "class_00" / ".DS_Store").write_text("ignored")
    images = scan_class_folders(root)
    assert images.class_names == ("class_00", "class_01")
    assert len(images) == 6 and images.counts() == {"class_00": 3, "class_01": 3}
    assert images.fingerprint() == scan_class_folders(root).fingerprint()


def test_grayscale_and_odd_sizes_are_converted(tmp_path):
    folder = tmp_path / "d" / "gray"
    folder.mkdir(parents=True)
    Image.new("L", (41, 17), 128).save(folder / "a.png")
    Image.new("RGBA", (7, 90), (1, 2, 3, 4)).save(folder / "b.webp")
    Image.new("I;16", (20, 20)).save(folder / "c.png")
    images = scan_class_folders(tmp_path / "d")
    validate_images(images)
    for transform in (eval_transform(CFG), train_transform(CFG, crop_scale_min=0.5, hflip=True)):
        for x, label in ImageDataset(images, transform):
            assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and label == 0


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda r: (r / "class_02").mkdir(), "class_02 is empty"),
        (lambda r: (r / "notes.txt").write_text("x"), "directly under --data"),
        (lambda r: (r / "class_00" / "labels.csv").write_text("x"), "labels.csv is not an image"),
        (lambda r: (r / "class_00" / "bad.jpg").write_bytes(b"not a jpeg"), None),
    ],
)
def test_bad_folders_are_refused_naming_the_problem(make_folder, breakage, message):
    root = make_folder("d", [0, 1], n=2)
    breakage(root)
    with pytest.raises(DataError) as err:
        validate_images(scan_class_folders(root))
    assert (message or "bad.jpg cannot be decoded") in str(err.value)


def test_truncated_image_is_refused(make_folder):
    root = make_folder("d", [0], n=2)
    path = root / "class_00" / "img_000.png"
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(DataError, match="img_000.png cannot be decoded"):
        validate_images(scan_class_folders(root))


def test_missing_or_empty_data_folder(tmp_path):
    with pytest.raises(DataError, match="not a directory"):
        scan_class_folders(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no class folders"):
        scan_class_folders(tmp_path / "empty")
