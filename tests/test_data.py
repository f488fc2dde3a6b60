import json

import pytest
import torch
from PIL import Image

from drlcli.data import ImageDataset, eval_transform, scan_class_folders, train_transform, validate_images
from drlcli.errors import DataError, UsageError

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


def test_make_loader_pins_memory_for_a_gpu_only(make_folder):
    """Batches bound for CUDA are page-locked (the copy then overlaps loading); a CPU pass is left as it is."""
    import warnings

    from drlcli.data import make_loader

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
    from drlcli import data, evaluate, init_run, learn_stage, model, predict, train
    from drlcli.predict import predict_sources
    from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

    built = []

    def recording(dataset, *, batch_size, device, num_workers=0, **options):
        built.append((num_workers, torch.device(device).type))
        return data.make_loader(dataset, batch_size=batch_size, device=device, num_workers=0, **options)

    for module in (model, train, predict):
        monkeypatch.setattr(module, "make_loader", recording)
    run = tmp_path / "run"
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS)
    train_dir, test_dir = stage_folders[0]
    overrides = {"epochs": 1, "batch_size": 12, "num_workers": 2, "head_init": "prototypes"}
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
