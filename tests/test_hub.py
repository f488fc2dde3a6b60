"""`--ptm hf-hub:ORG/NAME`: PTMs through the local Hugging Face cache, offline.

Each test builds the cache itself in tmp_path, laid out as huggingface_hub lays it out
(models--ORG--NAME/{refs/main, blobs/<sha256>, snapshots/<commit>/<file> -> blob}), with a tiny
timm ViT's config.json and model.safetensors, and points HF_HUB_CACHE at it.
"""

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file
from typer.testing import CliRunner

from drlcli import learn_stage
from drlcli.cli import app
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.errors import IntegrityError, PTMError, UsageError
from drlcli.ptm import backbone, hub
from drlcli.ptm.backbone import PTMSource
from drlcli.ptm.record import check_ptm_record
from drlcli.run.layout import sha256_bytes
from drlcli.run.load import load_run
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

runner = CliRunner()
REPO = "timm/vit_tiny_test"
NAME = f"hf-hub:{REPO}"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CONFIG = {
    "architecture": TINY_PTM,
    "num_classes": 0,
    "model_args": TINY_PTM_KWARGS,
    "pretrained_cfg": {
        "input_size": [3, 32, 32],
        "interpolation": "bilinear",
        "mean": [0.5, 0.5, 0.5],
        "std": [0.25, 0.25, 0.25],
        "crop_pct": 0.9,
        "crop_mode": "center",
        # what timm would download or read besides: never used by drl
        "hf_hub_id": "attacker/elsewhere",
        "file": "/etc/passwd",
        "url": "https://example.com/bomb.pth",
    },
}


def _weights() -> dict[str, torch.Tensor]:
    model = backbone.create_ptm(TINY_PTM, source=PTMSource(random_init=True, seed=7), kwargs=TINY_PTM_KWARGS)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["head.weight"] = torch.zeros(10, 64)  # a hub checkpoint keeps its classifier; drl drops it
    return state


def cache_repo(cache: Path, repo: str = REPO, *, config=CONFIG, weights: bool = True, commit: str = COMMIT) -> Path:
    """One snapshot of ``repo`` in the cache at ``cache``; ``config`` a dict (JSON) or raw bytes."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    for folder in (snapshot, repo_dir / "blobs", repo_dir / "refs"):
        folder.mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    files = {"config.json": config if isinstance(config, bytes) else json.dumps(config).encode()}
    if weights:
        save_file(_weights(), str(cache / "weights.tmp"))
        files["model.safetensors"] = (cache / "weights.tmp").read_bytes()
        (cache / "weights.tmp").unlink()
    for name, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "hf" / "hub"
    root.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


def _record(run: Path) -> dict:
    return yaml.safe_load((run / "run.yaml").read_text())["ptm"]


def test_init_resolves_the_cache_and_records_repo_commit_and_sha256(cache, tmp_path, stage_folders):
    snapshot = cache_repo(cache)
    result = init_run(tmp_path / "run", ptm=NAME, config=RunConfig.for_method("simplecil"))
    ptm = _record(tmp_path / "run")
    assert ptm["name"] == TINY_PTM and ptm["kwargs"] == TINY_PTM_KWARGS and ptm["source"] == "hf-hub"
    file_sha = hashlib.sha256((snapshot / "model.safetensors").read_bytes()).hexdigest()
    assert ptm["hub"] == {"repo": REPO, "revision": COMMIT, "weights_sha256": file_sha}
    assert result.ptm_hub == ptm["hub"] and result.ptm_source == "hf-hub"
    # the weights are the file's (its classifier head dropped), the preprocessing the config's
    expected = {k: v for k, v in _weights().items() if not k.startswith("head.")}
    assert ptm["sha256"] == backbone.tensors_sha256(expected)
    assert ptm["data_config"] == {
        "input_size": [3, 32, 32],
        "interpolation": "bilinear",
        "mean": [0.5, 0.5, 0.5],
        "std": [0.25, 0.25, 0.25],
        "crop_pct": 0.9,
        "crop_mode": "center",
    }
    # a later command takes the recorded commit's weights from the cache
    learn_stage(tmp_path / "run", data_dir=stage_folders[0][0], device="cpu")
    assert load_run(tmp_path / "run", device="cpu").model.class_names == ["class_00", "class_01", "class_02"]


def test_a_run_whose_cached_weights_are_gone_names_the_command_and_takes_ptm_weights(cache, tmp_path):
    snapshot = cache_repo(cache)
    init_run(tmp_path / "run", ptm=NAME, config=RunConfig.for_method("simplecil"))
    kept = Path(shutil.copy(snapshot / "model.safetensors", tmp_path / "kept.safetensors"))
    shutil.rmtree(cache / f"models--{REPO.replace('/', '--')}")
    with pytest.raises(PTMError, match=f"`hf download {REPO} config.json model.safetensors --revision {COMMIT}`"):
        load_run(tmp_path / "run", device="cpu")
    assert load_run(tmp_path / "run", device="cpu", ptm_weights=kept).model.class_names == []


def test_revision_after_at_is_a_ref_or_the_commit(cache, tmp_path):
    cache_repo(cache)
    for i, name in enumerate((f"{NAME}@main", f"{NAME}@{COMMIT}")):
        init_run(tmp_path / f"run{i}", ptm=name, config=RunConfig.for_method("simplecil"))
        assert _record(tmp_path / f"run{i}")["hub"]["revision"] == COMMIT
    with pytest.raises(PTMError, match=f"hf download {REPO} config.json model.safetensors --revision v2"):
        init_run(tmp_path / "run9", ptm=f"{NAME}@v2", config=RunConfig.for_method("simplecil"))


def test_cli_init_and_info_show_the_hub_repo(cache, tmp_path):
    cache_repo(cache)
    run = tmp_path / "run"
    result = runner.invoke(app, ["init", "--run", str(run), "--ptm", NAME, "--method", "simplecil", "--json"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["ptm"] == TINY_PTM and out["ptm_hub"]["repo"] == REPO and out["ptm_hub"]["revision"] == COMMIT
    shown = runner.invoke(app, ["info", "--run", str(run)])
    assert f"hf-hub:{REPO} at {COMMIT[:12]}" in shown.stdout
    assert json.loads(runner.invoke(app, ["info", "--run", str(run), "--json"]).stdout)["ptm"]["hub"]["repo"] == REPO


def test_not_cached_and_offline_fails_fast_with_the_hf_download_command(cache, tmp_path):
    run = tmp_path / "run"
    start = time.monotonic()
    result = runner.invoke(app, ["init", "--run", str(run), "--ptm", "hf-hub:timm/not_cached"])
    assert time.monotonic() - start < 30
    assert result.exit_code == 6
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("load ")]  # the phase line
    assert len(lines) == 1 and "`hf download timm/not_cached config.json model.safetensors`" in lines[0]
    assert "HF_HUB_OFFLINE" in lines[0] and str(cache) in lines[0]
    assert not run.exists()  # the folder init made is removed again


def test_unreachable_hub_reads_the_cache_only(cache, tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(socket, "create_connection", _refuse)
    with pytest.raises(PTMError, match=r"cannot be reached \(ConnectionRefusedError\).*hf download timm/nothing"):
        hub.load_hub_ptm("hf-hub:timm/nothing")
    cache_repo(cache)
    assert hub.load_hub_ptm(NAME).record["revision"] == COMMIT


def _refuse(*args, **kwargs):
    raise ConnectionRefusedError("refused")


class _Touch:
    """Unpickling it creates a file: what a pickled checkpoint can do."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_repo_without_safetensors_is_refused_and_its_pickle_never_read(cache, tmp_path):
    snapshot = cache_repo(cache, weights=False)
    torch.save({"model": _Touch(tmp_path / "pwned")}, snapshot / "pytorch_model.bin")
    result = runner.invoke(app, ["init", "--run", str(tmp_path / "run"), "--ptm", NAME])
    assert result.exit_code == 6
    assert f"{NAME} is not in the Hugging Face cache {cache} (no model.safetensors)" in result.stderr
    assert f"hf download {REPO} config.json model.safetensors --revision {COMMIT}" in result.stderr
    assert not (tmp_path / "pwned").exists()


def _with(**changes):
    return {**CONFIG, **changes}


def _pretrained(**changes):
    return _with(pretrained_cfg={**CONFIG["pretrained_cfg"], **changes})


@pytest.mark.parametrize(
    "config, message",
    [
        (_with(model_args={**TINY_PTM_KWARGS, "checkpoint_path": "BOMB"}), "'checkpoint_path' from .*model_args"),
        (_with(model_args={**TINY_PTM_KWARGS, "pretrained_cfg_overlay": {"file": "BOMB"}}), "'pretrained_cfg_overlay'"),
        (_with(model_args={**TINY_PTM_KWARGS, "img_size": 10**9}), r"img_size=1000000000 .* must be an int"),
        (_with(model_args=["img_size", 32]), "must be a mapping"),
        (_with(architecture="hf-hub:timm/another"), "names no timm model"),
        (_with(architecture="not_a_model"), "names no timm model"),
        ({"pretrained_cfg": CONFIG["pretrained_cfg"]}, r"names no timm model \(architecture None\)"),
        (_with(architecture="resnet18", model_args={}), "not a timm ViT with a class token"),
        (_pretrained(mean=["a", "b", "c"]), "unusable preprocessing .*mean"),
        (_pretrained(interpolation="__import__('os')"), "unusable preprocessing .*interpolation"),
        (_pretrained(std=[0, 1, 1]), "unusable preprocessing .*std"),
        (_with(pretrained_cfg=[1, 2]), "pretrained_cfg is a list"),
        (b'{"architecture": "vit_tiny_patch16_224", "pretrained_cfg": {"mean": [NaN, 0, 0]}}', "not valid JSON"),
        (b"\x80\x03cos\nsystem\n", "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b" " * (hub.MAX_CONFIG_BYTES + 1), "more than the 1,048,576 drl reads"),
    ],
)
def test_hostile_config_json_is_refused_and_runs_nothing(cache, tmp_path, config, message):
    cache_repo(
        cache,
        config=config
        if isinstance(config, bytes)
        else json.loads(json.dumps(config).replace("BOMB", str(tmp_path / "bomb.pth"))),
    )
    run = tmp_path / "run"
    with pytest.raises(PTMError, match=message):
        init_run(run, ptm=NAME)
    result = runner.invoke(app, ["init", "--run", str(run), "--ptm", NAME])
    assert result.exit_code == 6 and len(result.stderr.strip().splitlines()) == 1
    assert not (run / "manifest.json").exists()


def test_older_single_dict_config_and_ptm_args_over_model_args(cache, tmp_path):
    legacy = {"architecture": TINY_PTM, **CONFIG["pretrained_cfg"]}  # timm's layout before pretrained_cfg
    cache_repo(cache, config=legacy)
    built = hub.load_hub_ptm(NAME, kwargs=TINY_PTM_KWARGS)  # no model_args: --ptm-arg gives the shape
    assert built.kwargs == TINY_PTM_KWARGS and built.data_config["interpolation"] == "bilinear"
    with pytest.raises(PTMError, match="do not fit"):  # the architecture's default shape: not these weights
        hub.load_hub_ptm(NAME)


@pytest.mark.parametrize(
    "name", ["hf-hub:timm", "hf-hub:timm/../x", "hf-hub:timm/a--b", "hf-hub:/x", "hf-hub:timm/x@a b"]
)
def test_malformed_hub_names_are_ptm_errors(cache, tmp_path, name):
    result = runner.invoke(app, ["init", "--run", str(tmp_path / "run"), "--ptm", name])
    assert result.exit_code == 6 and (
        "does not name a Hugging Face repo" in result.stderr or "invalid revision" in result.stderr
    )


def test_hub_ptm_with_weights_or_random_init_is_a_usage_error(cache, tmp_path):
    for extra in (["--random-init"], ["--ptm-weights", str(tmp_path / "w.safetensors")]):
        result = runner.invoke(app, ["init", "--run", str(tmp_path / "run"), "--ptm", NAME, *extra])
        assert result.exit_code == 2 and "brings its own weights" in result.stderr


@pytest.mark.parametrize(
    "hub_record, message",
    [
        (None, "ptm.hub must be a mapping"),
        ({"repo": "../../etc", "revision": COMMIT, "weights_sha256": "0" * 64}, "ptm.hub.repo"),
        ({"repo": REPO, "revision": "main", "weights_sha256": "0" * 64}, "ptm.hub.revision"),
        ({"repo": REPO, "revision": COMMIT, "weights_sha256": "x"}, "ptm.hub.weights_sha256"),
    ],
)
def test_crafted_hub_record_is_refused(hub_record, message):
    record = {
        "name": TINY_PTM,
        "kwargs": {},
        "sha256": "0" * 64,
        "source": "hf-hub",
        "data_config": CONFIG["pretrained_cfg"],
    }
    with pytest.raises(UsageError, match=message):
        check_ptm_record({**record, "hub": hub_record})


def test_crafted_run_yaml_hub_record_is_an_integrity_error(cache, tmp_path):
    cache_repo(cache)
    run = tmp_path / "run"
    init_run(run, ptm=NAME, config=RunConfig.for_method("simplecil"))
    record = yaml.safe_load((run / "run.yaml").read_text())
    record["ptm"]["hub"]["repo"] = "../../../etc"
    data = yaml.safe_dump(record).encode()
    (run / "run.yaml").write_bytes(data)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["files"]["run.yaml"] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match="ptm.hub.repo"):
        load_run(run, device="cpu")
