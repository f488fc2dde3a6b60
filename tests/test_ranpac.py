"""The RanPAC baseline: exact incremental ridge, λ from statistics, storage, and the run/export round trip."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import rewrite_stage_weights
from PIL import Image
from typer.testing import CliRunner

from drlcli import evaluate, learn_stage
from drlcli.api import info, verify
from drlcli.cli import app
from drlcli.commands.export import export_run
from drlcli.commands.init import init_run
from drlcli.commands.predict import expand_sources, predict
from drlcli.config import RunConfig
from drlcli.data.images import scan_class_folders
from drlcli.data.loading import eval_transform
from drlcli.errors import UsageError
from drlcli.heads.ridge import LAYOUT
from drlcli.heads.ridge.head import RidgeHead, expand, random_projection
from drlcli.heads.ridge.statistics import (
    Statistics,
    choose_lambda,
    kernel_errors,
    local_search,
    pack,
    ridge_error,
    sampled,
    solve,
    unpack,
    validation_errors,
    validation_mask,
)
from drlcli.model.incremental import embed_images
from drlcli.run.load import load_run
from drlcli.serving.drlfile import load_export
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

PROJ = {"ridge": {"proj_dim": 96}}
LAMBDAS = [10.0**e for e in range(-8, 9)]


def _ranpac_run(tmp_path, stage_folders, num_stages=3):
    run = tmp_path / "run"
    init_run(
        run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=RunConfig.for_method("ranpac", PROJ)
    )
    results = [
        learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu") for train, test in stage_folders[:num_stages]
    ]
    return run, results


def _stats(phi, labels, num_classes, val):
    return Statistics.of(phi, labels, num_classes, val)


def test_incremental_statistics_give_the_batch_ridge():
    g = torch.Generator().manual_seed(0)
    phi = torch.rand(90, 20, generator=g, dtype=torch.float64)
    labels = torch.arange(9).repeat_interleave(10)  # 3 stages of 3 classes
    val = validation_mask(labels, fraction=0.2, seed=0)
    parts = [
        _stats(phi[k * 30 : (k + 1) * 30], labels[k * 30 : (k + 1) * 30] - 3 * k, 3, val[k * 30 : (k + 1) * 30])
        for k in range(3)
    ]
    total = Statistics.accumulate(parts)
    batch = _stats(phi, labels, 9, val)
    for name in ("gram_fit", "gram_val", "q_fit", "q_val"):
        assert torch.allclose(getattr(total, name), getattr(batch, name), atol=1e-12)
    lam = 0.1
    y = F.one_hot(labels, 9).double()
    direct = torch.linalg.solve(phi.T @ phi + lam * torch.eye(20, dtype=torch.float64), phi.T @ y)
    assert torch.allclose(solve(total, lam), direct, atol=1e-10)
    assert (total.num_fit, total.num_val) == (72, 18)


def test_statistics_survive_storage():
    g = torch.Generator().manual_seed(1)
    phi = torch.rand(40, 12, generator=g, dtype=torch.float64)
    labels = torch.arange(4).repeat_interleave(10)
    stats = _stats(phi, labels, 4, validation_mask(labels, fraction=0.2, seed=1))
    back = Statistics.from_tensors(stats.to_tensors())
    assert torch.allclose(back.gram_fit, stats.gram_fit, rtol=1e-6) and torch.equal(back.gram_fit, back.gram_fit.T)
    assert pack(stats.gram_val).shape == (12 * 13 // 2,)
    assert torch.allclose(unpack(pack(stats.gram_val), 12), stats.gram_val, rtol=1e-6)


@pytest.mark.parametrize("width", [8, 64])  # many classes for M (A Aᵀ formed once), few (W_λ per λ)
def test_validation_errors_equal_the_direct_squared_error(width):
    g = torch.Generator().manual_seed(2)
    phi = torch.rand(60, width, generator=g, dtype=torch.float64)
    labels = torch.arange(3).repeat_interleave(20)
    val = validation_mask(labels, fraction=0.2, seed=0)
    assert int(val.sum()) == 12 and all(int(val[labels == c].sum()) == 4 for c in range(3))
    stats = _stats(phi, labels, 3, val)
    y = F.one_hot(labels, 3).double()
    eye = torch.eye(width, dtype=torch.float64)
    for lam, err in zip([1e-3, 1.0, 1e3], validation_errors(stats, [1e-3, 1.0, 1e3])):
        w = torch.linalg.solve(phi[~val].T @ phi[~val] + lam * eye, phi[~val].T @ y[~val])
        assert err == pytest.approx(float(((phi[val] @ w - y[val]) ** 2).sum()), rel=1e-8)


def test_moving_the_earlier_columns_equals_solving_them_again():
    """A stage of 6 images after one of 12 classes: W of the earlier classes moved by the new images
    (``solve(previous=, phi=)``) is the whole solve's, new classes included."""
    g = torch.Generator().manual_seed(7)
    phi = torch.rand(66, 40, generator=g, dtype=torch.float64)
    labels = torch.cat([torch.arange(12).repeat_interleave(5), 12 + torch.arange(3).repeat_interleave(2)])
    val = validation_mask(labels, fraction=0.2, seed=0)
    before = _stats(phi[:60], labels[:60], 12, val[:60])
    total = Statistics.accumulate([before, _stats(phi[60:], labels[60:] - 12, 3, val[60:])])
    lam = 0.5
    previous = solve(before, lam).float()  # as the run stores it
    moved = solve(total, lam, previous=previous, phi=phi[60:])
    whole = solve(total, lam)
    assert moved.shape == whole.shape == (40, 15)
    assert torch.allclose(moved, whole, rtol=1e-5, atol=1e-6 * float(whole.abs().max()))
    assert not torch.equal(previous.double(), whole[:, :12])  # the new images did move them


def test_lambda_from_a_sample_of_the_classes():
    """``sampled``: no more than k columns of Q, scaled so that the error estimates every class's;
    the statistics themselves at k >= C or k 0; the same λ as every class on a clear problem."""
    g = torch.Generator().manual_seed(8)
    centres = torch.randn(40, 30, generator=g, dtype=torch.float64)
    labels = torch.arange(40).repeat_interleave(8)
    phi = centres[labels] + 0.8 * torch.randn(320, 30, generator=g, dtype=torch.float64)
    stats = _stats(phi, labels, 40, validation_mask(labels, fraction=0.2, seed=0))
    assert sampled(stats, 40, seed=0) is stats and sampled(stats, 0, seed=0) is stats
    part = sampled(stats, 10, seed=3)
    assert part.q_fit.shape == (30, 10) and part.gram_fit is stats.gram_fit
    match = [[torch.equal(part.q_fit[:, k], 2 * stats.q_fit[:, c]) for c in range(40)] for k in range(10)]  # √(40/10)
    assert all(sum(row) == 1 for row in match) and len({row.index(True) for row in match}) == 10  # 10 distinct
    assert torch.equal(sampled(stats, 10, seed=3).q_fit, part.q_fit)  # seeded
    estimates = torch.tensor(
        [[ridge_error(sampled(stats, 10, seed=s), lam) for lam in LAMBDAS[6:12]] for s in range(40)]
    )
    exact = torch.tensor([ridge_error(stats, lam) for lam in LAMBDAS[6:12]])
    assert torch.allclose(estimates.mean(0), exact, rtol=0.1)  # unbiased over the draws
    assert choose_lambda(sampled(stats, 10, seed=3), LAMBDAS)[0] == choose_lambda(stats, LAMBDAS)[0]


def test_the_kernel_form_and_the_cholesky_error_equal_the_eigendecomposition():
    """Stage 1's errors from its images (n_f x n_f) and one λ's by Cholesky: the (M, M) form's."""
    g = torch.Generator().manual_seed(4)
    phi = torch.rand(40, 64, generator=g, dtype=torch.float64)  # fewer fitted images than M
    labels = torch.arange(4).repeat_interleave(10)
    val = validation_mask(labels, fraction=0.2, seed=0)
    stats = _stats(phi, labels, 4, val)
    lambdas = [1e-2, 1.0, 1e2, 1e4]
    assert kernel_errors(phi, labels, 4, val, lambdas) == pytest.approx(validation_errors(stats, lambdas), rel=1e-7)
    assert [ridge_error(stats, lam) for lam in lambdas] == pytest.approx(validation_errors(stats, lambdas), rel=1e-7)


def test_the_local_search_finds_the_grids_lambda_with_fewer_factorisations():
    g = torch.Generator().manual_seed(5)
    centres = torch.randn(4, 30, generator=g, dtype=torch.float64)
    labels = torch.arange(4).repeat_interleave(40)
    phi = centres[labels] + 0.8 * torch.randn(160, 30, generator=g, dtype=torch.float64)
    stats = _stats(phi, labels, 4, validation_mask(labels, fraction=0.2, seed=0))
    grid, all_errors = choose_lambda(stats, LAMBDAS)
    best = LAMBDAS.index(grid)
    for start in {0, best, len(LAMBDAS) - 1, min(best + 2, len(LAMBDAS) - 1)}:
        lam, tried = choose_lambda(stats, LAMBDAS, start=LAMBDAS[start])
        assert lam == grid and LAMBDAS[start] in tried
        assert all(tried[x] == pytest.approx(all_errors[x], rel=1e-7) for x in tried)
    assert len(choose_lambda(stats, LAMBDAS, start=grid)[1]) == 3  # from the grid's λ: it and both neighbours
    assert best > 0 and list(local_search(stats, LAMBDAS, 0)) == LAMBDAS[: best + 2]  # steps while the error falls
    off, tried = choose_lambda(stats, LAMBDAS, start=float("nan"))  # a start off the grid: every λ
    assert off == grid and len(tried) == len(LAMBDAS)


def test_the_local_search_steps_up_past_lambdas_that_do_not_factorise():
    """Grams summed in float32 may be slightly indefinite: G + λI fails Cholesky for the smallest λ."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(6)
    phi = torch.rand(30, 40, generator=g, dtype=torch.float64)  # G_f of rank < 40
    labels = torch.arange(3).repeat_interleave(10)
    stats = _stats(phi, labels, 3, validation_mask(labels, fraction=0.2, seed=0))
    stats = replace(stats, gram_fit=stats.gram_fit - 0.5 * torch.eye(40, dtype=torch.float64))
    assert ridge_error(stats, 1e-8) == float("inf")
    lam, tried = choose_lambda(stats, LAMBDAS, start=1e-8)
    assert lam >= 1 and tried[lam] < float("inf") and tried[1e-8] == float("inf")


def test_lambda_follows_the_signal():
    """A clean linear problem with many images picks a small λ; labels unrelated to φ a large one."""
    g = torch.Generator().manual_seed(3)
    centres = torch.randn(4, 30, generator=g, dtype=torch.float64) * 3
    labels = torch.arange(4).repeat_interleave(100)
    phi = centres[labels] + 0.1 * torch.randn(400, 30, generator=g, dtype=torch.float64)
    val = validation_mask(labels, fraction=0.2, seed=0)
    clean, errors = choose_lambda(_stats(phi, labels, 4, val), LAMBDAS)
    assert clean <= 1.0 and len(errors) == len(LAMBDAS)
    noise = 5 + torch.randn(400, 30, generator=g, dtype=torch.float64)  # φ carries no class information
    shuffled = labels[torch.randperm(400, generator=g)]
    noisy, _ = choose_lambda(_stats(noise, shuffled, 4, validation_mask(shuffled, fraction=0.2, seed=0)), LAMBDAS)
    assert noisy >= 1e2


def test_run_round_trip_equals_the_batch_ridge_and_keeps_old_stages(tmp_path, stage_folders):
    run, results = _ranpac_run(tmp_path, stage_folders, num_stages=2)
    before = {p.name: p.read_bytes() for p in (run / "stages" / "001").iterdir()}
    third = learn_stage(run, data_dir=stage_folders[2][0], eval_data_dir=stage_folders[2][1], device="cpu")
    assert {p.name: p.read_bytes() for p in (run / "stages" / "001").iterdir()} == before
    assert sorted(before) == ["stage.json", "statistics.safetensors", "weights.safetensors"]
    assert [r.num_params for r in [*results, third]] == [96 * 3, 96 * 6, 96 * 9]
    assert third.train_seconds > 0 and third.eval.top1 > 60  # separable generated classes
    loaded = load_run(run, device="cpu")
    meta = loaded.stage_metas[-1]["ridge"]
    assert meta["num_fit"] + meta["num_val"] == 108 and meta["num_val"] == 18  # 12 images x 9 classes, 2 held out
    # the stored head equals the ridge on all three stages' images at once (same λ, same R)
    model = loaded.model
    feats, labels = [], []
    for k, (train, _) in enumerate(stage_folders[:3]):
        f, y = embed_images(model.network, scan_class_folders(train), model.data_config, batch_size=64)
        feats.append(f[:, 0])
        labels.append(y + 3 * k)
    phi = expand(torch.cat(feats), model.head.projection.double())
    y = F.one_hot(torch.cat(labels), 9).double()
    eye = torch.eye(96, dtype=torch.float64)
    direct = torch.linalg.solve(phi.T @ phi + meta["lambda"] * eye, phi.T @ y)
    assert torch.allclose(model.head.weight.double(), direct, rtol=1e-3, atol=1e-4 * float(direct.abs().max()))
    # eval, .drl, TorchScript and predict agree
    assert evaluate(run, all_seen=True, device="cpu").report.top1 == third.eval.top1
    export_run(run, tmp_path / "m.drl")
    exported = load_export(tmp_path / "m.drl")
    assert isinstance(exported.head, RidgeHead)
    images = scan_class_folders(stage_folders[2][1])
    x = torch.stack([eval_transform(model.data_config)(Image.open(p).convert("RGB")) for p in images.paths[:5]])
    with torch.no_grad():
        want = model.score_images(x)
        assert torch.allclose(exported.score_images(x), want, atol=1e-5)
    graph = export_run(run, tmp_path / "m.pt", fmt="torchscript")
    assert graph.check_max_abs_diff <= 1e-3
    paths = expand_sources([str(stage_folders[2][1])])
    from_run = [p.top[0]["class"] for p in predict(model, paths)]
    assert from_run == [p.top[0]["class"] for p in predict(exported, paths)]
    summary = info(run)
    assert summary["method"] == "ranpac" and summary["stages"][0]["bytes"] > summary["stages"][1]["bytes"] - 96 * 3 * 4
    assert verify(run).num_stages == 3


def test_cli_init_method_ranpac(tmp_path, stage_folders):
    runner = CliRunner()
    run = tmp_path / "run"
    args = ["--ptm", TINY_PTM] + [a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")]
    config = tmp_path / "ranpac.yaml"
    config.write_text("ridge:\n  proj_dim: 64\n")
    init = ["init", "--run", str(run), *args, "--random-init", "--method", "ranpac", "--config", str(config)]
    assert runner.invoke(app, init).exit_code == 0
    result = runner.invoke(
        app, ["learn-stage", "--run", str(run), "--data", str(stage_folders[0][0]), "--device", "cpu", "--json"]
    )
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["num_params"] == 64 * 3 and out["stage_bytes"] > 2 * 4 * 64 * 65 // 2  # two packed Grams
    assert json.loads(runner.invoke(app, ["info", "--run", str(run), "--json"]).stdout)["method"] == "ranpac"


def test_ranpac_config_is_validated():
    with pytest.raises(UsageError, match="ridge"):
        RunConfig.for_method("ranpac", {"ridge": {"val_fraction": 1.0}})
    with pytest.raises(UsageError, match="ridge"):
        RunConfig.for_method("ranpac", {"ridge": {"proj_dim": 0}})


@pytest.mark.parametrize("subspaces", [1, 2])
def test_drl_scored_by_the_ridge_head(tmp_path, stage_folders, subspaces):
    """drl with score.head ridge: the head reads [f_0] or [f_0, f_1] (stage 1's adapted subspace),
    is refitted every stage from statistics, and every export format scores like the run."""
    run = tmp_path / "run"
    config = RunConfig.for_method(
        "drl",
        {
            "score": {"head": "ridge"},
            "ridge": {"proj_dim": 64, "subspaces": subspaces},
            "train": {"epochs": 2, "batch_size": 12},
        },
        preset="frozen",
    )
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    learn_stage(run, data_dir=stage_folders[0][0], device="cpu")
    first = (run / "stages" / "001" / "weights.safetensors").read_bytes()
    result = learn_stage(run, data_dir=stage_folders[1][0], eval_data_dir=stage_folders[1][1], device="cpu")
    assert (run / "stages" / "001" / "weights.safetensors").read_bytes() == first
    loaded = load_run(run, device="cpu")
    model = loaded.model
    assert isinstance(model.head, RidgeHead)
    assert model.head.projection.shape == ((subspaces + 4) * model.network.width, 64)  # + drl's 2 x 2 layout
    assert model.head.weight.shape == (64, 6)
    assert "lambda" in loaded.stage_metas[-1]["ridge"] and result.eval.top1 > 50
    images = scan_class_folders(stage_folders[1][1])
    x = torch.stack([eval_transform(model.data_config)(Image.open(p).convert("RGB")) for p in images.paths[:4]])
    with torch.no_grad():
        want = model.score_images(x)
        # inference computes the subspaces the head reads, no more; their scores are the full pass's
        assert model.stages_scored == subspaces - 1 and model.features(x).shape[1] == subspaces + 4
        assert model.features(x, open_set=True).shape[1] == subspaces + 5  # and the "unknown" answer's probe row
        assert torch.allclose(want, model.scores(model.network(x, layout=2)), atol=1e-5)
        export_run(run, tmp_path / "m.drl")
        assert torch.allclose(load_export(tmp_path / "m.drl").score_images(x), want, atol=1e-5)
    assert export_run(run, tmp_path / "m.pt", fmt="torchscript").check_max_abs_diff <= 1e-3


def test_ridge_head_options_are_checked():
    with pytest.raises(UsageError, match="score.head ridge"):
        RunConfig.for_method("ease", {"score": {"head": "ridge"}})
    with pytest.raises(UsageError, match="ridge.subspaces must be 1 for method ranpac"):
        RunConfig.for_method("ranpac", {"ridge": {"subspaces": 2}})
    with pytest.raises(UsageError, match="ridge.subspaces"):
        RunConfig.for_method("drl", {"score": {"head": "ridge"}, "ridge": {"subspaces": 3}})


def test_cli_init_preset_paper_scores_with_prototypes(tmp_path, stage_folders):
    runner = CliRunner()
    args = ["--ptm", TINY_PTM, "--random-init"] + [
        a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")
    ]
    for name, extra in (("default", []), ("frozen", ["--preset", "frozen"]), ("paper", ["--preset", "paper"])):
        run = tmp_path / name
        assert runner.invoke(app, ["init", "--run", str(run), *args, *extra]).exit_code == 0
        learn = ["learn-stage", "--run", str(run), "--data", str(stage_folders[0][0]), "--device", "cpu"]
        assert runner.invoke(app, [*learn, "--epochs", "1", "--batch-size", "12"]).exit_code == 0
        model = load_run(run, device="cpu").model
        assert (model.head is None) == (name == "paper")
        assert (run / "stages" / "001" / "statistics.safetensors").exists() == (name == "frozen")
        # the switched default's frozen track: beside the run's files (format 5), no frozen/ folder
        assert (run / "stages" / "001" / "frozen-stage.json").exists() == (name == "default")
        assert not (run / "frozen").exists()
    bad = runner.invoke(app, ["init", "--run", str(tmp_path / "x"), *args, "--preset", "fast"])
    assert bad.exit_code == 2 and "no preset 'fast'" in bad.stderr


COV = {"ridge": {"proj_dim": 64, "covariance_weight": 2.0}}


@pytest.fixture(scope="module")
def covariance_run(tmp_path_factory, stage_folders):
    """ranpac with class covariances (drl's default head, on an untrained network): 2 stages."""
    run = tmp_path_factory.mktemp("cov") / "run"
    config = RunConfig.for_method("ranpac", COV)
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    learn_stage(run, data_dir=stage_folders[0][0], device="cpu")
    first = (run / "stages" / "001" / "weights.safetensors").read_bytes()
    learn_stage(run, data_dir=stage_folders[1][0], device="cpu")
    assert (run / "stages" / "001" / "weights.safetensors").read_bytes() == first  # old stages unchanged
    return run


def _z(s):
    s = s - s.mean(1, keepdim=True)
    return s / s.pow(2).mean(1, keepdim=True).sqrt()


def test_class_covariance_head_equals_the_batch_computation(covariance_run, stage_folders, tmp_path):
    """z(ridge) + w z(−Mahalanobis): class means and covariances, and the covariance pooled over
    both stages' classes, computed from every training image at once (float64)."""
    model = load_run(covariance_run, device="cpu").model
    head = model.head
    feats, labels = [], []
    for k, (train, _) in enumerate(stage_folders[:2]):
        f, y = embed_images(model.network, scan_class_folders(train), model.data_config, batch_size=64)
        feats.append(f[:, 0].double())
        labels.append(y + 3 * k)
    x, y = F.normalize(torch.cat(feats), dim=-1), torch.cat(labels)
    means = torch.stack([x[y == c].mean(0) for c in range(6)])
    scatters = torch.stack([(x[y == c] - means[c]).T @ (x[y == c] - means[c]) for c in range(6)])
    counts = torch.bincount(y).double()
    pooled = scatters.sum(0) / (len(y) - 6)
    d = x.shape[1]
    precisions = []
    for c in range(6):
        cov = 0.2 * scatters[c] / (counts[c] - 1) + 0.8 * pooled
        cov = 0.7 * cov + 0.3 * torch.trace(cov) / d * torch.eye(d, dtype=torch.float64)
        precisions.append(torch.linalg.inv(cov))
    assert torch.allclose(head.cov_mean.double(), means, atol=1e-5)
    want = torch.stack(precisions)  # stored in float32: compare at its resolution times the conditioning
    assert torch.allclose(head.cov_precision.double(), want, rtol=1e-3, atol=1e-4 * float(want.abs().max()))
    images = scan_class_folders(stage_folders[1][1])
    batch = torch.stack([eval_transform(model.data_config)(Image.open(p).convert("RGB")) for p in images.paths[:6]])
    with torch.no_grad():
        features = model.network(batch)
        got = model.scores(features)
    q = F.normalize(features[:, 0].double(), dim=-1)
    distance = torch.stack([((q - means[c]) @ precisions[c] * (q - means[c])).sum(1) for c in range(6)], 1)
    ridge = expand(features[:, 0], head.projection.double()) @ head.weight.double()
    assert torch.allclose(got.double(), _z(ridge) - 2.0 * _z(distance), atol=1e-3)
    # every export scores like the run
    export_run(covariance_run, tmp_path / "m.drl")
    with torch.no_grad():
        assert torch.allclose(load_export(tmp_path / "m.drl").score_images(batch), model.score_images(batch), atol=1e-5)
    assert export_run(covariance_run, tmp_path / "m.pt", fmt="torchscript").check_max_abs_diff <= 1e-3


def test_class_covariance_width_must_be_the_networks(covariance_run, stage_folders, tmp_path):
    run = shutil.copytree(covariance_run, tmp_path / "run")

    def narrow(t):  # every class-covariance tensor cut to width 5, consistently
        t["ranpac.cov_mean"] = t["ranpac.cov_mean"][:, :5].contiguous()
        t["ranpac.cov_covariance"] = t["ranpac.cov_covariance"][:, :5, :5].contiguous()
        if "ranpac.cov_shared" in t:
            t["ranpac.cov_shared"] = t["ranpac.cov_shared"][:5, :5].contiguous()

    for index in (1, 2):
        rewrite_stage_weights(run, index, narrow)
    image = str(sorted((stage_folders[0][1] / "class_00").iterdir())[0])
    result = CliRunner().invoke(app, ["predict", image, "--run", str(run), "--json"])
    assert result.exit_code == 5 and "not the network's 64" in result.stderr


@pytest.mark.parametrize("threads", [1, 2])
def test_precisions_of_real_widths_under_several_threads(threads):
    """d 192 and 768 (DeiT-Tiny, ViT-B): batched LU inverses fail or hang under several MKL threads."""
    from drlcli.heads.ridge.covariance import precisions

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for d in (192, 768):
            x = torch.randn(4, 40, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)
            cov = torch.einsum("cnd,cne->cde", x, x) / 39
            got = precisions(cov, cov.mean(0), shrink=0.3, blend=0.8)
            blended = 0.7 * (0.2 * cov[0] + 0.8 * cov.mean(0))
            blended += (0.3 * torch.trace(0.2 * cov[0] + 0.8 * cov.mean(0)) / d + 1e-8) * torch.eye(
                d, dtype=torch.float64
            )
            eye = torch.eye(d, dtype=torch.float64)
            assert torch.allclose(got[0].double() @ blended, eye, atol=1e-3)
    finally:
        torch.set_num_threads(before)


def test_drl_defaults_to_class_covariances_and_ranpac_stays_ranpac():
    assert RunConfig.for_method("drl").ridge.covariance_weight == 4.0
    assert (RunConfig.for_method("drl").ridge.layout_grid, RunConfig.for_method("drl").ridge.layout_scale) == (2, 0.5)
    assert RunConfig.for_method("drl").score.head == "ridge"
    assert RunConfig.for_method("ranpac").ridge.covariance_weight == 0.0  # the baseline as published
    assert RunConfig.for_method("drl", preset="paper").score.head == "prototypes"
    with pytest.raises(UsageError, match="covariance_weight"):
        RunConfig.for_method("drl", {"ridge": {"covariance_weight": -1}})
    with pytest.raises(UsageError, match="covariance_shrink"):
        RunConfig.for_method("drl", {"ridge": {"covariance_shrink": 1.5}})


@pytest.mark.parametrize(
    "craft",
    [
        lambda t: t.update({"ranpac.cov_params": torch.ones(2)}),
        lambda t: t.update({"ranpac.cov_shared": torch.ones(3, 3)}),
        lambda t: t.update({"ranpac.cov_covariance": torch.zeros(3, 5, 5)}),
        lambda t: t.pop("ranpac.cov_shared"),
        lambda t: t.update({"ranpac.cov_params": torch.tensor([3e38, 0.3, 0.8])}),  # finite, out of range
        lambda t: t.update({"ranpac.cov_shared": -torch.eye(64)}),  # blended: not positive definite
    ],
)
def test_crafted_class_covariances_are_refused(covariance_run, stage_folders, tmp_path, craft):
    run = shutil.copytree(covariance_run, tmp_path / "run")
    rewrite_stage_weights(run, 2, craft)
    image = str(sorted((stage_folders[0][1] / "class_00").iterdir())[0])
    result = CliRunner().invoke(app, ["predict", image, "--run", str(run), "--json"])
    assert result.exit_code == 5, result.stdout
    assert "stage 2 of run" in result.stderr and "restore it from a backup" in result.stderr


LAYOUT_CFG = {"ridge": {"proj_dim": 64, "covariance_weight": 2.0, "layout_grid": 2, "layout_scale": 0.5}}


@pytest.fixture(scope="module")
def layout_run(tmp_path_factory, stage_folders):
    """ranpac with class covariances and the PTM's 2 x 2 layout in the ridge input (drl's default head)."""
    run = tmp_path_factory.mktemp("layout") / "run"
    init_run(
        run,
        ptm=TINY_PTM,
        random_init=True,
        ptm_kwargs=TINY_PTM_KWARGS,
        config=RunConfig.for_method("ranpac", LAYOUT_CFG),
    )
    for train, _ in stage_folders[:2]:
        learn_stage(run, data_dir=train, device="cpu")
    return run


def test_layout_head_equals_the_batch_ridge_on_f0_and_the_layout(layout_run, stage_folders, tmp_path):
    """The ridge reads [f_0, the four grid cells of the PTM's patch tokens], the cells' rows of R
    scaled by layout_scale; stage 1 stores g; inference computes f_0 and the layout, nothing more;
    the stored W equals the ridge on both stages' images at once; exports score like the run."""
    loaded = load_run(layout_run, device="cpu")
    model, head = loaded.model, loaded.model.head
    width = model.network.width
    assert int(loaded.stage_tensors[0][LAYOUT]) == 2 and LAYOUT not in loaded.stage_tensors[1]
    assert [meta["ridge"]["layout_grid"] for meta in loaded.stage_metas] == [2, 2]
    assert (head.layout_grid, model.layout_scored, model.stages_scored) == (2, 2, 0)
    plain = random_projection(5 * width, 64, seed=0)
    assert torch.equal(head.projection[:width], plain[:width])
    assert torch.allclose(head.projection[width:], 0.5 * plain[width:])
    feats, labels = [], []
    for k, (train, _) in enumerate(stage_folders[:2]):
        f, y = embed_images(
            model.network, scan_class_folders(train), model.data_config, batch_size=64, stages=0, layout=2
        )
        assert f.shape[1:] == (5, width)
        feats.append(f.flatten(1))
        labels.append(y + 3 * k)
    phi = expand(torch.cat(feats), head.projection.double())
    y = F.one_hot(torch.cat(labels), 6).double()
    lam = loaded.stage_metas[-1]["ridge"]["lambda"]
    direct = torch.linalg.solve(phi.T @ phi + lam * torch.eye(64, dtype=torch.float64), phi.T @ y)
    assert torch.allclose(head.weight.double(), direct, rtol=1e-3, atol=1e-4 * float(direct.abs().max()))
    images = scan_class_folders(stage_folders[1][1])
    x = torch.stack([eval_transform(model.data_config)(Image.open(p).convert("RGB")) for p in images.paths[:6]])
    with torch.no_grad():
        assert model.features(x).shape[1] == 5
        want = model.score_images(x)
        export_run(layout_run, tmp_path / "m.drl")
        assert torch.allclose(load_export(tmp_path / "m.drl").score_images(x), want, atol=1e-5)
    for name, fmt in (("m.pt", "torchscript"), ("m.pt2", "pt2")):
        assert export_run(layout_run, tmp_path / name, fmt=fmt).check_max_abs_diff <= 1e-3


def test_layout_grid_is_checked():
    assert RunConfig.for_method("ranpac").ridge.layout_grid == 0  # the baseline as published
    with pytest.raises(UsageError, match="layout_grid"):
        RunConfig.for_method("drl", {"ridge": {"layout_grid": 9}})
    with pytest.raises(UsageError, match="layout_scale"):
        RunConfig.for_method("drl", {"ridge": {"layout_scale": 0}})


@pytest.mark.parametrize(
    "craft",
    [
        lambda t: t.update({LAYOUT: torch.tensor(3)}),  # R's rows no longer fit f_0 and 9 cells
        lambda t: t.update({LAYOUT: torch.tensor(2.0)}),
        lambda t: t.update({LAYOUT: torch.tensor([2, 2])}),
        lambda t: t.update({LAYOUT: torch.tensor(-1)}),
        lambda t: t.pop(LAYOUT),  # R has 5 subspaces' rows: no f_0 (+ f_1) reading fits them
    ],
)
def test_crafted_layout_is_refused(layout_run, stage_folders, tmp_path, craft):
    run = shutil.copytree(layout_run, tmp_path / "run")
    rewrite_stage_weights(run, 1, craft)
    image = str(sorted((stage_folders[0][1] / "class_00").iterdir())[0])
    result = CliRunner().invoke(app, ["predict", image, "--run", str(run), "--json"])
    assert result.exit_code == 5, result.stdout
    assert "of run" in result.stderr and "restore it from a backup" in result.stderr


def test_packed_grams_hold_the_upper_triangle_row_by_row_and_unpack_exactly():
    """``pack`` keeps the upper triangle row by row in float32; ``unpack`` gives back the symmetric
    float64 matrix with every entry exactly the packed one's (a crafted length is refused)."""
    torch.manual_seed(0)
    a = torch.randn(7, 5, dtype=torch.float64)
    gram = a @ a.T
    packed = pack(gram)
    upper = torch.ones(7, 7, dtype=torch.bool).triu()
    assert packed.dtype == torch.float32 and torch.equal(packed, gram[upper].float())
    out = unpack(packed, 7)
    assert out.dtype == torch.float64 and torch.equal(out, out.T) and torch.equal(out[upper], packed.double())
    assert torch.equal(pack(out), packed)
    with pytest.raises(RuntimeError):
        unpack(packed[:-1], 7)
