"""Hostile model files (docs/reliability.md, "Model files"): TorchScript runs only with --trust-code,
a file is loaded only as the format its name says, every byte of an export's metadata is checksummed
(one flipped byte is refused with exit 5 or changes nothing), a crafted but self-consistent spec is
refused with exit 5 (never exit 1), and PTM keyword arguments are limited to the ViT's shape."""

from __future__ import annotations

import importlib.util
import io
import json
import random
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from drlcli.cli import app
from drlcli.commands.export import export_run
from drlcli.commands.init import init_run
from drlcli.commands.predict import predict
from drlcli.errors import DrlError, IntegrityError, UsageError
from drlcli.run.layout import sha256_bytes
from drlcli.serving.formats import load_model
from drlcli.serving.graph import JSON_KEYS, MODEL_SHA256, SPEC_FILE
from drlcli.serving.modelfile import with_checksum
from drlcli.serving.onnx import seal_onnx
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

runner = CliRunner()
HAS_ONNX = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime"))
needs_onnx = pytest.mark.skipif(not HAS_ONNX, reason="the export extra (onnx, onnxruntime) is missing")
FORMATS = ["drl", "torchscript", "pt2", pytest.param("onnx", marks=needs_onnx)]
SUFFIX = {"drl": "drl", "torchscript": "pt", "pt2": "pt2", "onnx": "onnx"}
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit is deprecated upstream


@pytest.fixture(scope="module")
def learned(learned_run) -> Path:
    return learned_run


@pytest.fixture(scope="module")
def exports(learned, tmp_path_factory) -> Callable[[str], Path]:
    out_dir, cache = tmp_path_factory.mktemp("hostile-exports"), {}

    def export(fmt: str) -> Path:
        if fmt not in cache:
            cache[fmt] = out_dir / f"m.{SUFFIX[fmt]}"
            export_run(learned, cache[fmt])
        return cache[fmt]

    return export


@pytest.fixture(scope="module")
def images(stage_folders) -> list[Path]:
    return sorted(stage_folders[1][1].rglob("*.png"))[::2]  # 6 images of the second stage's classes


def _upstream_deprecation(line: str) -> bool:
    return line.startswith("warning: FutureWarning: `torch.jit.") and "is deprecated" in line


def _predict(model_path: Path, images: list[Path], *extra: str):
    # -q: predict's progress and log lines (load, model) stay off stderr, which holds the one error line
    return runner.invoke(app, ["predict", *map(str, images), "--model", str(model_path), "--json", "-q", *extra])


def _error(result) -> str:
    # one line, beside torch's own deprecation warnings for TorchScript (let through since issue 17)
    lines = [line for line in result.stderr.splitlines() if not _upstream_deprecation(line)]
    assert len(lines) == 1, result.stderr
    return json.loads(result.stdout)["error"]["message"]


# ----------------------------------------------------------------- code in TorchScript files


class Evil(torch.nn.Module):
    """A TorchScript module whose ``__setstate__`` (run by torch.jit.load) and ``forward`` write files."""

    def __init__(self, marker: str):
        super().__init__()
        self.marker = marker
        self.touched = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        written = torch.from_file(self.marker + ".forward", shared=True, size=4, dtype=torch.uint8)
        return x + written.fill_(65).sum() * 0

    @torch.jit.export
    def __getstate__(self) -> tuple[str, bool]:
        return (self.marker, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.marker, self.training = state[0], False
        written = torch.from_file(self.marker + ".load", shared=True, size=4, dtype=torch.uint8)
        self.touched = int(written.fill_(66).sum())


def _markers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.glob("pwned*"))


def test_torchscript_runs_only_with_trust_code(tmp_path, images):
    evil = tmp_path / "evil.pt"
    torch.jit.script(Evil(str(tmp_path / "pwned"))).save(str(evil))
    disguised = shutil.copy(evil, tmp_path / "evil.drl")

    refused = _predict(evil, images)
    assert refused.exit_code == 2 and "--trust-code" in _error(refused) and "runs its own code" in _error(refused)
    for extra in ([], ["--trust-code"]):  # a .drl name never loads TorchScript, trusted or not
        result = _predict(disguised, images, *extra)
        assert result.exit_code == 5 and "named as a drl file but holds torchscript content" in _error(result)
    with pytest.raises(UsageError, match="trust_code=True"):
        load_model(evil)
    assert _markers(tmp_path) == []  # nothing of the file ran

    trusted = _predict(evil, images, "--trust-code")  # what the flag means: the file's code runs
    assert trusted.exit_code == 5 and "not a drl export" in _error(trusted)
    assert _markers(tmp_path) == ["pwned.load"]


@pytest.mark.parametrize(
    ("fmt", "name"),
    [
        ("drl", "m.pt"),
        pytest.param("onnx", "m.drl", marks=needs_onnx),
        ("torchscript", "m.onnx"),
        pytest.param("onnx", "m.pt", marks=needs_onnx),
        ("pt2", "m.pt"),  # both zips: the archive's members tell them apart
        ("torchscript", "m.pt2"),
        ("pt2", "m.drl"),
        ("drl", "m.pt2"),
    ],
)
def test_content_that_is_not_what_the_name_says_is_refused(exports, images, tmp_path, fmt, name):
    renamed = shutil.copy(exports(fmt), tmp_path / name)
    result = _predict(renamed, images, "--trust-code")
    assert result.exit_code == 5 and f"holds {fmt} content; refused" in _error(result)


def test_pt2_runs_only_with_trust_code(exports, images, tmp_path):
    """torch.export.load unpickles (falling back to weights_only=False): like TorchScript, a .pt2 loads
    only with --trust-code, and never under another name."""
    pt2 = exports("pt2")
    refused = _predict(pt2, images)
    assert refused.exit_code == 2 and "--trust-code" in _error(refused) and "pt2 file" in _error(refused)
    with pytest.raises(UsageError, match="trust_code=True"):
        load_model(pt2)
    assert _predict(pt2, images, "--trust-code").exit_code == 0
    (tmp_path / "junk.pt2").write_bytes(b"PK\x03\x04" + bytes(200))
    result = _predict(tmp_path / "junk.pt2", images, "--trust-code")
    assert result.exit_code == 5 and "not a readable drl pt2 export" in _error(result)


def test_pt2_unpickling_runs_code_so_it_needs_trust(exports, images, tmp_path):
    """Why a .pt2 needs --trust-code: torch.export.load falls back to torch.load(weights_only=False)
    on members its safe unpickler refuses, so a crafted archive runs code while loading."""
    buffer = io.BytesIO()
    torch.save({"x": _Touch(tmp_path / "pwned.unpickled")}, buffer)
    evil = tmp_path / "evil.pt2"
    with zipfile.ZipFile(exports("pt2")) as source, zipfile.ZipFile(evil, "w") as out:
        for info in source.infolist():
            data = source.read(info.filename)
            out.writestr(info, buffer.getvalue() if info.filename.endswith("sample_inputs/model.pt") else data)
    refused = _predict(evil, images)
    assert refused.exit_code == 2 and "--trust-code" in _error(refused)
    assert _markers(tmp_path) == []  # nothing of the file ran
    trusted = _predict(evil, images, "--trust-code")  # what the flag means: the file's pickles run
    # torch logs its fallback to weights_only=False (with a trace) before drl's one-line error
    assert trusted.exit_code == 5 and "export it again" in trusted.stderr.splitlines()[-1]
    assert _markers(tmp_path) == ["pwned.unpickled"]


def test_any_other_name_is_read_as_drl(exports, images, tmp_path):
    renamed = shutil.copy(exports("drl"), tmp_path / "model.bin")
    assert _predict(renamed, images).exit_code == 0


@needs_onnx
def test_onnx_with_custom_operators_or_external_data_is_refused(exports, images, tmp_path):
    """ONNX loads without --trust-code (onnxruntime runs no Python), so only what drl writes is run:
    standard operators, weights inside the file."""
    import onnx
    from onnx import TensorProto

    proto = onnx.load(str(exports("onnx")))
    custom = onnx.ModelProto()
    custom.CopyFrom(proto)
    custom.opset_import.add(domain="com.example.native", version=1)
    (tmp_path / "custom.onnx").write_bytes(custom.SerializeToString())
    result = _predict(tmp_path / "custom.onnx", images)
    assert result.exit_code == 5 and "operator domains ['com.example.native']" in _error(result)
    tensor = proto.graph.initializer[0]
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="../../../etc/passwd")
    tensor.ClearField("raw_data")
    (tmp_path / "external.onnx").write_bytes(proto.SerializeToString())
    result = _predict(tmp_path / "external.onnx", images)
    assert result.exit_code == 5 and "refers to external weight files" in _error(result)


# ------------------------------------------------------------------------ metadata checksums


def _flip_class_name(path: Path, out: Path) -> Path:
    """'class_04' -> 'class_05' wherever the file records it: a silent relabel without a checksum."""
    data = bytearray(path.read_bytes())
    at = data.index(b"class_04")
    data[at + 7] ^= 0x01
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_flipped_class_name_is_refused(exports, images, tmp_path, fmt):
    original = exports(fmt)
    flipped = _flip_class_name(original, tmp_path / original.name)
    result = _predict(flipped, images, "--trust-code")
    assert result.exit_code == 5 and "metadata checksum mismatch" in _error(result)


def _read_spec(path: Path, fmt: str) -> dict[str, Any]:
    if fmt == "drl":
        with safe_open(str(path), framework="pt") as handle:
            return json.loads(handle.metadata()["spec"])
    if fmt == "torchscript":
        extra = {SPEC_FILE: ""}
        torch.jit.load(str(path), _extra_files=extra)
        return json.loads(extra[SPEC_FILE])
    if fmt == "pt2":
        extra = {SPEC_FILE: ""}
        torch.export.load(str(path), extra_files=extra)
        return json.loads(extra[SPEC_FILE])
    import onnx

    props = [p for p in onnx.load(str(path)).metadata_props if p.key != MODEL_SHA256]  # the seal, not the spec
    return {p.key: json.loads(p.value) if p.key in JSON_KEYS else p.value for p in props}


def _write_spec(path: Path, fmt: str, spec: Any, out: Path) -> Path:
    """``path`` with another spec (as a crafted file would have it), weights unchanged."""
    if fmt == "drl":
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
        save_file(load_file(str(path)), str(out), metadata={**metadata, "spec": json.dumps(spec)})
    elif fmt == "torchscript":
        torch.jit.save(torch.jit.load(str(path)), str(out), _extra_files={SPEC_FILE: json.dumps(spec)})
    elif fmt == "pt2":
        torch.export.save(torch.export.load(str(path)), str(out), extra_files={SPEC_FILE: json.dumps(spec)})
    else:
        import onnx

        proto = onnx.load(str(path))
        del proto.metadata_props[:]
        for key, value in spec.items():
            entry = proto.metadata_props.add()
            entry.key, entry.value = key, value if isinstance(value, str) else json.dumps(value)
        out.write_bytes(seal_onnx(proto))  # a crafter recomputes the model checksum too (drl's own function)
    return out


def _drop_a_class(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "class_names": spec["class_names"][:-1]}


@pytest.mark.parametrize("fmt", FORMATS)
def test_removed_class_name_is_refused_with_5_never_1(exports, images, tmp_path, fmt):
    original = exports(fmt)
    spec = _read_spec(original, fmt)
    damaged = _write_spec(original, fmt, _drop_a_class(spec), tmp_path / f"damaged.{SUFFIX[fmt]}")
    result = _predict(damaged, images, "--trust-code")
    assert result.exit_code == 5 and "metadata checksum mismatch" in _error(result)
    crafted = _write_spec(original, fmt, with_checksum(_drop_a_class(spec)), tmp_path / f"crafted.{SUFFIX[fmt]}")
    result = _predict(crafted, images, "--trust-code")  # checksum recomputed: the structure is checked too
    assert result.exit_code == 5 and "export it again" in _error(result)


@pytest.mark.parametrize("fmt", ["torchscript", "pt2", pytest.param("onnx", marks=needs_onnx)])
def test_crafted_graph_input_size_is_refused_with_5(exports, images, tmp_path, fmt):
    """A graph whose (checksummed) data_config asks for images it cannot take: exit 5, not 1."""
    original = exports(fmt)
    spec = _read_spec(original, fmt)
    spec["data_config"] = {**spec["data_config"], "input_size": [3, 48, 48]}
    crafted = _write_spec(original, fmt, with_checksum(spec), tmp_path / f"c.{SUFFIX[fmt]}")
    result = _predict(crafted, images, "--trust-code")
    assert result.exit_code == 5 and "graph cannot score (6, 3, 48, 48) images" in _error(result)


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda spec: {**spec, key: value}


def _without(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda spec: {k: v for k, v in spec.items() if k != key}


def _data_config(**changes: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda spec: {**spec, "data_config": {**spec["data_config"], **changes}}


CRAFTED = {
    "no class_names": (_without("class_names"), "'class_names' missing"),
    "class_names a string": (_set("class_names", "class_00"), "'class_names' missing or not a list"),
    "a class name not a string": (lambda s: {**s, "class_names": [1, *s["class_names"][1:]]}, "malformed class"),
    "a class name twice": (lambda s: {**s, "class_names": s["class_names"][:-1] + ["class_00"]}, "twice"),
    "no data_config": (_without("data_config"), "'data_config' missing"),
    "mean not numbers": (_data_config(mean="x"), "mean must be 3 numbers"),
    "std zero": (_data_config(std=[0, 0, 0]), "std must be > 0"),
    "input_size huge": (_data_config(input_size=[3, 10**6, 10**6]), "input_size"),
    "interpolation unknown": (_data_config(interpolation="evil"), "interpolation must be one of"),
    "config a list": (_set("config", []), "'config' missing or not a mapping"),
    "config unknown key": (lambda s: {**s, "config": {**s["config"], "x": 1}}, "invalid config"),
    "num_stages a string": (_set("num_stages", "2"), "'num_stages' missing or not an int"),
    "num_stages huge": (_set("num_stages", 10**9), "num_stages"),
    "ptm not a mapping": (_set("ptm", None), "'ptm' missing"),
    "ptm kwarg checkpoint_path": (
        lambda s: {**s, "ptm": {**s["ptm"], "kwargs": {**TINY_PTM_KWARGS, "checkpoint_path": "/x.pth"}}},
        "PTM keyword argument 'checkpoint_path'",
    ),
    "ptm kwarg of the wrong type": (
        lambda s: {**s, "ptm": {**s["ptm"], "kwargs": {**TINY_PTM_KWARGS, "depth": "4"}}},
        "depth='4'",
    ),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_drl_spec_is_refused_with_5(exports, images, tmp_path, case):
    """Self-consistent files (checksums recomputed) whose spec is structurally wrong: exit 5, one line."""
    edit, message = CRAFTED[case]
    original = exports("drl")
    crafted = _write_spec(original, "drl", with_checksum(edit(_read_spec(original, "drl"))), tmp_path / "c.drl")
    result = _predict(crafted, images)
    assert result.exit_code == 5, result.stderr
    assert message in _error(result)


def test_spec_that_is_not_an_object_and_old_formats_are_refused(exports, images, tmp_path):
    original = exports("drl")
    result = _predict(_write_spec(original, "drl", [1, 2], tmp_path / "list.drl"), images)
    assert result.exit_code == 5 and "not a JSON object" in _error(result)
    with safe_open(str(original), framework="pt") as handle:
        metadata = handle.metadata()
    old = tmp_path / "old.drl"
    save_file(load_file(str(original)), str(old), metadata={**metadata, "format_version": "1"})
    result = _predict(old, images)
    assert result.exit_code == 5 and "from an older drl" in _error(result) and "export it again" in _error(result)
    for version, code in (("2", 0), ("4", 5)):  # format 2 (a float32 covariance factor) loads; a newer one is refused
        path = tmp_path / f"v{version}.drl"
        save_file(load_file(str(original)), str(path), metadata={**metadata, "format_version": version})
        result = _predict(path, images)
        assert result.exit_code == code, result.stderr
    assert "this drl reads 3; use the drl release that wrote it" in _error(result)


def _answers(model_path: Path, images: list[Path]) -> list[dict[str, Any]]:
    return [p.to_dict() for p in predict(load_model(model_path), images, top_k=3)]


def test_every_flipped_header_byte_is_refused_or_changes_nothing(exports, images, tmp_path):
    """A deterministic sample of ~200 one-byte changes over a .drl file's header (length prefix, tensor
    index, metadata, all of the class names): each is refused with exit 5 or predicts exactly the same."""
    original = exports("drl")
    data = original.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    names = data.index(b"class_names")
    names_end = data.index(b"]", names)
    rng = random.Random(0)
    positions = sorted(
        set(range(8))
        | set(range(names, names_end))
        | set(rng.sample(range(8, header_end), 200 - (names_end - names) - 8))
    )
    baseline = _answers(original, images)
    flipped, outcomes = tmp_path / "f.drl", {"refused": 0, "same": 0}
    for i, at in enumerate(positions):
        changed = bytearray(data)
        changed[at] ^= (0x01, 0x20, 0x80, 0xFF)[i % 4]
        flipped.write_bytes(bytes(changed))
        try:
            answers = _answers(flipped, images)
        except DrlError as exc:
            assert exc.exit_code == 5, f"byte {at}: {exc}"
            outcomes["refused"] += 1
            continue
        assert answers == baseline, f"byte {at} changed the answers"
        outcomes["same"] += 1
    assert outcomes["refused"] >= len(positions) * 0.9, outcomes


# ------------------------------------------------------------------------ PTM keyword arguments


class _Touch:
    """Unpickling it creates a file: what a pickled checkpoint can do when code is unpickled."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def pickle_bomb(tmp_path) -> Path:
    bomb = tmp_path / "bomb.pth"
    torch.save({"model": _Touch(tmp_path / "pwned.unpickled")}, bomb)
    torch.load(bomb, weights_only=False)  # proof that it is one; then forget it went off
    (tmp_path / "pwned.unpickled").unlink()
    return bomb


def test_ptm_kwargs_from_the_cli_are_limited_to_the_vit_shape(tmp_path, pickle_bomb):
    run = tmp_path / "run"
    base = ["init", "--ptm", TINY_PTM, "--random-init", "--run", str(run), "--json"]
    for arg, message in (
        (f"checkpoint_path={pickle_bomb}", "PTM keyword argument 'checkpoint_path' from --ptm-arg"),
        ("pretrained_cfg_overlay={file: /etc/passwd}", "'pretrained_cfg_overlay'"),
        ("img_size=32.5", "img_size=32.5 from --ptm-arg (ptm_kwargs) must be an int in [8, 4096]"),
        ("qkv_bias=1", "must be true or false"),
        ("depth=100000", "depth=100000"),
    ):
        result = runner.invoke(app, [*base, "--ptm-arg", arg])
        assert result.exit_code == 2 and message in _error(result), result.stdout
    assert not run.exists() and _markers(tmp_path) == []
    with pytest.raises(UsageError, match="'checkpoint_path'"):
        init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs={"checkpoint_path": str(pickle_bomb)})


def test_ptm_kwargs_from_run_yaml_are_refused_with_5(learned, images, tmp_path, pickle_bomb):
    """A crafted run (run.yaml and its manifest entry consistent) cannot make timm load a file."""
    run = Path(shutil.copytree(learned, tmp_path / "run"))
    record = yaml.safe_load((run / "run.yaml").read_text())
    record["ptm"]["kwargs"]["checkpoint_path"] = str(pickle_bomb)
    data = yaml.safe_dump(record).encode()
    (run / "run.yaml").write_bytes(data)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["files"]["run.yaml"] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (run / "manifest.json").write_text(json.dumps(manifest))
    for command in (["predict", *map(str, images)], ["export", "--out", str(tmp_path / "m.drl")]):
        result = runner.invoke(app, [*command, "--run", str(run), "--json", "-q"])
        assert result.exit_code == 5 and "PTM keyword argument 'checkpoint_path' from run" in _error(result)
    assert _markers(tmp_path) == [] and not (tmp_path / "m.drl").exists()


def test_ptm_kwargs_from_an_export_are_refused_with_5(exports, images, tmp_path, pickle_bomb):
    original = exports("drl")
    spec = _read_spec(original, "drl")
    spec["ptm"]["kwargs"]["checkpoint_path"] = str(pickle_bomb)
    crafted = _write_spec(original, "drl", with_checksum(spec), tmp_path / "c.drl")
    result = _predict(crafted, images)
    assert result.exit_code == 5 and "PTM keyword argument 'checkpoint_path'" in _error(result)
    assert _markers(tmp_path) == []
    with pytest.raises(IntegrityError, match="'checkpoint_path'"):
        load_model(crafted)
