"""The class covariances in low-rank form (``ranpac.covariance_rank`` r): Woodbury's precisions equal the
dense ones, a run stores (d, r) factors instead of (d, d) covariances and scores like a dense run, every
export carries them, forget and restore hold, and crafted factors are refused."""

import shutil

import pytest
import torch
from conftest import rewrite_stage_weights
from typer.testing import CliRunner

from drlcli import learn_stage
from drlcli.cli import app
from drlcli.commands.export import export_run
from drlcli.commands.forget import forget_class, restore_class
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.data.images import scan_class_folders
from drlcli.heads.ridge import COV_COVARIANCE, COV_FACTOR, COV_TRACE
from drlcli.heads.ridge.covariance import (
    ClassFactors,
    ClassMoments,
    LowRankPrecisions,
    class_factors,
    lowrank_distance,
    precisions,
)
from drlcli.model.incremental import embed_images
from drlcli.run.load import load_run
from drlcli.serving.drlfile import load_export
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

DENSE = {"ridge": {"proj_dim": 64, "covariance_weight": 2.0}}
LOWRANK = {"ridge": {**DENSE["ridge"], "covariance_rank": 16}}  # 12 images a class: rank 11 at most


def _classes(sizes, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, width, generator=g, dtype=torch.float64) * torch.rand(width, generator=g) for n in sizes]
    means = torch.stack([x.mean(0) for x in xs])
    scatters = torch.stack([(x - x.mean(0)).T @ (x - x.mean(0)) for x in xs])
    counts = torch.tensor([float(len(x)) for x in xs], dtype=torch.float64)
    shared = scatters.sum(0) / (counts.sum() - len(xs))
    return means, scatters, counts, shared


def _dense_distance(query, means, covariances, shared):
    prec = precisions(covariances, shared, shrink=0.3, blend=0.8).double()
    return torch.stack([((query - means[c]) @ prec[c] * (query - means[c])).sum(1) for c in range(len(means))], 1)


def _lowrank_distance(query, means, factors, traces, shared):
    lr = LowRankPrecisions.of(means, factors, traces, shared, shrink=0.3, blend=0.8)
    return lowrank_distance(
        query.float(), lr.rotation, lr.scale, lr.center, lr.const, lr.full_factor(), lr.offset
    ).double()


def test_woodbury_equals_the_dense_precisions_when_every_rank_fits():
    means, scatters, counts, shared = _classes((5, 10, 3, 24), width=32)
    query = torch.randn(7, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = _dense_distance(query, means, scatters / (counts - 1)[:, None, None], shared)
    factors, traces = class_factors(scatters, counts, rank=32)
    got = _lowrank_distance(query, means, factors, traces, shared)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_a_truncated_rank_keeps_the_leading_eigenpairs_and_the_whole_trace():
    """Rank 4 of a class of 24 images: the distances of the dense head given Y Yᵀ as the class's
    covariance with the shrinkage of its whole trace."""
    means, scatters, counts, shared = _classes((24, 20), width=16, seed=2)
    factors, traces = class_factors(scatters, counts, rank=4)
    covariances = scatters / (counts - 1)[:, None, None]
    assert torch.allclose(traces, torch.diagonal(covariances, dim1=1, dim2=2).sum(1))
    for c in range(2):
        values = torch.linalg.eigvalsh(covariances[c])
        assert torch.allclose(torch.linalg.eigvalsh(factors[c] @ factors[c].T)[-4:], values[-4:], rtol=1e-8)
    # the dense head on Y Yᵀ, its shrinkage target moved to the whole trace: Σ_c's isotropic part by hand
    query = torch.randn(5, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = []
    for c in range(2):
        blended = 0.2 * covariances[c] + 0.8 * shared
        cov = 0.7 * (0.2 * factors[c] @ factors[c].T + 0.8 * shared)
        cov += (0.3 * torch.trace(blended) / 16 + 1e-8) * torch.eye(16, dtype=torch.float64)
        want.append(((query - means[c]) @ torch.linalg.inv(cov) * (query - means[c])).sum(1))
    got = _lowrank_distance(query, means, factors, traces, shared)
    assert torch.allclose(got, torch.stack(want, 1), rtol=1e-4)


def test_a_class_factored_from_its_gram_equals_one_factored_from_its_scatter():
    """One process factors a class of n ≤ d images from its n × n Gram, torchrun from its d × d
    scatter: the same factor (columns by decreasing length, signed alike), trace and summed scatter."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, 32, generator=g, dtype=torch.float64)
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate([3, 10, 40, 247])])
    moments = ClassMoments.of(x, labels, 4)
    for rank in (4, 16):
        low = ClassFactors.of(x, labels, 4, rank)
        factors, traces = class_factors(moments.scatters(), moments.counts, rank)
        assert torch.allclose(low.factors, factors, atol=1e-6) and torch.allclose(low.traces, traces)
        assert torch.allclose(low.scatter, moments.scatters().sum(0)) and torch.allclose(low.means, moments.means())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stage_folders):
    """Two runs of 2 stages on the same data: dense class covariances and rank 16."""
    out = {}
    for name, cfg in (("dense", DENSE), ("lowrank", LOWRANK)):
        run = tmp_path_factory.mktemp(name) / "run"
        config = RunConfig.for_method("ranpac", cfg)
        init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
        for train, _ in stage_folders[:2]:
            learn_stage(run, data_dir=train, device="cpu")
        out[name] = run
    return out


def _test_batch(model, stage_folders):
    feats, _ = embed_images(model.network, scan_class_folders(stage_folders[1][1]), model.data_config, batch_size=64)
    return feats


def test_a_lowrank_run_stores_factors_and_scores_like_a_dense_one(runs, stage_folders):
    from safetensors.torch import load

    tensors = load((runs["lowrank"] / "stages" / "002" / "weights.safetensors").read_bytes())
    assert tuple(tensors[COV_FACTOR].shape) == (3, 64, 16) and tuple(tensors[COV_TRACE].shape) == (3,)
    assert COV_COVARIANCE not in tensors
    dense, lowrank = (load_run(runs[k], device="cpu").model for k in ("dense", "lowrank"))
    features = _test_batch(dense, stage_folders)
    with torch.no_grad():
        want, got = dense.scores(features), lowrank.scores(features)
    assert torch.allclose(got, want, atol=2e-4)
    assert lowrank.head.cov_precision is None and lowrank.head.cov_factor.shape == (64, 6 * 16)


def test_the_factor_is_kept_in_float16_and_an_export_scores_exactly_like_its_run(runs, stage_folders, tmp_path):
    from safetensors import safe_open

    from drlcli.heads.ridge.head import RidgeHead

    export_run(runs["lowrank"], tmp_path / "m.drl", fmt="drl")
    with safe_open(str(tmp_path / "m.drl"), framework="pt") as handle:
        assert handle.get_slice("head.cov_factor").get_dtype() == "F16" and "head.cov_factor_full" not in set(
            handle.keys()
        )
    model = load_run(runs["lowrank"], device="cpu").model
    features = _test_batch(model, stage_folders)
    with torch.no_grad():
        want = model.scores(features)
        assert torch.equal(load_export(tmp_path / "m.drl").scores(features), want)
        # an export of the release before: F_c in float32, no scale
        state = model.head.state_dict()
        state["cov_factor"] = model.head.cov_factor_full.clone()
        del state["cov_factor_scale"]
        old = RidgeHead.from_state(state)
        assert torch.equal(old(features), model.head(features))
        for scale in (float("nan"), 0.0, -1.0):
            with pytest.raises(ValueError, match="factor"):
                RidgeHead.from_state({**model.head.state_dict(), "cov_factor_scale": torch.tensor(scale)})


@pytest.mark.parametrize("fmt", ["drl", "torchscript", "onnx"])
def test_every_export_carries_the_lowrank_head(runs, stage_folders, tmp_path, fmt):
    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
    suffix = {"drl": "drl", "torchscript": "pt", "onnx": "onnx"}[fmt]
    result = export_run(runs["lowrank"], tmp_path / f"m.{suffix}", fmt=fmt)
    if fmt == "drl":
        model = load_run(runs["lowrank"], device="cpu").model
        features = _test_batch(model, stage_folders)
        with torch.no_grad():
            assert torch.allclose(load_export(tmp_path / "m.drl").scores(features), model.scores(features), atol=1e-5)
    else:
        assert result.check_max_abs_diff <= 1e-3


def test_forget_and_restore_a_class_of_a_lowrank_run(runs, tmp_path, stage_folders):
    run = shutil.copytree(runs["lowrank"], tmp_path / "run")
    before = load_run(run, device="cpu").model
    features = _test_batch(before, stage_folders)
    with torch.no_grad():
        want = before.scores(features)
    forget_class(run, before.class_names[1])
    after = load_run(run, device="cpu").model
    assert before.class_names[1] not in after.class_names and after.head.cov_factor.shape == (64, 5 * 16)
    restore_class(run, before.class_names[1])
    with torch.no_grad():
        assert torch.equal(load_run(run, device="cpu").model.scores(features), want)


@pytest.mark.parametrize(
    "craft",
    [
        lambda t: t.update({COV_TRACE: -torch.ones(3)}),
        lambda t: t.update({COV_FACTOR: torch.full((3, 64, 16), float("nan"))}),
        lambda t: t.update({COV_FACTOR: torch.zeros(3, 64, 8)}),  # a rank other than stage 1's
        lambda t: t.pop(COV_TRACE),
    ],
)
def test_crafted_lowrank_covariances_are_refused(runs, stage_folders, tmp_path, craft):
    run = shutil.copytree(runs["lowrank"], tmp_path / "run")
    rewrite_stage_weights(run, 2, craft)
    image = str(sorted((stage_folders[0][1] / "class_00").iterdir())[0])
    result = CliRunner().invoke(app, ["predict", image, "--run", str(run), "--json"])
    assert result.exit_code == 5, result.stdout
    assert "stage 2 of run" in result.stderr and "restore it from a backup" in result.stderr
    # learn-stage loads the run without assembling the class covariances (it fits a new head): its load
    # refuses what every load checks (NaN), its fit the rest
    before = (run / "manifest.json").read_bytes()
    result = CliRunner().invoke(app, ["learn-stage", "--run", str(run), "--data", str(stage_folders[2][0])])
    assert result.exit_code == 5, result.stdout
    assert ("class covariances do not fit" in result.stderr or "stage 2 of run" in result.stderr) and (
        "restore it from a backup" in result.stderr
    )
    assert (run / "manifest.json").read_bytes() == before  # nothing learned
