import pytest
import torch

from drlcli import export_run, learn_stage, load_export, load_run
from drlcli.data import scan_class_folders
from drlcli.errors import IntegrityError
from drlcli.model import embed_images


@pytest.fixture
def learned(run_dir, stage_folders):
    for train, test in stage_folders[:2]:
        learn_stage(
            run_dir, data_dir=train, eval_data_dir=test, train_overrides={"epochs": 1, "batch_size": 12}, device="cpu"
        )
    return run_dir


def _predict(model, folder):
    feats, _ = embed_images(model.network, scan_class_folders(folder), model.data_config, batch_size=16)
    return model.scores(feats)


def test_export_round_trip_gives_identical_scores(learned, stage_folders, tmp_path):
    out = export_run(learned, tmp_path / "m.drl")
    assert out.num_stages == 2 and out.num_classes == 6
    exported = load_export(tmp_path / "m.drl")
    from_run = load_run(learned, device="cpu").model
    assert exported.class_names == from_run.class_names
    test_dir = stage_folders[1][1]
    assert torch.allclose(_predict(exported, test_dir), _predict(from_run, test_dir), atol=1e-6)


def test_damaged_export_is_refused(learned, tmp_path):
    path = tmp_path / "m.drl"
    export_run(learned, path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="damaged"):
        load_export(path)
    (tmp_path / "junk.drl").write_bytes(b"junk")
    with pytest.raises(IntegrityError, match="not a readable drl export"):
        load_export(tmp_path / "junk.drl")
