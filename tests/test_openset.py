"""The "unknown" answer (openset.py): calibration at commit, predict's flag, eval --unknown-data."""

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import rewrite_stage_weights
from safetensors.torch import load as st_load
from typer.testing import CliRunner

from drlcli.cli import app
from drlcli.heads.linalg import shrunk
from drlcli.heads.openset import BIAS, RMD_BIAS, RMD_MEAN, RMD_ROWS, RMD_SCATTER, RMD_TENSORS
from drlcli.heads.openset.calibrate import balanced_quantile, balanced_rate, calibrate, holdout_mask
from drlcli.heads.openset.report import auroc, open_set_report
from drlcli.heads.openset.rmd import Moments, RmdKnown, carried_moments, known_scores, probe_block, rmd_input
from drlcli.options import OpenSetConfig

runner = CliRunner()


def _json(result):
    return json.loads(result.stdout)


def _error(result):
    return json.loads(result.stdout)["error"]["message"]


# ------------------------------------------------------------------------------ units


def test_holdout_keeps_at_least_one_image_per_class_out_and_one_in():
    labels = torch.tensor([0] * 10 + [1] * 2 + [2] * 1 + [3] * 7)
    held = holdout_mask(labels, fraction=0.2, seed=3)
    assert [int(held[labels == c].sum()) for c in range(4)] == [2, 1, 1, 1]
    assert torch.equal(held, holdout_mask(labels, fraction=0.2, seed=3))  # seeded
    assert not torch.equal(held, holdout_mask(labels, fraction=0.2, seed=4))


def test_calibrated_threshold_rejects_the_target_share_of_held_out_images():
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=generator) * 3
    labels = torch.arange(4).repeat_interleave(100)
    features = centres[labels] + torch.randn(400, 16, generator=generator)
    cal = calibrate(features, labels, 4, OpenSetConfig(rejection=0.1, holdout=0.5), seed=0)
    assert cal.held_out == 200 and cal.rejection == 0.1
    assert 0.08 <= cal.rejected <= 0.1  # the lower quantile: never more than the target
    # the decision the model makes with it: cosine to the prototypes (all images) minus the bias
    prototypes = torch.stack([features[labels == c].mean(0) for c in range(4)])
    known = known_scores(features, prototypes, torch.full((4,), cal.threshold))
    assert float((known < 0).double().mean()) <= 0.1
    far = -prototypes.mean(0, keepdim=True) + torch.randn(50, 16, generator=generator) * 0.1
    assert bool((known_scores(far, prototypes, torch.full((4,), cal.threshold)) < 0).all())


def _clusters(seed, classes=4, per_class=60, width=12):
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, width, generator=generator) * 2
    labels = torch.arange(classes).repeat_interleave(per_class)
    return centres[labels] + torch.randn(len(labels), width, generator=generator), labels


def test_rmd_scores_are_the_relative_mahalanobis_distance_of_the_normalised_features():
    features, labels = _clusters(0)
    moments = Moments.of(features, labels, 4)
    x = torch.nn.functional.normalize(features.double(), dim=-1)
    # the Gaussians from the statistics are those of the images: class means, pooled and total covariance
    means = torch.stack([x[labels == c].mean(0) for c in range(4)])
    within = sum((x[labels == c] - means[c]).T @ (x[labels == c] - means[c]) for c in range(4)) / (len(x) - 4)
    mu0, p_within, p_full, variance = moments.gaussians()
    assert torch.allclose(mu0, x.mean(0)) and torch.allclose(moments.means, means)
    assert torch.allclose(p_within, torch.linalg.inv(shrunk(within, 0.5)), rtol=1e-6)
    assert torch.allclose(p_full, torch.linalg.inv(shrunk(torch.cov(x.T), 0.5)), rtol=1e-6)
    probe, _ = _clusters(1, per_class=5)
    z = torch.nn.functional.normalize(probe.double(), dim=-1)
    own = torch.stack([((z - means[c]) @ p_within * (z - means[c])).sum(1) for c in range(4)], 1)
    background = ((z - mu0) @ p_full * (z - mu0)).sum(1, keepdim=True)
    bias = torch.full((4,), 0.7)
    scorer = RmdKnown(moments, bias)
    assert torch.allclose(scorer.scores(probe), background - own)
    assert variance == pytest.approx(float(torch.trace(torch.cov(x.T))) / 12)
    assert torch.allclose(scorer(probe), ((background - own - 0.7).max(1).values * variance).float())


def test_rmd_moments_add_up_stage_by_stage():
    features, labels = _clusters(2)
    first, second = labels < 2, labels >= 2
    joined = Moments.of(features[first], labels[first], 2).joined(Moments.of(features[second], labels[second] - 2, 2))
    whole = Moments.of(features, labels, 4)
    for a, b in zip(joined.gaussians(), whole.gaussians()):
        assert torch.allclose(torch.as_tensor(a), torch.as_tensor(b))
    assert torch.equal(joined.scatter_counts, torch.tensor([240.0, 4.0], dtype=torch.float64))


def _classes_moments(x, labels, classes):
    """Moments of rows taken as they are (no normalisation): what ``Moments.moved`` maps."""
    means = torch.stack([x[labels == c].mean(0) for c in range(classes)])
    centred = x - means[labels]
    return means, centred.T @ centred


def test_moving_moments_equals_taking_them_of_the_moved_images():
    features, labels = _clusters(3)
    moments = Moments.of(features, labels, 4)
    x = torch.nn.functional.normalize(features.double(), dim=-1)
    generator = torch.Generator().manual_seed(4)
    linear = 0.1 * torch.randn(12, 12, generator=generator, dtype=torch.float64)
    shift = 0.05 * torch.randn(12, generator=generator, dtype=torch.float64)
    moved = moments.moved(linear, shift)
    means, scatter = _classes_moments(x + x @ linear + shift, labels, 4)
    assert torch.allclose(moved.means, means) and torch.allclose(moved.scatter, scatter)
    assert torch.equal(moved.counts, moments.counts) and torch.equal(moved.scatter_counts, moments.scatter_counts)
    with pytest.raises(ValueError, match="cannot move moments 12 wide"):
        moments.moved(linear[:6, :6], shift[:6])


def test_carried_moments_follow_a_planted_move_and_leave_unmoved_images_alone():
    features, labels = _clusters(5, per_class=80)
    earlier = Moments.of(features[labels < 2], labels[labels < 2], 2)
    new = labels >= 2  # the stage's own images: before and after its "training"
    before = torch.nn.functional.normalize(features[new].double(), dim=-1)
    same, move = carried_moments(earlier, features[new], before, before, 1000.0)
    assert move == 0.0 and torch.allclose(same.means, earlier.means) and torch.allclose(same.scatter, earlier.scatter)
    generator = torch.Generator().manual_seed(6)
    skew = 0.2 * torch.randn(12, 12, generator=generator, dtype=torch.float64)
    rotation = torch.linalg.matrix_exp(skew - skew.T)  # x stays a unit vector: the map is x -> x R
    after = 3.0 * before @ rotation  # x is the direction of the rmd input: its norm is not read
    moved, move = carried_moments(earlier, features[new], before, after, 1e-6)  # λ ≈ 0: the map is recovered
    x = torch.nn.functional.normalize(features[labels < 2].double(), dim=-1)
    means, scatter = _classes_moments(x @ rotation, labels[labels < 2], 2)
    assert move > 0 and torch.allclose(moved.means, means, atol=1e-6)
    assert torch.allclose(moved.scatter, scatter, atol=1e-6)
    # λ is the head's class-token map's on raw f_0, scaled to unit rows: the same λ at any norm of f_0
    far, _ = carried_moments(earlier, 10 * features[new], before, after, 1e-4)
    assert torch.allclose(far.means, moved.means, atol=1e-12) and torch.allclose(far.scatter, moved.scatter, atol=1e-12)
    biased, _ = carried_moments(earlier, features[new], before, after, 1e-1)  # a larger λ: a shorter move
    assert (biased.means - means).norm() > (moved.means - means).norm()


def test_rmd_calibration_rejects_the_target_share_and_calls_far_images_unknown():
    features, labels = _clusters(3, per_class=100)
    earlier = Moments.of(features[labels < 2], labels[labels < 2], 2)
    stage = labels >= 2
    cal = calibrate(
        features[stage], labels[stage] - 2, 2, OpenSetConfig(rejection=0.1, holdout=0.5), seed=0, earlier=earlier
    )
    assert cal.rmd_threshold is not None and cal.rmd_rejected <= 0.1
    model = RmdKnown(Moments.of(features, labels, 4), torch.full((4,), cal.rmd_threshold))
    assert float((model(features[stage]) < 0).double().mean()) <= 0.15  # near the target on the stage's images
    far = -features.mean(0, keepdim=True) * 3 + torch.randn(50, 12, generator=torch.Generator().manual_seed(9))
    assert float((model(far) < 0).double().mean()) > 0.9
    assert calibrate(features, labels, 4, OpenSetConfig(), seed=0).rmd_threshold is None  # no earlier moments


def test_balanced_quantile_weighs_every_class_the_same():
    # class 0: 90 high scores; class 1: 10 low ones. A plain 10 % quantile lands among class 1's
    # scores and would reject 9 of its 10 images; the balanced one rejects at most 10 % of each class
    # on average, and the lowest score at which that share reaches 10 %
    scores = torch.cat([torch.arange(10, 100), torch.arange(0, 10)]).double()
    labels = torch.cat([torch.zeros(90, dtype=torch.long), torch.ones(10, dtype=torch.long)])
    plain = float(torch.quantile(scores, 0.1, interpolation="lower"))
    assert balanced_rate(scores < plain, labels) == pytest.approx(0.45)
    t = balanced_quantile(scores, labels, 0.1)
    assert balanced_rate(scores < t, labels) <= 0.1 <= balanced_rate(scores <= t, labels)
    assert t == 1.0
    # with equal class counts it is the plain lower quantile
    even = torch.arange(20).double().flip(0)
    assert balanced_quantile(even, torch.arange(20) % 2, 0.25) == float(
        torch.quantile(even, 0.25, interpolation="lower")
    )


def test_rmd_threshold_is_set_on_the_best_score_over_every_class_learned_so_far():
    # the stage's classes sit beside the earlier ones, so an earlier class outscores some held-out images
    generator = torch.Generator().manual_seed(4)
    centres = torch.randn(2, 12, generator=generator) * 2
    centres = torch.cat([centres, centres + 0.3 * torch.randn(2, 12, generator=generator)])
    labels = torch.arange(4).repeat_interleave(60)
    features = centres[labels] + torch.randn(240, 12, generator=generator)
    earlier = Moments.of(features[labels < 2], labels[labels < 2], 2)
    stage, local = labels >= 2, labels[labels >= 2] - 2
    cfg = OpenSetConfig(rejection=0.1, holdout=0.5)
    cal = calibrate(features[stage], local, 2, cfg, seed=0, earlier=earlier)
    held = holdout_mask(local, fraction=0.5, seed=0)
    kept = Moments.of(features[stage][~held], local[~held], 2)
    best = RmdKnown(earlier.joined(kept), torch.zeros(4)).scores(features[stage][held])
    assert bool((best[:, :2].max(1).values > best[:, 2:].max(1).values).any())  # the earlier classes compete
    assert cal.rmd_threshold == balanced_quantile(best.max(1).values, local[held], 0.1)
    assert cal.rmd_threshold > balanced_quantile(best[:, 2:].max(1).values, local[held], 0.1)


def test_rmd_calibrates_classes_of_one_or_two_images():
    features, labels = _clusters(5, classes=3, per_class=2)
    for n in (1, 2):  # one image: held out and kept (its mean); two: one kept, no spread within classes
        keep = torch.cat([torch.arange(3) * 2 + k for k in range(n)])
        cal = calibrate(features[keep], labels[keep], 3, OpenSetConfig(), seed=0, earlier=Moments.empty(12))
        assert cal.rmd_threshold is not None and math.isfinite(cal.rmd_threshold)
        known = RmdKnown(Moments.of(features[keep], labels[keep], 3), torch.full((3,), cal.rmd_threshold))
        assert bool(torch.isfinite(known(features)).all())


def test_a_scatter_that_is_no_covariance_is_refused():
    features, labels = _clusters(4)
    moments = Moments.of(features, labels, 4)
    with pytest.raises(ValueError, match="unknown_scatter does not give a covariance"):
        Moments(
            moments.means, moments.counts, -torch.eye(12, dtype=torch.float64) * 5, moments.scatter_counts
        ).gaussians()


def test_auroc_matches_pairwise_counting_with_ties():
    generator = torch.Generator().manual_seed(1)
    known = torch.randint(0, 5, (40,), generator=generator).float()
    unknown = torch.randint(0, 5, (30,), generator=generator).float()
    pairs = [(1.0 if k > u else 0.5 if k == u else 0.0) for k, u in itertools.product(known.tolist(), unknown.tolist())]
    assert auroc(known, unknown) == pytest.approx(sum(pairs) / len(pairs))
    report = open_set_report(
        torch.tensor([0.5, -0.1, 0.2]), torch.tensor([True, True, False]), torch.tensor([-1.0, 0.3])
    )
    assert (report.known_rejected, report.unknown_accepted) == (pytest.approx(33.3333), 50.0)
    assert (report.top1_accepted, report.top1_closed) == (pytest.approx(33.3333), pytest.approx(66.6667))


# ------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def learned(learned_run):
    return learned_run


def test_each_stage_stores_its_calibration(learned):
    for index in (1, 2):
        meta = json.loads((learned / "stages" / f"{index:03d}" / "stage.json").read_text())
        cal = meta["open_set"]
        assert cal["rejection"] == 0.05 and cal["held_out"] == 3 * 2  # 12 images per class: 2 held out
        assert -1 <= cal["threshold"] <= 1
        weights = st_load((learned / "stages" / f"{index:03d}" / "weights.safetensors").read_bytes())
        assert torch.equal(weights[BIAS], torch.full((3,), cal["threshold"]))


def test_info_shows_each_stage_threshold(learned):
    out = json.loads(runner.invoke(app, ["info", "--run", str(learned), "--json"]).stdout)
    for stage in out["stages"]:
        meta = json.loads((learned / "stages" / f"{stage['stage']:03d}" / "stage.json").read_text())
        assert stage["unknown_threshold"] == meta["open_set"]["threshold"]
        assert stage["unknown_rmd_threshold"] == meta["open_set"]["rmd_threshold"] is not None


def test_predict_marks_unknown_images_and_keeps_the_top_k(learned, stage_folders):
    result = runner.invoke(app, ["predict", str(stage_folders[2][1]), "--run", str(learned), "--json", "--top-k", "2"])
    assert result.exit_code == 0, result.stdout
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 12
    for line in lines:
        assert len(line["top"]) == 2 and isinstance(line["known_score"], float)
        assert line["unknown"] is (line["known_score"] < 0)


def test_eval_unknown_data_reports_the_open_set_numbers(learned, stage_folders):
    args = ["eval", "--data", str(stage_folders[0][1]), "--unknown-data", str(stage_folders[2][1])]
    result = runner.invoke(app, [*args, "--run", str(learned), "--json"])
    assert result.exit_code == 0, result.stdout
    out = _json(result)
    o = out["open_set"]
    assert (o["num_known"], o["num_unknown"]) == (12, 12)
    assert 0 <= o["auroc"] <= 1 and 0 <= o["unknown_accepted"] <= 100 and 0 <= o["known_rejected"] <= 100
    assert o["top1_closed"] == out["accuracy"]["top1"] and o["top1_accepted"] <= o["top1_closed"]
    assert out["accuracy"]["num_images"] == 12  # unknown images are not counted as known ones
    text = runner.invoke(app, [*args, "--run", str(learned)])
    assert text.exit_code == 0 and "AUROC" in text.stdout
    plain = _json(runner.invoke(app, ["eval", "--data", str(stage_folders[0][1]), "--run", str(learned), "--json"]))
    assert plain["open_set"] is None


def test_unknown_data_holding_a_learned_class_is_refused(learned, stage_folders):
    args = ["eval", "--data", str(stage_folders[0][1]), "--unknown-data", str(stage_folders[1][1])]
    result = runner.invoke(app, [*args, "--run", str(learned), "--json"])
    assert result.exit_code == 3 and "has class(es) this run has learned" in _error(result)


def test_crafted_biases_are_refused(learned, stage_folders, tmp_path):
    image = str(sorted((stage_folders[0][1] / "class_00").iterdir())[0])
    for bad in (torch.full((3,), 7.0), torch.zeros(2)):
        run = Path(shutil.copytree(learned, tmp_path / f"run{bad.numel()}"))
        rewrite_stage_weights(run, 2, lambda t, bad=bad: t.update({BIAS: bad}))
        result = runner.invoke(app, ["predict", image, "--run", str(run), "--json"])
        assert result.exit_code == 5, result.stdout
        assert "unknown_bias" in _error(result)


def test_a_run_from_before_calibration_never_answers_unknown(learned, stage_folders, tmp_path):
    run = Path(shutil.copytree(learned, tmp_path / "old"))
    rewrite_stage_weights(run, 1, lambda t: t.pop(BIAS))
    image = str(sorted((stage_folders[2][1] / "class_06").iterdir())[0])
    line = json.loads(runner.invoke(app, ["predict", image, "--run", str(run), "--json"]).stdout)
    assert line["unknown"] is None and line["known_score"] is None and len(line["top"]) == 5
    args = ["eval", "--data", str(stage_folders[0][1]), "--unknown-data", str(stage_folders[2][1])]
    result = runner.invoke(app, [*args, "--run", str(run), "--json"])
    assert result.exit_code == 7 and "calibrated the unknown answer" in _error(result)


def test_forgetting_a_class_takes_its_threshold_out_and_restore_puts_it_back(learned, stage_folders, tmp_path):
    run = Path(shutil.copytree(learned, tmp_path / "run"))
    images = str(stage_folders[0][1])
    before = [
        json.loads(x) for x in runner.invoke(app, ["predict", images, "--run", str(run), "--json"]).stdout.splitlines()
    ]
    assert runner.invoke(app, ["forget", "--class", "class_01", "--run", str(run), "--json"]).exit_code == 0
    after = [
        json.loads(x) for x in runner.invoke(app, ["predict", images, "--run", str(run), "--json"]).stdout.splitlines()
    ]
    assert all(t["class"] != "class_01" for line in after for t in line["top"])
    assert all(isinstance(line["unknown"], bool) for line in after)  # still calibrated, one bias less
    assert runner.invoke(app, ["forget", "--restore", "class_01", "--run", str(run), "--json"]).exit_code == 0
    again = [
        json.loads(x) for x in runner.invoke(app, ["predict", images, "--run", str(run), "--json"]).stdout.splitlines()
    ]
    assert again == before


@pytest.mark.parametrize(
    "section", [{"rejection": 0.0}, {"rejection": 0.6}, {"holdout": 0.0}, {"holdout": 0.9}, {"rejection": float("nan")}]
)
def test_open_set_options_out_of_range_are_refused(section):
    from drlcli.config import RunConfig
    from drlcli.errors import UsageError

    with pytest.raises(UsageError, match=r"open_set\.(rejection|holdout) must be a"):
        RunConfig.for_method("drl", {"open_set": section})
    assert RunConfig.for_method("drl", {"open_set": {"rejection": 0.01}}).open_set.rejection == 0.01


# --------------------------------------------------------------------------- the rmd rule, CLI


def test_each_stage_stores_the_rmd_statistics_and_eval_answers_by_them(learned, stage_folders):
    """Each stage its classes' rows; the newest stage's totals the scatter summed over every stage."""
    for index in (1, 2):
        weights = st_load((learned / "stages" / f"{index:03d}" / "weights.safetensors").read_bytes())
        assert set(RMD_ROWS) <= set(weights) and weights[RMD_MEAN].shape[0] == 3
        assert RMD_SCATTER not in weights
        cal = json.loads((learned / "stages" / f"{index:03d}" / "stage.json").read_text())["open_set"]
        assert torch.equal(weights[RMD_BIAS], torch.full((3,), cal["rmd_threshold"]))
    assert not (learned / "stages" / "001" / "totals.safetensors").exists()  # superseded by stage 2's
    totals = st_load((learned / "stages" / "002" / "totals.safetensors").read_bytes())
    assert totals["unknown_scatter_counts"].tolist() == [72.0, 6.0]  # every image of both stages
    args = ["eval", "--data", str(stage_folders[0][1]), "--unknown-data", str(stage_folders[2][1]), "--json"]
    out = _json(runner.invoke(app, [*args, "--run", str(learned)]))["open_set"]
    assert out["rule"] == "rmd" and out["probe_block"] == 2  # block round(0.64 x 3) of the tiny ViT's 4


def test_a_run_without_rmd_statistics_answers_by_the_cosine(learned, stage_folders, tmp_path):
    run = Path(shutil.copytree(learned, tmp_path / "old"))
    rewrite_stage_weights(run, 1, lambda t: [t.pop(name, None) for name in RMD_TENSORS])
    args = ["eval", "--data", str(stage_folders[0][1]), "--unknown-data", str(stage_folders[2][1]), "--json"]
    out = _json(runner.invoke(app, [*args, "--run", str(run)]))["open_set"]
    assert out["rule"] == "cosine"
    image = str(sorted((stage_folders[0][1] / "class_00").iterdir())[0])
    line = json.loads(runner.invoke(app, ["predict", image, "--run", str(run), "--json"]).stdout)
    assert isinstance(line["unknown"], bool)


def test_the_cosine_rule_stays_reachable_by_config(stage_folders, tmp_path):
    from conftest import TINY_PTM, TINY_PTM_KWARGS

    from drlcli import learn_stage
    from drlcli.commands.init import init_run
    from drlcli.config import RunConfig
    from drlcli.run.load import load_run

    run = tmp_path / "cos"
    config = RunConfig.for_method("drl", {"open_set": {"score": "cosine"}})
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    learn_stage(run, data_dir=stage_folders[0][0], train_overrides={"epochs": 1, "batch_size": 12}, device="cpu")
    model = load_run(run).model
    assert model.open_set_answer == "cosine" and model.unknown_rmd is not None  # stored all the same
    images = torch.randn(4, 3, 32, 32)
    feats = model.features(images)
    expected = known_scores(feats[:, 0], model.real_prototypes[:, 0], model.unknown_bias)
    assert torch.allclose(model.known(model.split(feats)[1]), expected)


def test_probe_block_is_the_block_at_the_configured_share_of_the_depth():
    assert probe_block(0.64, 12) == 7  # DeiT: block 7 of 0..11
    assert probe_block(0.64, 4) == 2 and probe_block(0.0, 12) == 0
    assert probe_block(None, 12) is None and probe_block(0.99, 12) is None  # the last block is f_0's


def test_the_rmd_score_reads_f0_and_the_probe_blocks_class_token(learned):
    from drlcli.run.load import load_run

    model = load_run(learned).model
    ptm, d = model.network.ptm, model.network.width
    assert model.probes_read == (2,) and model.unknown_rmd[0].means.shape == (6, 2 * d)
    images = torch.randn(5, 3, 32, 32)
    x = ptm.norm_pre(ptm._pos_embed(ptm.patch_embed(images)))
    for block in ptm.blocks[:3]:
        x = block(x)
    probe, f0 = ptm.norm(x)[:, 0], ptm.forward_features(images)[:, 0]
    moments, bias = model.unknown_rmd
    with torch.no_grad():
        expected = RmdKnown(moments, bias.mean().expand(6))(rmd_input(f0, probe, 2.0))
        scoring, inputs = model.split(model.features(images, open_set=True))
        assert torch.allclose(model.known(inputs), expected, atol=1e-4)
        assert torch.equal(model.scores(scoring), model.score_images(images))  # not the probe row


def _rewrite_config(run: Path, change) -> None:
    """Change run.yaml's hyper-parameters with ``change(config)`` and its manifest entry consistently."""
    import yaml

    from drlcli.run.layout import sha256_bytes

    record = yaml.safe_load((run / "run.yaml").read_text())
    change(record["config"])
    data = yaml.safe_dump(record, sort_keys=False).encode()
    (run / "run.yaml").write_bytes(data)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["files"]["run.yaml"] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (run / "manifest.json").write_text(json.dumps(manifest))


def test_a_run_learned_before_the_probe_block_keeps_f0_alone(stage_folders, tmp_path):
    from conftest import TINY_PTM, TINY_PTM_KWARGS

    from drlcli import learn_stage
    from drlcli.commands.init import init_run
    from drlcli.config import RunConfig
    from drlcli.run.load import load_run

    run = tmp_path / "f0"
    config = RunConfig.for_method("drl", {"open_set": {"probe_depth": None}}, preset="frozen")
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    learn_stage(run, data_dir=stage_folders[0][0], train_overrides={"epochs": 1, "batch_size": 12}, device="cpu")
    # what a run learned before this release reads as: the default (a probe block), f_0's statistics
    _rewrite_config(run, lambda c: c["open_set"].update({"probe_depth": 0.64}))
    learn_stage(run, data_dir=stage_folders[1][0], train_overrides={"epochs": 1, "batch_size": 12}, device="cpu")
    model = load_run(run).model
    d = model.network.width
    assert model.open_set_probe is None and model.probes_read == () and model.unknown_rmd[0].means.shape == (6, d)
    weights = st_load((run / "stages" / "002" / "weights.safetensors").read_bytes())
    assert weights[RMD_MEAN].shape == (3, d)
    args = ["eval", "--data", str(stage_folders[0][1]), "--unknown-data", str(stage_folders[2][1]), "--json"]
    out = _json(runner.invoke(app, [*args, "--run", str(run)]))["open_set"]
    assert out["rule"] == "rmd" and out["probe_block"] is None


def test_restoring_rmd_statistics_of_any_shape_gives_a_clean_error(learned):
    """The one loader behind runs and .drl files: a crafted unknown_mean of any rank is the caller's
    fit error naming it, never a crash (a .drl reaches it with only its checksums checked)."""
    from drlcli.model.restore import model_tensors, restore_model
    from drlcli.run.load import load_run

    loaded = load_run(learned)
    model = loaded.model
    for crafted in (torch.tensor(1.0), torch.zeros(6), torch.zeros(6, 3), torch.zeros(6, 2, 64)):
        tensors = {**model_tensors(model), RMD_MEAN: crafted}
        with pytest.raises(ValueError, match=RMD_MEAN):
            restore_model(
                model.network.ptm,
                loaded.config,
                tensors,
                class_names=model.class_names,
                num_stages=model.network.num_stages,
                data_config=model.data_config,
                fit_error=lambda position, exc: exc,
            )


def test_crafted_rmd_statistics_are_refused(learned, stage_folders, tmp_path):
    image = str(sorted((stage_folders[0][1] / "class_00").iterdir())[0])
    crafted = {
        "scatter": (lambda t: t.update({RMD_SCATTER: -100 * torch.eye(t[RMD_SCATTER].shape[0])}), RMD_SCATTER),
        "rows": (lambda t: t.update({RMD_MEAN: t[RMD_MEAN][:2]}), RMD_MEAN),
        "bias": (lambda t: t.update({RMD_BIAS: torch.full((3,), float("nan"))}), RMD_BIAS),
        "counts": (lambda t: t.update({"unknown_count": torch.zeros(3)}), "unknown_count"),
        "width": (lambda t: t.update({RMD_MEAN: torch.zeros(3, 3 * t[RMD_MEAN].shape[1] // 2)}), RMD_MEAN),
    }
    for name, (change, named) in crafted.items():
        run = Path(shutil.copytree(learned, tmp_path / name))
        rewrite_stage_weights(run, 2, change)
        result = runner.invoke(app, ["predict", image, "--run", str(run), "--json"])
        assert result.exit_code == 5, (name, result.stdout)
        assert named in _error(result), name
