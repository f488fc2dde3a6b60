"""Shared fixtures: a tiny random timm ViT, generated class folders, an initialised run.

Everything runs on CPU and offline (HF_HUB_OFFLINE=1), seeded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

from drlcli.ptm import backbone  # noqa: E402
from drlcli.ptm.backbone import PTMSource  # noqa: E402
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders, make_stages  # noqa: E402

# drl's IPA network on the frozen PTM (``--preset frozen``, the frozen head) trains each new stage
# under this, though that head reads none (train.skip_unread): for the tests of training itself
# (losses, checkpoints, resume, ranks, precision), as ``RunConfig.for_method("drl", TRAINS, preset=FROZEN)``
FROZEN = "frozen"
TRAINS = {"train": {"skip_unread": False}}


@pytest.fixture(scope="session")
def trains_file(tmp_path_factory) -> Path:
    """``TRAINS`` as a config file, for ``drl init --config``."""
    import yaml

    path = tmp_path_factory.mktemp("config") / "trains.yaml"
    path.write_text(yaml.safe_dump({"preset": FROZEN, **TRAINS}))
    return path


def rewrite_stage_meta(run: Path, index: int, change) -> None:
    """Change a stage's stage.json with ``change(meta)`` and re-sign it in the manifest (a crafted run)."""
    import json

    from drlcli.run.layout import sha256_bytes

    name = f"stages/{index:03d}/stage.json"
    meta = json.loads((run / name).read_text())
    change(meta)
    data = json.dumps(meta).encode()
    (run / name).write_bytes(data)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (run / "manifest.json").write_text(json.dumps(manifest))


def rewrite_stage_weights(run: Path, index: int, change) -> None:
    """Change a stage's tensors with ``change(tensors)`` (its weights and, for the newest stage, its
    totals, together as the heads read them) and their manifest entries consistently (a crafted run)."""
    import json

    from safetensors.torch import load, save

    from drlcli.heads import running
    from drlcli.run.layout import sha256_bytes

    manifest = json.loads((run / "manifest.json").read_text())
    folder = f"stages/{index:03d}"
    weights = next(n for n in manifest["files"] if n.startswith(f"{folder}/weights"))
    totals = next((n for n in manifest["files"] if n.startswith(f"{folder}/totals")), None)
    parts = {weights: load((run / weights).read_bytes())}
    if totals is not None:
        parts[totals] = load((run / totals).read_bytes())
    tensors = {k: v for part in parts.values() for k, v in part.items()}
    change(tensors)
    in_totals = set(parts.get(totals, {})) | set(running())
    for name in parts:
        kept = {k: v for k, v in tensors.items() if (k in in_totals) == (name == totals)}
        data = save(kept)
        (run / name).write_bytes(data)
        manifest["files"][name] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (run / "manifest.json").write_text(json.dumps(manifest))


class Pairs(torch.utils.data.Dataset):
    """A map-style torch Dataset over a list of (image, label) pairs (the API's Dataset input)."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


SHARED_DATA = Path(os.environ.get("DRL_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.fixture
def shared_data() -> Path:
    """The real data beside the repo (../shared/data); the test is skipped without it."""
    if not (SHARED_DATA / "deit_tiny_patch16_224").is_dir():
        pytest.skip("../shared/data is not available")
    return SHARED_DATA


@pytest.fixture
def tiny_ptm() -> torch.nn.Module:
    return backbone.create_ptm(TINY_PTM, source=PTMSource(random_init=True, seed=0), kwargs=TINY_PTM_KWARGS)


@pytest.fixture
def images() -> torch.Tensor:
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def stage_folders(tmp_path_factory) -> list[tuple[Path, Path]]:
    """Three stages of 3 classes: (train, test) folders, 12 train and 4 test images per class."""
    return make_stages(tmp_path_factory.mktemp("data"), num_stages=3, classes_per_stage=3, train=12, test=4)


def new_run(path: Path) -> Path:
    """A freshly initialised DRL run at ``path`` (the frozen PTM's IPA network) on the tiny random ViT
    that trains its stages (``TRAINS``: a dataset reaches training, not only the feature passes)."""
    from drlcli.commands.init import init_run
    from drlcli.config import RunConfig

    init_run(
        path,
        ptm=TINY_PTM,
        random_init=True,
        ptm_kwargs=TINY_PTM_KWARGS,
        config=RunConfig.for_method("drl", TRAINS, preset=FROZEN),
    )
    return path


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """``new_run`` in the test's folder."""
    return new_run(tmp_path / "run")


FAST = {"epochs": 2, "batch_size": 12}


@pytest.fixture(scope="session")
def learned_run(tmp_path_factory, stage_folders) -> Path:
    """A ``drl --preset frozen`` run with the first two stages of ``stage_folders`` learned (1 epoch,
    batch 12, no eval data), shared by every module that only reads a learned run: a test that
    changes it copies it. (The default's switched runs: ``test_switch.py``.)"""
    from drlcli import learn_stage
    from drlcli.commands.init import init_run
    from drlcli.config import RunConfig

    path = tmp_path_factory.mktemp("learned") / "run"
    config = RunConfig.for_method("drl", preset=FROZEN)
    init_run(path, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    for train, _ in stage_folders[:2]:
        learn_stage(path, data_dir=train, train_overrides={"epochs": 1, "batch_size": 12}, device="cpu")
    return path


@pytest.fixture
def make_folder(tmp_path):
    def make(name: str, class_ids: list[int], n: int = 4) -> Path:
        return make_class_folders(tmp_path / name, class_ids, images_per_class=n)

    return make


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip without CUDA: ``pytest -m gpu`` is the one command for a GPU host."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
