import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from drlcli import learn_stage
from drlcli.commands.export import export_run, resolve_format
from drlcli.data.decode import load_rgb
from drlcli.data.images import scan_class_folders
from drlcli.data.loading import eval_transform
from drlcli.errors import DependencyError, IntegrityError, RunStateError, UsageError
from drlcli.model.incremental import embed_images
from drlcli.precision import autocast
from drlcli.run.load import load_run
from drlcli.serving.drlfile import load_export
from drlcli.serving.formats import load_model

HAS_ONNX = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime"))


@pytest.fixture
def learned(run_dir, stage_folders):
    for train, test in stage_folders[:2]:
        learn_stage(
            run_dir, data_dir=train, eval_data_dir=test, train_overrides={"epochs": 1, "batch_size": 12}, device="cpu"
        )
    return run_dir


def _predict(model, folder):
    feats, _ = embed_images(
        model.network,
        scan_class_folders(folder),
        model.data_config,
        batch_size=16,
        stages=model.stages_scored,
        layout=model.layout_scored,
    )
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


# ------------------------------------------------------------- TorchScript and ONNX graphs

needs_onnx = pytest.mark.skipif(not HAS_ONNX, reason="the export extra (onnx, onnxruntime) is missing")
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:FutureWarning")  # TorchScript, upstream
FORMATS = ["drl", "torchscript", "pt2", pytest.param("onnx", marks=needs_onnx)]
GRAPHS = ["torchscript", "pt2", pytest.param("onnx", marks=needs_onnx)]
SUFFIX = {"drl": "drl", "torchscript": "pt", "pt2": "pt2", "onnx": "onnx"}
CODE = ("torchscript", "pt2")  # loaded only with trust_code


@pytest.fixture(scope="module")
def method_runs(tmp_path_factory, stage_folders, learned_run):
    """A two-stage run of each method (ease: one ViT pass per stage)."""
    from drlcli.commands.init import init_run
    from drlcli.config import RunConfig
    from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

    runs = {"drl": learned_run}
    for method in ("ease", "simplecil", "ranpac"):
        run = tmp_path_factory.mktemp(f"graph-{method}") / "run"
        init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=RunConfig.for_method(method))
        for train, _ in stage_folders[:2]:
            learn_stage(run, data_dir=train, train_overrides={"epochs": 1, "batch_size": 12}, device="cpu")
        runs[method] = run
    return runs


@pytest.fixture(scope="module")
def exported(method_runs, tmp_path_factory):
    """export(method, fmt) -> (result, path), each exported once per module (ONNX takes seconds)."""
    out_dir, cache = tmp_path_factory.mktemp("exports"), {}

    def export(method: str, fmt: str):
        if (method, fmt) not in cache:
            path = out_dir / f"{method}.{SUFFIX[fmt]}"
            cache[method, fmt] = export_run(method_runs[method], path, fmt=fmt), path
        return cache[method, fmt]

    return export


@pytest.mark.parametrize("method", ["drl", "ease", "simplecil", "ranpac"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_scores_like_the_run(method_runs, exported, stage_folders, method, fmt):
    """Parity: same top-1 and scores within 1e-4 on generated images, for every method and format."""
    out, path = exported(method, fmt)
    assert (out.format, out.path, out.num_classes, out.num_stages) == (fmt, str(path), 6, 2)
    assert out.run_dir == str(method_runs[method]) and out.bytes == path.stat().st_size
    assert (out.check_max_abs_diff is None) == (fmt == "drl")
    model = load_model(path, trust_code=fmt in CODE)  # our own file: its code is ours
    run_model = load_run(method_runs[method], device="cpu").model
    assert model.class_names == run_model.class_names and model.data_config == run_model.data_config
    transform = eval_transform(run_model.data_config)  # what a server does before calling the graph
    images = torch.stack(
        [transform(load_rgb(p)) for folder in stage_folders[:2] for p in scan_class_folders(folder[1]).paths]
    )  # (24, 3, 32, 32): not the batch size the graph was traced with
    with torch.no_grad():
        (expected, known_expected), (got, known_got) = run_model.classify(images), model.classify(images)
    assert got.shape == expected.shape == (24, 6)
    assert (got - expected).abs().max() <= 1e-4
    with torch.no_grad():
        one = model.classify(images[:1])[0]  # batch 1: the batch axis is dynamic down to one image
    assert one.shape == (1, 6) and (one - expected[:1]).abs().max() <= 1e-4
    assert torch.equal(got.argmax(1), expected.argmax(1))
    # the calibrated "unknown" answer travels with every format and agrees with the run's
    assert known_got.shape == known_expected.shape == (24,)
    assert (known_got - known_expected).abs().max() <= 1e-4
    assert torch.equal(known_got < 0, known_expected < 0)


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
def test_torchscript_needs_only_torch(exported, method_runs):
    """The TorchScript file alone: torch.jit.load, the spec in _extra_files, images -> scores."""
    _, path = exported("drl", "torchscript")
    extra = {"drl.json": ""}
    module = torch.jit.load(str(path), _extra_files=extra)
    spec = json.loads(extra["drl.json"])
    _check_spec(spec, "torchscript", load_run(method_runs["drl"], device="cpu").model)
    scores, known = module(torch.zeros(5, 3, 32, 32))
    assert tuple(scores.shape) == (5, 6) and tuple(known.shape) == (5,)


def test_pt2_needs_only_torch(exported, method_runs):
    """The .pt2 file alone: torch.export.load, the spec in its extra files, images -> scores."""
    _, path = exported("drl", "pt2")
    extra = {"drl.json": ""}
    program = torch.export.load(str(path), extra_files=extra)
    spec = json.loads(extra["drl.json"])
    _check_spec(spec, "pt2", load_run(method_runs["drl"], device="cpu").model)
    scores, known = program.module()(torch.zeros(5, 3, 32, 32))
    assert tuple(scores.shape) == (5, 6) and tuple(known.shape) == (5,)
    with pytest.raises(UsageError, match="pt2 file, which runs its own code when loaded; pass --trust-code"):
        load_model(path)


@needs_onnx
def test_onnx_needs_only_onnxruntime(exported, method_runs):
    """The ONNX file alone: metadata_props hold the spec (JSON values), onnxruntime runs it."""
    import onnx
    import onnxruntime

    _, path = exported("drl", "onnx")
    spec = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    for key in ("class_names", "data_config", "ptm", "open_set"):
        spec[key] = json.loads(spec[key])
    _check_spec(spec, "onnx", load_run(method_runs["drl"], device="cpu").model)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    scores, known = session.run(["scores", "known"], {"images": np.zeros((5, 3, 32, 32), np.float32)})
    assert scores.shape == (5, 6) and known.shape == (5,)


def _check_spec(spec, fmt, run_model):
    version = "4" if fmt == "onnx" else "3"  # ONNX format 4: model_sha256 seals the whole model
    assert spec["format"] == f"drl-{fmt}" and spec["format_version"] == version and len(spec["spec_sha256"]) == 64
    assert spec["open_set"]["calibrated"] is True and spec["open_set"]["output"]["name"] == "known"
    assert spec["class_names"] == run_model.class_names
    assert spec["data_config"] == run_model.data_config
    assert set(spec["data_config"]) >= {"mean", "std", "input_size", "interpolation", "crop_pct"}
    assert spec["ptm"]["name"] == "vit_tiny_patch16_224" and len(spec["payload_sha256"]) == 64


def test_format_from_suffix_and_bad_formats(method_runs, tmp_path, run_dir):
    assert resolve_format(None, Path("m.onnx")) == "onnx" and resolve_format(None, Path("m.pt")) == "torchscript"
    assert resolve_format(None, Path("m.pt2")) == "pt2" and resolve_format("pt2", Path("m.PT2")) == "pt2"
    assert resolve_format(None, Path("m.bin")) == "drl" and resolve_format("drl", Path("m.bin")) == "drl"
    for fmt, name in (
        ("drl", "m.pt"),
        ("torchscript", "m.drl"),
        ("onnx", "m.pt"),
        ("pt2", "m.pt"),
        ("torchscript", "m.pt2"),
    ):  # loading goes by the name
        with pytest.raises(UsageError, match=f"names a .* file but --format is {fmt}; name it"):
            resolve_format(fmt, Path(name))
    with pytest.raises(UsageError, match="unknown export format 'tflite'; use one of drl, torchscript, pt2, onnx"):
        export_run(method_runs["drl"], tmp_path / "m", fmt="tflite")
    with pytest.raises(RunStateError, match="learned no stage"):
        export_run(run_dir, tmp_path / "e.pt", fmt="torchscript")
    assert not (tmp_path / "e.pt").exists()
    with pytest.raises(UsageError, match="not found"):
        load_model(tmp_path / "missing.pt")


def test_missing_onnx_extra_names_the_fix(method_runs, tmp_path, monkeypatch):
    for name in ("onnx", "onnxruntime"):  # as if the export extra were not installed
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(DependencyError, match=r"--format onnx needs .*; pip install 'drlcli\[export\]'") as info:
        export_run(method_runs["simplecil"], tmp_path / "m.onnx")
    assert info.value.exit_code == 2 and not list(tmp_path.iterdir())


@needs_onnx
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the fallback exporter is deprecated upstream
@pytest.mark.skipif(importlib.util.find_spec("onnxscript") is None, reason="onnxscript (export extra) is missing")
def test_onnx_uses_the_torch_export_based_exporter_and_falls_back(method_runs, tmp_path, monkeypatch):
    """dynamo=True first (the TorchScript-based exporter is deprecated upstream); the old one only when it fails."""
    from drlcli.serving import onnx as serving

    warned = []
    monkeypatch.setattr(serving.log, "warning", lambda message, *args: warned.append(message % args))
    real_old = serving._onnx_torchscript

    def unused(*args):
        raise AssertionError("the TorchScript-based exporter ran")

    monkeypatch.setattr(serving, "_onnx_torchscript", unused)
    assert export_run(method_runs["simplecil"], tmp_path / "new.onnx").check_max_abs_diff <= 1e-3 and not warned

    def failing(*args):
        raise RuntimeError("no dynamo today")

    monkeypatch.setattr(serving, "_onnx_torchscript", real_old)
    monkeypatch.setattr(serving, "_onnx_dynamo", failing)
    assert export_run(method_runs["simplecil"], tmp_path / "old.onnx").check_max_abs_diff <= 1e-3
    assert len(warned) == 1 and "no dynamo today" in warned[0] and "TorchScript-based" in warned[0]


@pytest.mark.parametrize("fmt", GRAPHS)
def test_damaged_graph_is_refused(exported, tmp_path, fmt):
    _, original = exported("simplecil", fmt)
    path = tmp_path / original.name
    data = bytearray(original.read_bytes())
    data[_weights_byte(original, fmt)] ^= 0xFF  # inside the weights
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="damaged|not a readable"):
        load_model(path, trust_code=True)
    path.write_bytes(b"\x08junk" if fmt == "onnx" else b"PK\x03\x04junk")
    with pytest.raises(IntegrityError, match="not a readable"):
        load_model(path, trust_code=True)


@pytest.mark.parametrize("fmt", GRAPHS)
def test_a_graph_that_disagrees_with_the_run_is_never_written(method_runs, tmp_path, monkeypatch, fmt):
    from drlcli.serving import formats as serving

    real_load = serving.load_graph

    def wrong_scores(path, **kwargs):  # as if the exporter had mistranslated the network
        loaded = real_load(path, **kwargs)
        return serving.GraphModel(
            loaded.format, loaded.spec, lambda images: tuple(t + 1.0 for t in loaded.run(images)), loaded.device
        )

    monkeypatch.setattr(serving, "load_graph", wrong_scores)
    with pytest.raises(IntegrityError, match="disagrees with the model by 1.00e\\+00"):
        export_run(method_runs["drl"], tmp_path / f"m.{SUFFIX[fmt]}", fmt=fmt)
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------- devices (issue 18)


def _graph_text(path) -> str:
    module = torch.jit.load(str(path))
    return str(module.inlined_graph) + module.code


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
@pytest.mark.parametrize("method", ["drl", "ease", "simplecil", "ranpac"])
def test_torchscript_graph_has_no_device_constant(exported, method):
    """A traced graph that names a device fails when loaded on another one (map_location moves only weights)."""
    _, path = exported(method, "torchscript")
    text = _graph_text(path)
    assert "aten::" in text  # the inlined graph, not an empty stub
    assert 'Constant[value="cpu"]' not in text and "Device = prim::Constant" not in text
    assert 'device="cpu"' not in text and "torch.device(" not in text


def test_fresh_graph_is_checked_on_every_device_type(method_runs, tmp_path, monkeypatch):
    """CPU always; CUDA too on a host that has it (faked here: the CUDA load is redirected to CPU)."""
    from drlcli.serving import formats as serving

    assert serving.check_devices("torchscript") == ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert serving.check_devices("torchscript") == ["cpu", "cuda"] and serving.check_devices("onnx") == ["cpu"]
    assert serving.check_devices("pt2") == ["cpu", "cuda"]
    real_load, seen = serving.load_graph, []

    def recording(path, *, device="cpu", **kwargs):
        seen.append(device)
        return real_load(path, device="cpu", **kwargs)

    monkeypatch.setattr(serving, "load_graph", recording)
    export_run(method_runs["drl"], tmp_path / "m.pt", fmt="torchscript")
    assert seen == ["cpu", "cuda"]


def test_pt2_moves_to_an_indexed_gpu(exported, monkeypatch):
    """A .pt2 loaded for "cuda" is moved to the current GPU by index: its metadata asserts then name
    the inputs' device exactly (some torch releases compare devices exactly: "cuda" != "cuda:0").
    The move is faked, as a torch.export.passes that nobody has imported yet (``import torch`` leaves
    it out: drl imports it itself). CUDA is not needed."""
    import sys
    import types

    _, path = exported("drl", "pt2")
    moved = []
    passes = types.ModuleType("torch.export.passes")
    passes.move_to_device_pass = lambda program, where: moved.append(where) or program
    monkeypatch.delattr(torch.export, "passes", raising=False)
    monkeypatch.setitem(sys.modules, "torch.export.passes", passes)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert load_model(path, device="cuda", trust_code=True).device == torch.device("cuda", 1)
    assert load_model(path, device="cuda:0", trust_code=True).device == torch.device("cuda", 0)
    assert load_model(path, device="cpu", trust_code=True).device == torch.device("cpu")
    assert moved == [torch.device("cuda", 1), torch.device("cuda", 0)]


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
@pytest.mark.parametrize("fmt", CODE)
def test_torchscript_export_runs_on_cuda(exported, method_runs, stage_folders, fmt):
    """The nightly path: a .pt (map_location cuda) or .pt2 (move_to_device_pass) exported anywhere,
    loaded on cuda, predicts like the run."""
    from typer.testing import CliRunner

    from drlcli.cli import app

    _, path = exported("drl", fmt)
    model = load_model(path, device="cuda", trust_code=True)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with autocast(torch.device("cuda"), "fp32"):  # as drl predicts in fp32 on CUDA: no TF32 convolution
            got = model.score_images(images.cuda()).float().cpu()
        expected = load_run(method_runs["drl"], device="cpu").model.score_images(images)
    assert (got - expected).abs().max() <= 1e-3
    folder = str(stage_folders[0][1])
    result = CliRunner().invoke(
        app, ["predict", folder, "--model", str(path), "--trust-code", "--device", "cuda", "--json"]
    )
    assert result.exit_code == 0, result.output


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["drl", "ease", "simplecil", "ranpac"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_runs_on_cuda_like_on_the_cpu(exported, fmt, method):
    """Each export of each method loaded for CUDA (ONNX: onnxruntime's CUDA provider when it has one)
    gives the CPU's scores and unknown answers (ease's graph runs timm's own attention, drl's the IPA
    body, ranpac's and drl's the ridge head)."""
    _, path = exported(method, fmt)
    images = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    on_cpu = load_model(path, device="cpu", trust_code=True)
    on_gpu = load_model(path, device="cuda", trust_code=True)
    with torch.no_grad():
        expected, known_expected = on_cpu.classify(images)
        with autocast(torch.device("cuda"), "fp32"):  # as drl predicts in fp32 on CUDA: no TF32 convolution
            got, known = on_gpu.classify(images.to(on_gpu.device))
    assert (got.float().cpu() - expected).abs().max() <= 1e-3
    # the unknown scores are 12 to 20 in size: they agree to 1e-3 plus 2e-4 of their size (the
    # TorchScript graphs' differed by up to 1.7e-3 on an H200, fp32 on both in different kernels)
    torch.testing.assert_close(known.float().cpu(), known_expected, atol=1e-3, rtol=2e-4)


def test_onnx_runs_on_the_best_provider_for_the_device(monkeypatch):
    from drlcli.serving import onnx as serving
    from drlcli.serving.onnx import onnx_providers

    warned = []
    monkeypatch.setattr(serving.log, "warning", lambda message, *args: warned.append(message % args))

    gpu_ort = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert onnx_providers("cpu", gpu_ort) == ["CPUExecutionProvider"]
    assert onnx_providers("cuda:1", gpu_ort) == [("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]
    assert onnx_providers("cuda", gpu_ort)[0] == ("CUDAExecutionProvider", {"device_id": 0})
    assert not warned
    assert onnx_providers("cuda", ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert len(warned) == 1 and "install onnxruntime-gpu" in warned[0]


def _weights_byte(path: Path, fmt: str) -> int:
    """The offset of a byte inside the file's largest tensor data (the PTM's weights): the middle
    of the file is not always there (an archive's program, stack traces and paths vary in length)."""
    if fmt == "onnx":
        return len(path.read_bytes()) // 2  # one protobuf: the initializers are most of the file
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda item: item.file_size)
    with open(path, "rb") as handle:  # the member's data follows its local header (stored, not deflated)
        handle.seek(info.header_offset + 26)
        name_length, extra_length = int.from_bytes(handle.read(2), "little"), int.from_bytes(handle.read(2), "little")
    return info.header_offset + 30 + name_length + extra_length + info.file_size // 2


def test_paper_ablations_learn_reload_and_export(stage_folders, tmp_path):
    """The paper recipe with a learned attention and the CosFace margin (issue 62's ablations): two
    stages learn, reload to the same scores, and the exported graph scores like the run."""
    from drlcli.commands.init import init_run
    from drlcli.config import RunConfig
    from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

    config = RunConfig.for_recipe("paper", {"ipa": {"attention": "learned"}, "train": {"loss": "cosface"}})
    run = tmp_path / "run"
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    for train, _ in stage_folders[:2]:
        learn_stage(run, data_dir=train, train_overrides={"epochs": 1, "batch_size": 12}, device="cpu")
    loaded = load_run(run, device="cpu")
    model = loaded.model
    assert (loaded.config.ipa.attention, loaded.config.train.loss) == ("learned", "cosface")
    assert [meta["train"]["loss"] for meta in loaded.stage_metas] == ["cosface", "cosface"]
    assert all(torch.count_nonzero(stage.attn_q) > 0 for stage in model.network.stages)
    test = stage_folders[1][1]
    out = export_run(run, tmp_path / "m.pt2", fmt="pt2")
    assert out.check_max_abs_diff is not None and out.check_max_abs_diff <= 1e-4
    assert torch.allclose(_predict(load_run(run, device="cpu").model, test), _predict(model, test), atol=1e-6)
