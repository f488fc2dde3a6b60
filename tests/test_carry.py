"""heads/ridge/carry.py and sums.py: per-token ridge maps, class Gaussians moved by them, and the
ridge sums drawn from them."""

import pytest
import torch

from drlcli.heads.ridge.carry.gaussians import ClassGaussians, TokenMaps

S, D = 3, 6
# what a carried stage keeps in the run's totals beside the classes' covariance rows
KEPT = {
    "totals",
    "lambda",
    "gram_fit",
    "gram_val",
    "counts",
    "cov_scatter",
    "cov_counts",
    "q_fit_carried",
    "q_val_carried",
}


def _planted(n=400, seed=0):
    """Tokens x and y = x + x B + b per token, with known (B, b)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, S, D, generator=g, dtype=torch.float64)
    linear = 0.1 * torch.randn(S, D, D, generator=g, dtype=torch.float64)
    shift = torch.randn(S, D, generator=g, dtype=torch.float64)
    y = x + torch.einsum("nsd,sde->nse", x, linear) + shift
    return x, y, linear, shift


def test_token_maps_recover_a_planted_affine_map():
    x, y, linear, shift = _planted()
    maps = TokenMaps.fit(x, y, lam=1e-9)
    assert torch.allclose(maps.linear, linear, atol=1e-6)
    assert torch.allclose(maps.shift, shift, atol=1e-6)
    assert torch.allclose(maps(x), y, atol=1e-6)
    expected = ((y - x).pow(2).sum((1, 2)) / x.pow(2).sum((1, 2))).mean()
    assert maps.move == pytest.approx(float(expected))


def test_token_maps_of_unmoved_images_are_the_identity():
    x, _, _, _ = _planted()
    maps = TokenMaps.fit(x, x.clone(), lam=1000.0)
    assert maps.move == 0.0
    assert torch.equal(maps(x), x)


def test_a_large_lambda_keeps_only_the_shift():
    x, y, _, _ = _planted()
    maps = TokenMaps.fit(x, y, lam=1e12)
    assert maps.linear.abs().max() < 1e-6
    assert torch.allclose(maps.shift, (y - x).mean(0), atol=1e-4)  # every image moved by the mean move


@pytest.mark.parametrize(
    "before, after, lam", [((5, S, D), (4, S, D), 1.0), ((5, S * D), (5, S * D), 1.0), ((5, S, D), (5, S, D), 0.0)]
)
def test_token_maps_refuse_mismatched_tokens_and_a_zero_lambda(before, after, lam):
    with pytest.raises(ValueError):
        TokenMaps.fit(torch.zeros(before), torch.zeros(after), lam)


def _classes(sizes=(30, 8, 25), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, S, D, generator=g, dtype=torch.float64) * (c + 1) + c for c, n in enumerate(sizes)]


def test_full_rank_gaussians_hold_the_exact_class_moments():
    rows = _classes()
    gaussians = ClassGaussians.of(rows, rank=64)  # above every class's size: every centred row kept
    assert gaussians.ranks.tolist() == [30, 8, 25]
    assert torch.equal(gaussians.spreads, torch.zeros(3, dtype=torch.float64))
    assert gaussians.counts.tolist() == [30, 8, 25]
    for c, class_rows in enumerate(rows):
        flat = class_rows.flatten(1)
        factor = gaussians.factors[c, : gaussians.ranks[c]].flatten(1)
        assert torch.allclose(gaussians.means[c].flatten(), flat.mean(0))
        assert torch.allclose(factor.T @ factor, torch.cov(flat.T))
        assert gaussians.factors[c, gaussians.ranks[c] :].abs().sum() == 0  # padding


def test_low_rank_gaussians_keep_the_total_variance():
    rows = _classes()
    gaussians = ClassGaussians.of(rows, rank=4)
    assert gaussians.ranks.tolist() == [4, 4, 4]
    for c, class_rows in enumerate(rows):
        total = torch.cov(class_rows.flatten(1).T).trace()
        kept = gaussians.factors[c].pow(2).sum() + gaussians.spreads[c] ** 2 * S * D
        assert float(kept) == pytest.approx(float(total))


def test_moving_full_rank_gaussians_equals_taking_them_of_the_moved_rows():
    rows = _classes()
    x, y, _, _ = _planted(seed=3)
    maps = TokenMaps.fit(x, y, lam=1.0)
    moved = ClassGaussians.of(rows, rank=64).moved(maps)
    direct = ClassGaussians.of([maps(r) for r in rows], rank=64)
    assert torch.allclose(moved.means, direct.means)
    for c in range(len(rows)):
        a = moved.factors[c, : moved.ranks[c]].flatten(1)
        b = direct.factors[c, : direct.ranks[c]].flatten(1)
        assert torch.allclose(a.T @ a, b.T @ b)
    linear = torch.eye(D, dtype=torch.float64) + maps.linear
    assert moved.groups.tolist() == [0, 0, 0] and torch.allclose(moved.linears[0], linear)
    again = moved.moved(maps)
    assert torch.allclose(again.linears[0], linear @ linear)  # the isotropic rest: every map's linear part, in order


def test_an_unmoving_map_changes_nothing_and_the_inexact_move_keeps_the_rest_isotropic():
    rows = _classes()
    gaussians = ClassGaussians.of(rows, rank=4)
    x = torch.randn(50, S, D, dtype=torch.float64)
    same = gaussians.moved(TokenMaps.fit(x, x.clone(), lam=10.0))
    assert torch.equal(same.means, gaussians.means) and torch.equal(same.factors, gaussians.factors)
    assert torch.equal(same.linears, torch.eye(D, dtype=torch.float64).expand(1, S, -1, -1))
    inexact = gaussians.moved(TokenMaps.fit(x, x + 1.0, lam=10.0), exact=False)
    assert inexact.groups.tolist() == [-1, -1, -1] and len(inexact.linears) == 0


def test_draws_are_seeded_and_follow_the_gaussian():
    rows = _classes(sizes=(40, 40))
    x, y, _, _ = _planted(seed=4)
    gaussians = ClassGaussians.of(rows, rank=6).moved(TokenMaps.fit(x, y, lam=1.0))
    first = gaussians.draw(1, 20, torch.Generator().manual_seed(9))
    assert first.shape == (20, S, D)
    assert torch.equal(first, gaussians.draw(1, 20, torch.Generator().manual_seed(9)))
    many = gaussians.draw(1, 60000, torch.Generator().manual_seed(10)).flatten(1)
    factor = gaussians.factors[1, :6].flatten(1)
    lin = gaussians.linears[gaussians.groups[1]]
    rest = torch.block_diag(*(lin[t].T @ lin[t] for t in range(S)))
    expected = factor.T @ factor + float(gaussians.spreads[1]) ** 2 * rest
    assert torch.allclose(many.mean(0), gaussians.means[1].flatten(), atol=0.05)
    assert torch.allclose(torch.cov(many.T), expected, atol=0.1 * float(expected.diagonal().max()))
    # the first token alone: the same law as the whole draws' first token
    alone = gaussians.draw(1, 60000, torch.Generator().manual_seed(11), first_only=True)
    assert alone.shape == (60000, 1, D)
    assert torch.allclose(alone[:, 0].mean(0), gaussians.means[1, 0], atol=0.05)
    assert torch.allclose(torch.cov(alone[:, 0].T), expected[:D, :D], atol=0.1 * float(expected.diagonal().max()))


def test_join_and_tensors_round_trip():
    a = ClassGaussians.of(_classes(sizes=(10, 3)), rank=4)
    b = ClassGaussians.of(_classes(sizes=(12,), seed=2), rank=8)
    joined = a.joined(b)
    assert len(joined) == 3 and joined.factors.shape[1] == 8 and joined.ranks.tolist() == [4, 3, 8]
    fields = ("means", "factors", "ranks", "spreads", "counts", "groups", "linears")
    back = ClassGaussians.from_tensors(joined.to_tensors("carry_"), "carry_")
    assert all(torch.equal(getattr(back, f), getattr(joined, f)) for f in fields)
    x = torch.randn(30, S, D, dtype=torch.float64)
    first = TokenMaps.fit(x, x * 1.01, lam=1.0)
    second = TokenMaps.fit(x, x * 0.98 + 0.1, lam=1.0)
    moved = a.moved(first).joined(b).moved(second)  # a's classes moved twice, b's once: two groups
    assert moved.groups.tolist() == [0, 0, 1] and len(moved.linears) == 2
    eye = torch.eye(D, dtype=torch.float64)
    assert torch.allclose(moved.linears[0], (eye + first.linear) @ (eye + second.linear))
    assert torch.allclose(moved.linears[1], eye + second.linear)
    back = ClassGaussians.from_tensors(moved.to_tensors("g."), "g.")
    assert all(torch.equal(getattr(back, f), getattr(moved, f)) for f in fields)
    assert moved.joined(a).groups.tolist() == [0, 0, 1, -1, -1]


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("factor", torch.zeros(2, 4, S, D + 1), "factor must be"),
        ("rank", torch.tensor([1.0, 2.0]), "rank must be integers"),
        ("rank", torch.tensor([1, 9]), "rank must be integers"),
        ("count", torch.tensor([0, 3]), "count must be positive"),
        ("spread", torch.tensor([float("nan"), 0.0], dtype=torch.float64), "spread must be finite"),
        ("linear", torch.zeros(1, S, D, D - 1), "linear must be"),
        ("group", torch.tensor([0, -1]), "group must be integers"),
        ("group", torch.tensor([-1.0, -1.0]), "group must be integers"),
    ],
)
def test_from_tensors_names_the_tensor_that_is_off(name, bad, message):
    tensors = ClassGaussians.of(_classes(sizes=(10, 3)), rank=4).to_tensors("c.")
    tensors[f"c.{name}"] = bad
    with pytest.raises(ValueError, match=message):
        ClassGaussians.from_tensors(tensors, "c.")
    del tensors[f"c.{name}"]
    with pytest.raises(ValueError, match="lack"):
        ClassGaussians.from_tensors(tensors, "c.")


def _head_parts(classes=2, m=40, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S * D, m, generator=g, dtype=torch.float64)  # R over the S tokens (f_0 and 2 x ... cells)


def test_expected_sums_of_point_classes_are_the_images_own_statistics():
    """A class whose images are all one point draws that point: its sums are exact."""
    from drlcli.heads.ridge.carry.sums import expected_sums
    from drlcli.heads.ridge.head import expand, head_input
    from drlcli.heads.ridge.statistics import Statistics

    g = torch.Generator().manual_seed(6)
    points = torch.randn(3, S, D, generator=g, dtype=torch.float64)
    sizes = [5, 7, 4]
    rows = [points[c].expand(n, -1, -1).clone() for c, n in enumerate(sizes)]
    held_out = torch.tensor([[4, 1], [5, 2], [3, 1]])
    projection = _head_parts()
    sums = expected_sums(
        ClassGaussians.of(rows, rank=2),
        held_out,
        projection=projection,
        layout_cells=S - 1,
        draws=3,
        generator=torch.Generator().manual_seed(0),
    )
    images = torch.cat(rows)
    labels = torch.tensor([c for c, n in enumerate(sizes) for _ in range(n)])
    val = torch.zeros(len(images), dtype=torch.bool)
    start = 0
    for c, n in enumerate(sizes):
        val[start + n - int(held_out[c, 1]) : start + n] = True
        start += n
    exact = Statistics.of(expand(head_input(images, S * D, S - 1), projection), labels, 3, val)
    for name in ("gram_fit", "gram_val", "q_fit", "q_val", "num_fit", "num_val"):
        a, b = getattr(sums.statistics, name), getattr(exact, name)
        assert torch.allclose(torch.as_tensor(a), torch.as_tensor(b)), name
    assert torch.allclose(sums.x_means, torch.nn.functional.normalize(points[:, 0], dim=-1))
    assert sums.x_covariances.abs().max() < 1e-12 and sums.scatter.abs().max() < 1e-12


def test_expected_sums_draw_the_class_gaussians_in_order_and_in_chunks(monkeypatch):
    import drlcli.heads.ridge.carry.sums as sums
    from drlcli.heads.ridge.covariance import covariance_input

    gaussians = ClassGaussians.of(_classes(sizes=(12, 9)), rank=3)
    parts = torch.tensor([[10, 2], [7, 2]])
    kwargs = dict(projection=_head_parts(), layout_cells=S - 1, draws=4)
    one = sums.expected_sums(gaussians, parts, generator=torch.Generator().manual_seed(1), **kwargs)
    generator = torch.Generator().manual_seed(1)
    for c, n in enumerate((12, 9)):
        x = covariance_input(gaussians.draw(c, 4 * n, generator))
        assert torch.allclose(one.x_means[c], x.mean(0))
        assert torch.allclose(one.x_covariances[c], torch.cov(x.T))
    assert torch.allclose(one.scatter, 11 * one.x_covariances[0] + 8 * one.x_covariances[1])
    assert torch.equal(
        one.statistics.q_fit,
        sums.expected_sums(gaussians, parts, generator=torch.Generator().manual_seed(1), **kwargs).statistics.q_fit,
    )
    many = dict(kwargs, draws=400)  # 8,400 draws: the expectation within a few per cent
    whole = sums.expected_sums(gaussians, parts, generator=torch.Generator().manual_seed(2), **many)
    monkeypatch.setattr(sums, "CHUNK", 1000)  # another stream, the same expectation
    chunked = sums.expected_sums(gaussians, parts, generator=torch.Generator().manual_seed(3), **many)
    assert (chunked.statistics.num_fit, chunked.statistics.num_val) == (17.0, 4.0)
    for name in ("q_fit", "gram_val"):
        a, b = getattr(chunked.statistics, name), getattr(whole.statistics, name)
        assert (a - b).norm() < 0.05 * b.norm(), name
    with pytest.raises(ValueError, match="parts must be"):
        sums.expected_sums(gaussians, parts[:1], generator=torch.Generator(), **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [False, True])
def test_expected_sums_on_cuda_are_the_cpu_sums(exact):
    """The sums are taken on the run's device from the same CPU draws: equal to float64 rounding,
    returned on the CPU, the Gaussians handed in left where they were (the closed-form means too)."""
    from drlcli.heads.ridge.carry.sums import expected_sums

    gaussians = ClassGaussians.of(_classes(sizes=(12, 9)), rank=3)
    gaussians = gaussians.moved(TokenMaps.fit(*_planted(n=60)[:2], lam=1.0))  # a group's linear map too
    parts = torch.tensor([[10, 2], [7, 2]])
    kwargs = dict(projection=_head_parts(), layout_cells=S - 1, draws=50, exact_mean=exact)
    cpu = expected_sums(gaussians, parts, generator=torch.Generator().manual_seed(4), **kwargs)
    gpu = expected_sums(gaussians, parts, generator=torch.Generator().manual_seed(4), device="cuda", **kwargs)
    assert gaussians.means.device.type == "cpu"
    for name in ("gram_fit", "gram_val", "q_fit", "q_val"):
        a, b = getattr(gpu.statistics, name), getattr(cpu.statistics, name)
        assert a.device.type == "cpu" and torch.allclose(a, b, rtol=1e-10, atol=1e-12), name
    for a, b in ((gpu.x_means, cpu.x_means), (gpu.x_covariances, cpu.x_covariances), (gpu.scatter, cpu.scatter)):
        assert a.device.type == "cpu" and torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_expected_sums_leave_the_counts_of_the_gaussians_handed_in_alone():
    from drlcli.heads.ridge.carry.sums import expected_sums

    gaussians = ClassGaussians.of(_classes(sizes=(5, 4)), rank=2)
    sums = expected_sums(
        gaussians,
        torch.tensor([[4, 1], [3, 1]]),
        projection=_head_parts(),
        layout_cells=S - 1,
        draws=2,
        generator=torch.Generator().manual_seed(0),
        device="cpu",
    )
    sums.counts[0] = 99
    assert gaussians.counts.tolist() == [5, 4]


def _fit(earlier, feats, labels, config, stage_index, carries=False, keeps=False):
    from drlcli.heads.ridge.fit import fit_stage

    return fit_stage(
        earlier,
        feats,
        labels,
        image_labels=labels.tolist(),
        indices=None,
        num_classes=int(labels.max()) + 1,
        config=config,
        stage_index=stage_index,
        carries=carries,
        keeps=keeps,
    )


def test_a_carried_fit_of_point_classes_equals_the_exact_fit():
    """Earlier classes whose images are one point each are carried exactly by their Gaussians: the
    carried stage solves the same W and scores as the fit from the stored statistics."""
    from drlcli.config import RunConfig
    from drlcli.heads.base import EarlierStages
    from drlcli.heads.ridge import CARRY_COV, CARRY_Q, COV_FACTOR, COV_MEAN, COV_TRACE, LAMBDA, PROJECTION, WEIGHT
    from drlcli.heads.ridge.carry.stage import Carried
    from drlcli.heads.ridge.carry.sums import expected_sums
    from drlcli.heads.ridge.statistics import validation_mask

    d, cells = 8, 4
    config = RunConfig.for_method(
        "ranpac", {"ridge": {"proj_dim": 64, "covariance_weight": 4.0, "covariance_rank": 3, "layout_grid": 2}}
    )
    g = torch.Generator().manual_seed(11)
    sizes = [6, 5, 7]
    points = torch.randn(3, 2 + cells, d, generator=g)
    points[:, 1] = points[:, 0]  # the network's rows: f_0, stage 1's subspace (the same), the 4 cells
    feats1 = torch.cat([points[c].expand(n, -1, -1) for c, n in enumerate(sizes)])
    labels1 = torch.tensor([c for c, n in enumerate(sizes) for _ in range(n)])
    fit1 = _fit(EarlierStages(None, [], list), feats1, labels1, config, 1)
    feats2 = torch.randn(24, 2 + cells, d, generator=g)
    labels2 = torch.arange(4).repeat(6)

    weights1 = {**fit1.tensors, **fit1.statistics}  # a stage's weights and the run's totals, as loaded
    exact = _fit(EarlierStages(fit1.head, [weights1], lambda: [fit1.statistics]), feats2, labels2, config, 2)

    tokens = torch.cat([feats1[:, :1], feats1[:, 2:]], 1).double()  # what the head reads: f_0 and the cells
    val = validation_mask(labels1, fraction=config.ridge.val_fraction, seed=config.train.seed + 1)
    parts = torch.tensor([[int((~val[labels1 == c]).sum()), int(val[labels1 == c].sum())] for c in range(3)])
    sums = expected_sums(
        ClassGaussians.of([tokens[labels1 == c] for c in range(3)], rank=3),
        parts,
        projection=fit1.tensors[PROJECTION].double(),
        layout_cells=cells,
        draws=2,
        generator=torch.Generator().manual_seed(0),
    )
    carried = Carried.of_draws(sums, float(fit1.statistics[LAMBDA]), rank=3)
    fit2 = _fit(EarlierStages(fit1.head, [weights1], list, carried=carried), feats2, labels2, config, 2, keeps=True)

    assert fit2.meta["lambda"] == exact.meta["lambda"] and fit2.meta["earlier_columns"] == "carried"
    assert torch.allclose(fit2.tensors[WEIGHT], exact.tensors[WEIGHT], atol=1e-5)
    both = torch.cat([feats1, feats2])
    with torch.no_grad():
        assert torch.allclose(fit2.head(both), exact.head(both), atol=1e-3)
    assert fit2.statistics[CARRY_COV[COV_MEAN]].shape == (7, d)  # every class's rows, into the totals
    assert fit2.statistics[CARRY_COV[COV_FACTOR]].shape == (7, d, 3)
    assert torch.allclose(fit2.statistics[CARRY_COV[COV_MEAN]][3:], exact.tensors[COV_MEAN])
    # every class's rows and the sums as fitted (a paused next stage reads them), all in the totals
    assert COV_MEAN not in fit2.tensors and COV_FACTOR not in fit2.tensors
    assert set(fit2.statistics) == KEPT | {CARRY_COV[n] for n in (COV_MEAN, COV_FACTOR, COV_TRACE)}
    assert fit2.statistics[CARRY_Q["q_fit"]].shape == (64, 7)

    from drlcli.heads.ridge.head import RidgeHead

    loaded = RidgeHead.from_stages([weights1, {**fit2.tensors, **fit2.statistics}])
    with torch.no_grad():
        assert torch.allclose(loaded(both), fit2.head(both), atol=1e-5)  # the head rebuilt from the totals alone


def test_a_carried_first_stage_keeps_its_sums_in_the_totals_where_later_stages_may_read_them():
    """Stage 1 of a carried run stores λ and its classes' covariance rows in the totals, and in a run
    that may pause the sums it fitted too (the plain fit's, Q under the carried names); its head
    scores as the plain fit's."""
    from drlcli.config import RunConfig
    from drlcli.heads.base import EarlierStages
    from drlcli.heads.ridge import CARRY_COV, CARRY_Q, COV_FACTOR, COV_MEAN, COV_TRACE, LAMBDA, WEIGHT
    from drlcli.heads.ridge.head import RidgeHead

    config = RunConfig.for_method(
        "ranpac", {"ridge": {"proj_dim": 64, "covariance_weight": 4.0, "covariance_rank": 3, "layout_grid": 2}}
    )
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(30, 6, 8, generator=g)
    labels = torch.arange(3).repeat(10)
    plain = _fit(EarlierStages(None, [], list), feats, labels, config, 1)
    carried = _fit(EarlierStages(None, [], list), feats, labels, config, 1, carries=True, keeps=True)
    drawn = _fit(EarlierStages(None, [], list), feats, labels, config, 1, carries=True)  # a run that never pauses
    # keeps none of the sums its next stage draws again: λ and the rows alone
    assert set(drawn.statistics) == {"totals", LAMBDA, *(CARRY_COV[n] for n in (COV_MEAN, COV_FACTOR, COV_TRACE))}

    assert {"gram_fit", "q_fit", "cov_scatter"} <= set(plain.statistics)
    assert set(carried.statistics) == KEPT | {CARRY_COV[n] for n in (COV_MEAN, COV_FACTOR, COV_TRACE)}
    for name in ("gram_fit", "gram_val", "counts", "cov_scatter", "cov_counts"):
        assert torch.equal(carried.statistics[name], plain.statistics[name]), name
    assert torch.equal(carried.statistics[CARRY_Q["q_fit"]], plain.statistics["q_fit"])
    assert COV_MEAN not in carried.tensors and torch.equal(carried.tensors[WEIGHT], plain.tensors[WEIGHT])
    assert torch.equal(carried.statistics[CARRY_COV[COV_FACTOR]], plain.tensors[COV_FACTOR])
    loaded = RidgeHead.from_stages([{**carried.tensors, **carried.statistics}])
    with torch.no_grad():
        assert torch.allclose(loaded(feats), plain.head(feats), atol=1e-6)
        assert torch.allclose(carried.head(feats), plain.head(feats), atol=1e-6)


def test_a_stage_that_moved_nothing_reads_the_kept_sums_and_fits_as_the_plain_run():
    """A carried stage that did not train the network (a paused switched run) reads the sums the stage
    before kept instead of drawing them: after a first stage of real images (kept exactly), its fit is
    the plain run's to the float32 Grams both store, and it keeps its own sums in turn."""
    from drlcli.config import RunConfig
    from drlcli.heads.base import EarlierStages
    from drlcli.heads.ridge import CARRY_COV, CARRY_Q, COV_MEAN, LAMBDA, PROJECTION, WEIGHT
    from drlcli.heads.ridge.carry.stage import Carried

    config = RunConfig.for_method(
        "ranpac", {"ridge": {"proj_dim": 64, "covariance_weight": 4.0, "covariance_rank": 3, "layout_grid": 2}}
    )
    g = torch.Generator().manual_seed(7)
    feats1, labels1 = torch.randn(30, 6, 8, generator=g), torch.arange(3).repeat(10)
    feats2, labels2 = torch.randn(24, 6, 8, generator=g), torch.arange(4).repeat(6)
    plain1 = _fit(EarlierStages(None, [], list), feats1, labels1, config, 1)
    carried1 = _fit(EarlierStages(None, [], list), feats1, labels1, config, 1, carries=True, keeps=True)
    weights1 = {**plain1.tensors, **plain1.statistics}
    plain2 = _fit(EarlierStages(plain1.head, [weights1], lambda: [plain1.statistics]), feats2, labels2, config, 2)

    totals = carried1.statistics
    shape = {"size": 64, "width": 8, "rank": 3}
    kept = Carried.kept(totals, classes=3, lam=float(totals[LAMBDA]), **shape)
    assert kept is not None and not kept.drawn and kept.lam == float(totals[LAMBDA])
    loaded1 = {**carried1.tensors, **totals}
    fit2 = _fit(
        EarlierStages(carried1.head, [loaded1], list, carried=kept),
        feats2,
        labels2,
        config,
        2,
        carries=True,
        keeps=True,
    )
    assert fit2.meta["lambda"] == plain2.meta["lambda"]
    assert torch.allclose(fit2.tensors[WEIGHT], plain2.tensors[WEIGHT], atol=1e-6)
    both = torch.cat([feats1, feats2])
    with torch.no_grad():
        assert torch.allclose(fit2.head(both), plain2.head(both), atol=1e-5)
    assert fit2.statistics[CARRY_Q["q_val"]].shape == (64, 7)
    assert torch.allclose(fit2.statistics["gram_fit"], plain2.statistics["gram_fit"], atol=1e-4)

    # a run made before runs kept them; kept sums that do not fit are refused
    without = {k: v for k, v in totals.items() if k not in CARRY_Q.values()}
    assert Carried.kept(without, classes=3, lam=None, **shape) is None
    with pytest.raises(ValueError, match="kept Q"):
        Carried.kept(totals, classes=4, lam=None, **shape)
    with pytest.raises(ValueError, match="Grams"):
        Carried.kept({**totals, "gram_fit": totals["gram_fit"][:-1]}, classes=3, lam=None, **shape)
    with pytest.raises(ValueError, match="counts"):
        Carried.kept({**totals, "counts": torch.tensor([float("nan"), 1.0])}, classes=3, lam=None, **shape)
    mean = CARRY_COV[COV_MEAN]
    crafted = [
        {k: v for k, v in totals.items() if k != mean},
        {**totals, mean: totals[mean][:, :-1]},
        {k: v for k, v in totals.items() if k != "cov_counts"},
        {**totals, "cov_scatter": torch.zeros(9, 9)},
        {**totals, "cov_scatter": torch.zeros(1)},
    ]
    for bad in crafted:
        with pytest.raises(ValueError, match="kept class covariances"):
            Carried.kept(bad, classes=3, lam=None, **shape)
    # without class covariances nothing of them is read
    bare = Carried.kept(crafted[0], classes=3, lam=None, size=64, width=8, rank=None)
    assert bare is not None and bare.rows == {} and bare.scatter == {}
    assert PROJECTION in carried1.tensors and COV_MEAN not in carried1.tensors


def _moved_gaussians():
    """Two groups of classes: two moved by one map (L ≠ I), then one taken after it (L = I)."""
    x, y, _, _ = _planted(n=200, seed=4)
    moved = ClassGaussians.of(_classes(sizes=(12, 9)), rank=2).moved(TokenMaps.fit(x, y, 1.0))
    return moved.joined(ClassGaussians.of(_classes(sizes=(10,), seed=9), rank=2))


@pytest.mark.parametrize("width,cells", [(S * D, S - 1), (2 * D, 1)])
def test_relu_means_are_the_draws_expectation(width, cells):
    """E[ReLU(h R)] in closed form is what many draws average to, for moved and unmoved classes and
    for a head that reads only some of the tokens (f_0 and the last cell)."""
    from drlcli.heads.ridge.carry.sums import relu_means
    from drlcli.heads.ridge.head import expand, head_input

    gaussians = _moved_gaussians()
    projection = torch.randn(width, 30, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    exact = relu_means(gaussians, projection, cells)
    generator = torch.Generator().manual_seed(3)
    for c in range(len(gaussians)):
        phi = expand(head_input(gaussians.draw(c, 100_000, generator).double(), width, cells), projection)
        bound = 5 * phi.std(0) / len(phi) ** 0.5 + 1e-9  # five standard errors of the draws' mean
        assert bool(((phi.mean(0) - exact[c]).abs() < bound).all()), c
    point = ClassGaussians.of([torch.ones(4, S, D, dtype=torch.float64)], rank=2)  # σ 0, no direction
    assert torch.allclose(
        relu_means(point, projection, cells)[0], expand(head_input(point.means, width, cells), projection)[0]
    )


def test_exact_means_centre_the_grams_and_a_gram_budget_reads_each_class_share():
    """exact_mean puts n_part · m (m = E[φ] in closed form) in Q and n_part · (mean of (φ − m)(φ − m)ᵀ
    + m mᵀ) in the Grams; gram_draws reads each class's share of that many of the same draws (its
    first ones, drawn whole; the rest are drawn for x alone, their first token); the class moments of
    x come from every draw either way."""
    from drlcli.heads.ridge.carry.sums import expected_sums, relu_means
    from drlcli.heads.ridge.covariance import covariance_input
    from drlcli.heads.ridge.head import expand, head_input

    gaussians = _moved_gaussians()
    parts = torch.tensor([[10, 2], [7, 2], [8, 2]])
    kwargs = dict(projection=_head_parts(), layout_cells=S - 1, draws=5)
    drawn = expected_sums(gaussians, parts, generator=torch.Generator().manual_seed(1), **kwargs)
    means = relu_means(gaussians, _head_parts(), S - 1)

    def manual(shares):
        generator, grams = torch.Generator().manual_seed(1), torch.zeros(2, 40, 40, dtype=torch.float64)
        covariances = []
        for c, n in enumerate((12, 9, 10)):
            read = gaussians.draw(c, shares[c], generator).double()
            rest = gaussians.draw(c, 5 * n - shares[c], generator, first_only=True).double()
            phi = expand(head_input(read, S * D, S - 1), _head_parts())
            deviations = phi - means[c]
            for part in range(2):
                grams[part] += int(parts[c, part]) * (
                    deviations.T @ deviations / shares[c] + torch.outer(means[c], means[c])
                )
            covariances.append(torch.cov(covariance_input(torch.cat([read[:, :1], rest])).T))
        return grams, torch.stack(covariances)

    for budget, shares in ((None, (60, 45, 50)), (31, (12, 9, 10))):  # 31 draws over 31 images: one an image
        sums = expected_sums(
            gaussians, parts, generator=torch.Generator().manual_seed(1), exact_mean=True, gram_draws=budget, **kwargs
        )
        assert torch.allclose(sums.statistics.q_fit, parts[:, 0].double() * means.T)
        assert torch.allclose(sums.statistics.q_val, parts[:, 1].double() * means.T)
        grams, covariances = manual(shares)
        assert torch.allclose(sums.statistics.gram_fit, grams[0]) and torch.allclose(sums.statistics.gram_val, grams[1])
        assert torch.allclose(sums.x_covariances, covariances)
        if budget is None:  # every draw read: the draws of the plain carry, to the bit
            assert torch.equal(sums.x_covariances, drawn.x_covariances) and torch.equal(sums.scatter, drawn.scatter)
    with pytest.raises(ValueError, match="gram_draws"):
        expected_sums(gaussians, parts, generator=torch.Generator(), gram_draws=10, **kwargs)


def test_split_rows_give_each_gram_its_own_share_of_a_class_draws(monkeypatch):
    """split_rows: a class's read rows are cut in proportion to its fit and held-out images, each part
    reading its own rows at n_part / its rows (a part without images reads none; a single row serves
    both); Q and the class moments of x are as without the split, and the two Grams' sum reads every
    row at about n / read."""
    from drlcli.heads.ridge.carry.sums import _Split, expected_sums, relu_means
    from drlcli.heads.ridge.head import expand, head_input

    gaussians = _moved_gaussians()
    parts = torch.tensor([[10, 2], [7, 0], [8, 2]])
    kwargs = dict(projection=_head_parts(), layout_cells=S - 1, draws=5)
    means = relu_means(gaussians, _head_parts(), S - 1)
    for budget, ranges in (  # each class's (fit rows, held-out rows)
        (None, (((0, 50), (50, 60)), ((0, 45), (45, 45)), ((0, 40), (40, 50)))),
        (3, (((0, 1), (0, 1)), ((0, 1), (1, 1)), ((0, 1), (0, 1)))),  # one row a class: both parts read it
    ):

        def split(budget=budget):
            return expected_sums(
                gaussians,
                parts,
                generator=torch.Generator().manual_seed(1),
                exact_mean=True,
                gram_draws=budget,
                split_rows=True,
                **kwargs,
            )

        sums = split()
        plain = expected_sums(
            gaussians, parts, generator=torch.Generator().manual_seed(1), exact_mean=True, gram_draws=budget, **kwargs
        )
        generator, grams = torch.Generator().manual_seed(1), torch.zeros(2, 40, 40, dtype=torch.float64)
        for c, n in enumerate((12, 9, 10)):
            read = max(high for _, high in ranges[c])  # drawn whole; the rest of the class's draws for x alone
            phi = expand(head_input(gaussians.draw(c, read, generator).double(), S * D, S - 1), _head_parts())
            gaussians.draw(c, 5 * n - read, generator, first_only=True)
            deviations = phi - means[c]
            for part, (low, high) in enumerate(ranges[c]):
                rows = deviations[low:high]
                if len(rows):
                    grams[part] += int(parts[c, part]) * rows.T @ rows / len(rows)
                grams[part] += int(parts[c, part]) * torch.outer(means[c], means[c])
        assert torch.allclose(sums.statistics.gram_fit, grams[0]) and torch.allclose(sums.statistics.gram_val, grams[1])
        assert torch.equal(sums.statistics.q_fit, plain.statistics.q_fit)
        with monkeypatch.context() as patch:  # buffers that fill up mid-class: the same sums
            patch.setattr(_Split, "ROWS", 7)
            small = split()
        assert torch.allclose(small.statistics.gram_fit, grams[0]) and torch.allclose(
            small.statistics.gram_val, grams[1]
        )
        assert torch.equal(sums.x_covariances, plain.x_covariances) and torch.equal(sums.scatter, plain.scatter)
    with pytest.raises(ValueError, match="split_rows needs exact_mean"):
        expected_sums(gaussians, parts, generator=torch.Generator(), split_rows=True, **kwargs)


def test_centred_grams_are_closer_to_the_expectation_at_the_same_draws():
    """The point of centring: at the same draws the Grams' error about their expectation is smaller."""
    from drlcli.heads.ridge.carry.sums import expected_sums

    gaussians = ClassGaussians.of([torch.randn(40, S, D, dtype=torch.float64) * 0.5 + 2.0], rank=3)
    parts, kwargs = torch.tensor([[32, 8]]), dict(projection=_head_parts(), layout_cells=S - 1)
    target = expected_sums(
        gaussians, parts, generator=torch.Generator().manual_seed(0), draws=2000, exact_mean=True, **kwargs
    )
    errors = {True: 0.0, False: 0.0}
    for seed in range(1, 6):
        for exact in errors:
            sums = expected_sums(
                gaussians, parts, generator=torch.Generator().manual_seed(seed), draws=2, exact_mean=exact, **kwargs
            )
            errors[exact] += float((sums.statistics.gram_fit - target.statistics.gram_fit).norm())
    assert errors[True] < 0.8 * errors[False], errors


def test_a_closed_form_mean_refuses_a_head_that_reads_a_token_twice():
    from drlcli.heads.ridge.carry.sums import relu_means

    one_token = ClassGaussians.of([torch.randn(6, 1, D, dtype=torch.float64)], rank=2)
    projection = torch.randn(2 * D, 8, dtype=torch.float64)  # f_0, then the "last cell": the same token
    with pytest.raises(ValueError, match="each token once"):
        relu_means(one_token, projection, 1)
