import json

import numpy as np
import pytest
import torch
from conftest import Pairs
from PIL import Image

from drlcli.commands.predict import expand_sources
from drlcli.data.decode import load_rgb, to_rgb
from drlcli.data.images import dataset_images, image_extensions, scan_class_folders, validate_images
from drlcli.data.loading import ImageDataset, eval_transform, train_transform
from drlcli.errors import DataError, UsageError
from drlcli.ptm import backbone
from drlcli.synthetic import class_image

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


@pytest.mark.parametrize("threads", [1, 3])
def test_validate_reports_progress_in_order_up_to_the_total(make_folder, threads):
    root = make_folder("d", [0, 1, 2], n=5)
    images = scan_class_folders(root)
    calls = []
    validate_images(images, num_threads=threads, progress=lambda step, total: calls.append((step, total)))
    assert calls == [(step, 15) for step in range(1, 16)]
    (root / "class_01" / "img_002.png").write_bytes(b"junk")  # the 8th image in order
    calls.clear()
    with pytest.raises(DataError, match="img_002.png cannot be decoded"):
        validate_images(scan_class_folders(root), num_threads=threads, progress=lambda *a: calls.append(a))
    assert calls == [(step, 15) for step in range(1, 8)]  # the images before the failure
    dataset = dataset_images(Pairs([(class_image(0, 0), "a"), (class_image(1, 0), "b")]))
    calls.clear()
    validate_images(dataset, progress=lambda *a: calls.append(a))  # checked when read: done at once
    assert calls == [(2, 2)]


def test_missing_or_empty_data_folder(tmp_path):
    with pytest.raises(DataError, match="not a directory"):
        scan_class_folders(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no class folders"):
        scan_class_folders(tmp_path / "empty")


# ------------------------------------------------------------------ every format Pillow reads


def test_every_format_pillow_reads_is_an_image(tmp_path):
    from PIL import features

    folder = tmp_path / "d" / "cls"
    folder.mkdir(parents=True)
    class_image(0, 0).save(folder / "a.tif")
    class_image(0, 1).save(folder / "b.TIFF", compression="tiff_lzw")
    class_image(0, 2).save(folder / "c.gif")
    names = ["a.tif", "b.TIFF", "c.gif"]
    if features.check("webp"):
        class_image(0, 3).save(folder / "d.webp", lossless=True)
        names.append("d.webp")
    images = scan_class_folders(tmp_path / "d")
    validate_images(images)
    assert [p.name for p in images.paths] == names
    assert load_rgb(folder / "a.tif").tobytes() == class_image(0, 0).tobytes()
    assert {".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".gif"} <= image_extensions()
    assert not {".txt", ".csv", ".json", ".pdf"} & image_extensions()  # .pdf: Pillow writes it, cannot read it
    assert [p.name for p in expand_sources([str(tmp_path / "d")])] == names  # predict lists them too


@pytest.mark.parametrize(
    ("suffix", "pixels", "grey"),
    [
        (".png", np.array([[0, 257 * 128, 65535]], dtype=np.uint16), [0, 128, 255]),  # 16-bit: by 65535
        (".tif", np.array([[0, 257 * 128, 65535]], dtype=np.uint16), [0, 128, 255]),
        (".tif", np.array([[0.0, 0.5, 1.0]], dtype=np.float32), [0, 128, 255]),  # float in [0, 1]: by 255
        (".tif", np.array([[-2.0, 0.0, 2.0]], dtype=np.float32), [0, 128, 255]),  # other floats: by range
    ],
)
def test_wide_images_are_scaled_to_8_bits_not_clipped(tmp_path, suffix, pixels, grey):
    """PIL's own RGB conversion clips at 255: a 16-bit photo turned white, a [0, 1] float one black."""
    path = tmp_path / f"wide{suffix}"
    Image.fromarray(np.repeat(pixels, 2, axis=0)).save(path)
    for image in (load_rgb(path), to_rgb(Image.open(path))):
        rgb = np.asarray(image)
        assert image.mode == "RGB" and rgb[0, :, 0].tolist() == grey and (rgb[..., 0] == rgb[..., 2]).all()


def test_a_file_named_as_an_image_that_is_not_one_is_refused(make_folder):
    root = make_folder("d", [0], n=1)
    (root / "class_00" / "scan.tif").write_bytes(b"not a tiff at all")
    with pytest.raises(DataError, match=r"scan.tif cannot be decoded .*; fix or remove the file"):
        validate_images(scan_class_folders(root))
    (root / "class_00" / "scan.tif").unlink()
    (root / "class_00" / "notes").write_text("x")
    with pytest.raises(
        DataError, match=r"notes is not an image \(no format Pillow reads has the extension '\(none\)'\)"
    ):
        scan_class_folders(root)


# ------------------------------------------------------------------------- timm's transforms


def test_train_transform_is_timms_and_matches_the_former_hand_written_one(monkeypatch):
    """timm's crop and torchvision's (the former hand-written transform) differ only in where the
    crop box is drawn from (Python's random vs torch's generator): with the same box and flip
    draw, they give the same tensor."""
    from timm.data.transforms import RandomResizedCropAndInterpolation
    from torchvision import transforms as T

    new = train_transform(CFG, crop_scale_min=0.3, hflip=True)
    crop, flip = new.transforms[:2]
    assert isinstance(crop, RandomResizedCropAndInterpolation)
    assert crop.size == (32, 32) and crop.scale == (0.3, 1.0) and crop.ratio == (3 / 4, 4 / 3)
    assert crop.interpolation == T.InterpolationMode.BICUBIC
    assert isinstance(flip, T.RandomHorizontalFlip) and flip.p == 0.5
    no_flip = train_transform(CFG, crop_scale_min=0.3, hflip=False)
    assert [type(t).__name__ for t in no_flip.transforms] == [
        "RandomResizedCropAndInterpolation",
        "MaybeToTensor",
        "Normalize",
    ]

    box = (3, 5, 20, 17)  # top, left, height, width
    monkeypatch.setattr(RandomResizedCropAndInterpolation, "get_params", staticmethod(lambda img, scale, ratio: box))
    monkeypatch.setattr(T.RandomResizedCrop, "get_params", staticmethod(lambda img, scale, ratio: box))
    former = T.Compose(
        [
            T.RandomResizedCrop((32, 32), scale=(0.3, 1.0), interpolation=T.InterpolationMode.BICUBIC),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(CFG["mean"], CFG["std"]),
        ]
    )
    image = class_image(2, 0, size=48)
    for seed in range(4):  # flipped and not
        torch.manual_seed(seed)
        ours = new(image)
        torch.manual_seed(seed)
        assert torch.equal(ours, former(image))


def test_eval_transform_is_timms_own(tiny_ptm):
    from timm.data import create_transform, resolve_data_config

    image = class_image(1, 0, size=45)
    timm_cfg = resolve_data_config({}, model=tiny_ptm)
    timm_cfg["input_size"] = (3, 32, 32)
    assert torch.equal(eval_transform(backbone.data_config(tiny_ptm))(image), create_transform(**timm_cfg)(image))


# ------------------------------------------------------------------------ torch datasets


def test_dataset_of_pil_images_and_tensors_with_names_or_int_labels():
    a, b = class_image(0, 0), class_image(1, 0, size=20)
    as_uint8 = torch.from_numpy(np.array(b)).permute(2, 0, 1).contiguous()  # (3, H, W)
    as_float = as_uint8.float() / 255  # what ToTensor gives
    gray = torch.full((9, 7), 0.5)
    named = dataset_images(Pairs([(a, "zebra"), (as_uint8, "ant"), (as_float, "ant"), (gray, "zebra")]))
    assert named.class_names == ("ant", "zebra") and named.labels == (1, 0, 0, 1)  # sorted names
    assert named.load(1).tobytes() == named.load(2).tobytes() == b.tobytes()  # ToTensor inverted exactly
    assert named.load(3).size == (7, 9) and named.load(3).getpixel((0, 0)) == (128, 128, 128)
    assert named.counts() == {"ant": 2, "zebra": 2} and "Pairs" in named.origin

    classes = ["cat", "ant", "bee", "zebra"]
    numbered = dataset_images(
        Pairs([(a, 3), (as_uint8, np.int64(1)), (as_float, torch.tensor(1)), (gray, 3)]), class_names=classes
    )
    assert numbered.class_names == ("ant", "zebra")  # the classes present, in class_names order
    assert numbered.labels == (1, 0, 0, 1) and numbered.fingerprint() == named.fingerprint()
    # a PIL image or its tensor: the same pixels, the same fingerprint; one pixel more: another
    same = dataset_images(
        Pairs([(torch.from_numpy(np.array(a)).permute(2, 0, 1), "zebra"), (b, "ant"), (b, "ant"), (gray, "zebra")])
    )
    assert same.fingerprint() == named.fingerprint()
    b2 = b.copy()
    b2.putpixel((0, 0), (0, 0, 0))
    assert (
        dataset_images(Pairs([(a, "zebra"), (b2, "ant"), (b, "ant"), (gray, "zebra")])).fingerprint()
        != named.fingerprint()
    )
    for x, label in ImageDataset(named, eval_transform(CFG)):
        assert x.shape == (3, 32, 32) and label in (0, 1)


def test_a_dataset_image_is_never_changed_and_huge_ones_are_reduced():
    huge = Image.new("RGB", (3000, 200), (10, 20, 30))
    strip = Image.new("RGB", (3000, 100), (10, 20, 30))  # 30:1, beyond MAX_ASPECT: its middle 16:1
    images = dataset_images(Pairs([(huge, "a"), (strip, "a")]))
    assert images.load(0).size == (2048, 137) and huge.size == (3000, 200)
    assert images.load(1).size == (1600, 100) and strip.size == (3000, 100)


def _boom(index):
    raise KeyError("no such sample")


class Broken(Pairs):
    def __getitem__(self, index):
        return _boom(index)


@pytest.mark.parametrize(
    "items, class_names, error, message",
    [
        ([], None, DataError, "data is an empty dataset"),
        ([class_image(0, 0)], None, DataError, "item 0 of data is a Image, not an"),
        ([(class_image(0, 0), "a", 1)], None, DataError, "item 0 of data is a tuple, not an"),
        ([("x.png", "a")], None, DataError, "the image of item 0 of data is a str, not a PIL image or a tensor"),
        ([(torch.zeros(2, 8, 8), "a")], None, DataError, r"shape \(2, 8, 8\); give \(C, H, W\)"),
        ([(torch.zeros(1, 3, 8, 8), "a")], None, DataError, r"shape \(1, 3, 8, 8\)"),
        ([(torch.full((3, 8, 8), 1.5), "a")], None, DataError, r"values outside \[0, 1\]"),
        ([(torch.full((3, 8, 8), float("nan")), "a")], None, DataError, r"values outside \[0, 1\]"),
        ([(torch.zeros(3, 8, 8, dtype=torch.int32), "a")], None, DataError, "torch.int32 tensor; give uint8"),
        ([(Image.new("RGB", (0, 5)), "a")], None, DataError, "item 0 of data has no pixels"),
        ([(class_image(0, 0), 0)], None, UsageError, r"int label \(0\); pass class_names"),
        ([(class_image(0, 0), 2)], ["a", "b"], DataError, r"label 2, outside class_names \(0 to 1\)"),
        ([(class_image(0, 0), -1)], ["a", "b"], DataError, "label -1, outside"),
        ([(class_image(0, 0), "c")], ["a", "b"], DataError, "class 'c', which class_names does not list"),
        ([(class_image(0, 0), 1.0)], ["a", "b"], DataError, "label of type float; give a class name"),
        ([(class_image(0, 0), True)], ["a", "b"], DataError, "label of type bool"),
        ([(class_image(0, 0), " ")], None, DataError, "class name ' '"),
        ([(class_image(0, 0), "Cat"), (class_image(0, 1), "cat")], None, DataError, "differs from class"),
        ([(class_image(0, 0), 0)], "ab", UsageError, "class_names for data must be a non-empty list"),
        ([(class_image(0, 0), 0)], [], UsageError, "non-empty list"),
        ([(class_image(0, 0), 0)], ["a", 1], UsageError, "non-empty list"),
        ([(class_image(0, 0), 0)], ["a", "b", "a"], UsageError, "names 'a' twice"),
    ],
)
def test_bad_datasets_are_refused_naming_the_item(items, class_names, error, message):
    with pytest.raises(error, match=message):
        dataset_images(Pairs(items), class_names=class_names)


def test_a_dataset_that_raises_or_has_no_length_is_refused():
    with pytest.raises(
        DataError, match=r"item 0 of data cannot be read \(KeyError: 'no such sample'\); fix the dataset"
    ):
        dataset_images(Broken([None]))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield class_image(0, 0), "a"

    with pytest.raises(UsageError, match="map-style torch Dataset"):
        dataset_images(Stream())


def test_make_loader_pins_memory_for_a_gpu_only(make_folder):
    """Batches bound for CUDA are page-locked (the copy then overlaps loading); a CPU pass is left as it is."""
    import warnings

    from drlcli.data.loading import make_loader

    dataset = ImageDataset(scan_class_folders(make_folder("d", [0], n=2)), eval_transform(CFG))
    with warnings.catch_warnings():  # without CUDA torch may warn that pinning is moot
        warnings.simplefilter("ignore", UserWarning)
        gpu = make_loader(dataset, batch_size=2, device=torch.device("cuda", 0), num_workers=3, shuffle=False)
    cpu = make_loader(dataset, batch_size=2, device=torch.device("cpu"), shuffle=False)
    assert gpu.pin_memory is True and gpu.num_workers == 3 and gpu.batch_size == 2
    assert cpu.pin_memory is False and cpu.num_workers == 0


def test_every_pass_loads_with_the_workers_asked_for(stage_folders, tmp_path, monkeypatch):
    """Training, the classifier's prototype start, the prototype/statistics pass, evaluation and predict
    all build their loader with the requested workers and their device (pin_memory follows it)."""
    from drlcli import data, evaluate, learn_stage
    from drlcli.commands import predict
    from drlcli.commands.init import init_run
    from drlcli.commands.predict import predict_sources
    from drlcli.config import RunConfig
    from drlcli.model import incremental as model
    from drlcli.stage import train
    from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

    built = []

    def recording(dataset, *, batch_size, device, num_workers=0, **options):
        built.append((num_workers, torch.device(device).type))
        return data.make_loader(dataset, batch_size=batch_size, device=device, num_workers=0, **options)

    for module in (model, train, predict):
        monkeypatch.setattr(module, "make_loader", recording)
    run = tmp_path / "run"
    config = RunConfig.for_method("drl", preset="frozen")  # the IPA network, trained below
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    train_dir, test_dir = stage_folders[0]
    overrides = {"epochs": 1, "batch_size": 12, "num_workers": 2, "head_init": "prototypes", "skip_unread": False}
    learn_stage(run, data_dir=train_dir, eval_data_dir=test_dir, train_overrides=overrides, device="cpu")
    assert built == [(2, "cpu")] * 4  # head start, training, prototypes (and the ridge statistics), evaluation
    built.clear()
    evaluate(run, all_seen=True, device="cpu", num_workers=3)
    assert built == [(3, "cpu")]
    built.clear()
    assert len(list(predict_sources([str(test_dir)], run_dir=run, device="cpu", num_workers=1))) == 12
    assert built == [(1, "cpu")]
    with pytest.raises(UsageError, match=r"--workers must be an integer in \[0, 256\], got -1"):
        evaluate(run, all_seen=True, device="cpu", num_workers=-1)
    with pytest.raises(UsageError, match="--workers"):
        list(predict_sources([str(test_dir)], run_dir=run, device="cpu", num_workers=1000))


def test_eval_with_worker_processes_gives_the_same_accuracy(learned_run, stage_folders):
    from typer.testing import CliRunner

    from drlcli.cli import app

    runner = CliRunner()
    args = ["eval", "--run", str(learned_run), "--data", str(stage_folders[1][1]), "--device", "cpu", "--json"]
    plain, workers = (runner.invoke(app, [*args, "--workers", n]) for n in ("0", "2"))
    assert plain.exit_code == workers.exit_code == 0, workers.output
    assert json.loads(plain.stdout)["accuracy"] == json.loads(workers.stdout)["accuracy"]
    too_many = runner.invoke(app, [*args, "--workers", "100000"])
    assert too_many.exit_code == 2 and "--workers" in too_many.stderr
