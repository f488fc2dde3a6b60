"""Device handling that a CPU host can pin (issue 18); what needs CUDA is marked ``gpu`` elsewhere."""

import pytest
import torch
from typer.testing import CliRunner

from drlcli import distributed, learn_stage
from drlcli.cli import app
from drlcli.commands.export import export_run

runner = CliRunner()


@pytest.mark.parametrize(
    ("device", "available", "count", "message"),
    [
        ("cuda:1", True, 1, "device cuda:1 requested but this host has 1 GPU(s) (cuda:0 to cuda:0)"),
        ("cuda:0", False, 0, "device cuda:0 requested but CUDA is not available; use --device cpu"),
        ("cuda", False, 0, "device cuda requested but CUDA is not available; use --device cpu"),
    ],
)
def test_a_gpu_the_host_lacks_is_a_usage_error(run_dir, stage_folders, monkeypatch, device, available, count, message):
    """Exit 2 with one line, not an internal error from deep inside torch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    args = ["learn-stage", "--run", str(run_dir), "--data", str(stage_folders[0][0]), "--device", device]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_no_rng_fork_touches_cuda(run_dir, stage_folders, tmp_path, monkeypatch):
    """fork_rng without devices= initialises CUDA (and warns on multi-GPU hosts) on a CPU-only command."""
    real, calls = torch.random.fork_rng, []

    def checked(*args, **kwargs):
        calls.append(kwargs.get("devices", args[0] if args else None))
        assert calls[-1] is not None, "torch.random.fork_rng called without devices="
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.random, "fork_rng", checked)
    from drlcli.commands.init import init_run
    from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

    init_run(tmp_path / "r", ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS)
    opts = {"epochs": 1, "batch_size": 12, "skip_unread": False}  # the stage trained: training forks too
    learn_stage(tmp_path / "r", data_dir=stage_folders[0][0], train_overrides=opts, device="cpu")
    export_run(tmp_path / "r", tmp_path / "m.pt", fmt="torchscript")
    assert calls  # init (random PTM), the stage's adapters and training all fork


def test_process_group_is_bound_to_the_local_gpu(monkeypatch):
    """NCCL gets device_id=cuda:LOCAL_RANK (recent torch warns, and may hang a barrier, without it)."""
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.update(set_device=d))
    distributed.setup()
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 1) == seen["set_device"]
    seen.clear()
    distributed.setup(cpu=True)
    assert seen["backend"] == "gloo" and "device_id" not in seen and "set_device" not in seen


def test_scoring_state_is_built_once_per_device(stage_folders, tmp_path, monkeypatch):
    """The bank and score weights are made once and reused batch after batch (on a GPU each rebuild
    is a host-to-device copy and a sync); adding classes rebuilds them."""
    from drlcli.commands.init import init_run
    from drlcli.config import RunConfig
    from drlcli.heads.prototypes import score
    from drlcli.model import incremental as model_module
    from drlcli.run.load import load_run
    from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

    run = tmp_path / "r"
    paper = RunConfig.for_method("drl", preset="paper")  # prototype scoring: the state under test
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=paper)
    learn_stage(run, data_dir=stage_folders[0][0], train_overrides={"epochs": 1, "batch_size": 12}, device="cpu")
    model = load_run(run, device="cpu").model
    builds = []
    real = model_module.score_weights
    monkeypatch.setattr(model_module, "score_weights", lambda *a, **k: builds.append(1) or real(*a, **k))
    images = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = model.network(images)
        first = [model.scores(features) for _ in range(3)]
    assert len(builds) == 1 and all(torch.equal(first[0], s) for s in first)
    bank, weights = model.scoring_state(features.device, features.dtype)
    assert model.scoring_state(features.device, features.dtype)[0] is bank and len(builds) == 1
    cfg = model.score_cfg
    direct = score(
        features, model.prototype_bank(), model.class_stage, rule=cfg.rule, rho=cfg.rho, beta=cfg.beta, offset=1
    )
    assert torch.allclose(first[0], direct, atol=1e-6)
    model.add_classes(["extra"], 1, torch.randn(1, *model.real_prototypes.shape[1:]))
    assert model.scores(features).shape == (5, 4) and len(builds) == 2


def test_the_analytic_head_scores_features_from_any_device(learned_run):
    """drl's default head lives on the model's device; evaluate scores the CPU features embed_images
    gives. The features go to the head (on a GPU host: CPU features against a CUDA head failed).
    A second device is simulated with ``meta``: there the head's tensors hold no data."""
    from drlcli.run.load import load_run

    model = load_run(learned_run, device="cpu").model
    assert model.head is not None  # drl's default scoring: the ridge + class-covariance head
    rows = model.num_subspaces + model.layout_scored**2  # the subspaces, then the PTM's layout rows
    features = torch.randn(5, rows, model.network.width, generator=torch.Generator().manual_seed(0))
    on_cpu = model.scores(features)
    model.head.to("meta")
    elsewhere = model.scores(features)
    assert elsewhere.device.type == "meta" and elsewhere.shape == on_cpu.shape == (5, len(model.class_names))


def test_fitting_a_stage_reads_nothing_from_the_head_on_its_device(learned_run):
    """A stage's statistics are summed on the CPU from R as stage 1 stored it: the loaded head (on a
    GPU host, on CUDA) is never mixed with the CPU statistics. Same fit with the head on ``meta``."""
    from drlcli.heads import EarlierStages
    from drlcli.heads.ridge.fit import fit_stage
    from drlcli.run.load import load_run

    loaded = load_run(learned_run, device="cpu")
    model = loaded.model
    g = torch.Generator().manual_seed(0)
    features = torch.randn(12, model.num_subspaces + model.layout_scored**2, model.network.width, generator=g)
    labels = torch.arange(3).repeat_interleave(4)

    def fit():
        earlier = EarlierStages(
            head=loaded.model.head,
            tensors=loaded.stage_tensors,
            statistics=lambda: [loaded.run.stage_statistics(i, loaded.manifest) for i in loaded.run.stage_indices()],
        )
        return fit_stage(
            earlier,
            features,
            labels,
            image_labels=labels.tolist(),
            indices=None,
            num_classes=3,
            config=loaded.config,
            stage_index=3,
        )

    expected = fit()
    model.head.to("meta")
    got = fit()
    assert got.tensors.keys() == expected.tensors.keys()
    assert all(torch.equal(got.tensors[k], expected.tensors[k]) for k in expected.tensors)
    assert all(torch.equal(got.statistics[k], expected.statistics[k]) for k in expected.statistics)


def test_benchmark_timing_synchronizes_the_runs_gpu(stage_folders, monkeypatch):
    """With --device cuda:1 the timing waits on cuda:1, not on the current GPU (cuda:0). CUDA is faked:
    the batch stays on the CPU and synchronize records its device."""
    from types import SimpleNamespace

    from drlcli.benchmark import scoring

    data_config = {
        "input_size": [3, 32, 32],
        "interpolation": "bicubic",
        "mean": [0.5] * 3,
        "std": [0.5] * 3,
        "crop_pct": 0.875,
    }
    gpu, synced, calls = torch.device("cuda", 1), [], []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self if a and a[0] == gpu else real_to(self, *a, **k))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    model = SimpleNamespace(data_config=data_config, device=gpu, score_images=lambda x: calls.append(x.shape))
    seconds = scoring.timing(SimpleNamespace(model=model), stage_folders[0][1], 4)
    assert seconds >= 0 and len(calls) == 6 and synced == [gpu] * 6


def test_cost_measures_cuda_peak_memory_after_a_warm_up(monkeypatch):
    """benchmarks/cost.py: one warm-up call (cuBLAS workspaces, lazily built kernels), then the peak of
    a second call, on the benchmark's own GPU. CUDA's memory functions are faked and record."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cost.py"
    spec = importlib.util.spec_from_file_location("cost_under_test", path)
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    events, gpu = [], torch.device("cuda", 1)

    def record(name, value=0):
        def call(device=None):
            events.append((name, device))
            return value

        return call

    monkeypatch.setattr(
        cost, "cases_for", lambda arch, args, device, which=None: {which: lambda: events.append(("call", device))}
    )
    monkeypatch.setattr(torch.cuda, "synchronize", record("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", record("reset"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", record("allocated", 100))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", record("peak", 350))
    out = cost.measure_memory_case("vit", "drl_T10", SimpleNamespace(device="cuda:1", bf16=False))
    assert out == {"peak_bytes": 250, "saved_activation_bytes": 0}
    assert [name for name, _ in events] == ["call", "sync", "reset", "allocated", "call", "sync", "peak"]
    assert all(device == gpu for _, device in events)


def test_fp32_on_cuda_is_ieee_fp32():
    """torch runs CUDA's fp32 convolutions in TF32 by default (the ViT's patch embedding is one), which
    moves the ridge head's scores by about 1e-3 from the CPU's: drl's fp32 switches TF32 off for its
    passes and puts the switches back; on the CPU nothing is touched."""
    from drlcli.precision import _tf32_switches, autocast

    switches = _tf32_switches()
    before = [getattr(owner, name) for owner, name, _ in switches]
    with autocast(torch.device("cpu"), "fp32"):
        assert [getattr(owner, name) for owner, name, _ in switches] == before
    with autocast(torch.device("cuda", 1), "fp32"):
        assert [getattr(owner, name) for owner, name, _ in switches] == [value for _, _, value in switches]
        assert not torch.is_autocast_enabled("cuda")
    assert [getattr(owner, name) for owner, name, _ in switches] == before


class _Interrupt(Exception):
    pass


@pytest.mark.gpu
@pytest.mark.parametrize(("method", "preset"), [("drl", "paper"), ("ease", None)])
def test_learn_resume_eval_predict_on_cuda(stage_folders, tmp_path, method, preset):
    """The whole cycle on CUDA: learn two stages (the second interrupted and resumed), evaluate,
    predict; a CUDA checkpoint is refused on CPU; the run's scores on CUDA match CPU's. drl runs its
    paper preset: the default trains no stage (nothing it answers reads one), so it has no epoch to
    interrupt."""
    from drlcli import evaluate
    from drlcli.commands.init import init_run
    from drlcli.config import RunConfig
    from drlcli.errors import RunStateError
    from drlcli.precision import autocast
    from drlcli.run.load import load_run
    from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

    run, opts = tmp_path / "r", {"epochs": 2, "batch_size": 12}
    config = RunConfig.for_method(method, preset=preset)
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    learn_stage(
        run, data_dir=stage_folders[0][0], eval_data_dir=stage_folders[0][1], train_overrides=opts, device="cuda"
    )

    def stop(event):
        if event.phase == "train" and event.epoch == 2:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        learn_stage(run, data_dir=stage_folders[1][0], train_overrides=opts, device="cuda", progress=stop)
    with pytest.raises(RunStateError, match="on cuda.*on cpu.*--restart"):
        learn_stage(run, data_dir=stage_folders[1][0], train_overrides=opts, device="cpu")
    resumed = learn_stage(
        run, data_dir=stage_folders[1][0], eval_data_dir=stage_folders[1][1], train_overrides=opts, device="cuda"
    )
    assert resumed.resumed_from_epoch == 1
    result = evaluate(run, all_seen=True, device="cuda")
    assert result.num_stages == 2 and result.num_classes == 6
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with autocast(torch.device("cuda"), "fp32"):  # as drl runs fp32 on CUDA: IEEE, no TF32 convolution
            on_gpu = load_run(run, device="cuda").model.score_images(images.cuda()).cpu()
        on_cpu = load_run(run, device="cpu").model.score_images(images)
    assert (on_gpu - on_cpu).abs().max() <= 1e-3  # float summation order only
    predicted = runner.invoke(
        app, ["predict", str(stage_folders[0][1]), "--run", str(run), "--device", "cuda", "--json"]
    )
    assert predicted.exit_code == 0, predicted.output


def test_prototype_scoring_is_fp32_under_bf16_autocast(run_dir, stage_folders):
    """The cosine scoring runs in fp32 whatever autocast does to the network (CPU autocast here)."""
    from drlcli.run.load import load_run

    learn_stage(run_dir, data_dir=stage_folders[0][0], train_overrides={"epochs": 1, "batch_size": 12}, device="cpu")
    model = load_run(run_dir, device="cpu").model
    images = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = model.features(images)
        expected = model.scores(features)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model.scores(features.bfloat16())
    assert got.dtype == expected.dtype == torch.float32
    assert (got - model.scores(features.bfloat16().float())).abs().max() <= 1e-6  # bf16 only in the input
