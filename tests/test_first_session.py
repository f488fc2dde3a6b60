"""RanPAC as published (``ranpac --preset published``): stage 1 trains AdaptFormer adapters inside the
PTM with cross-entropy, later stages add no network, and every answer reads the adapted PTM."""

import pytest
import torch
from typer.testing import CliRunner

from drlcli import evaluate, export_run, forget_class, learn_stage, load_model, restore_class
from drlcli.api import info, predict_sources
from drlcli.cli import app
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.errors import UsageError
from drlcli.features.adapter import AdapterConfig
from drlcli.features.adapter.network import AdapterNetwork
from drlcli.features.ease import EaseConfig
from drlcli.features.ease.network import EaseNetwork
from drlcli.methods import get_method
from drlcli.run.load import load_run
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

SMALL = {"ridge": {"proj_dim": 96}, "train": {"epochs": 2, "batch_size": 8}}


@pytest.fixture(scope="module")
def published_run(tmp_path_factory, stage_folders):
    run = tmp_path_factory.mktemp("published") / "run"
    config = RunConfig.for_method("ranpac", SMALL, preset="published")
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    results = [learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu") for train, test in stage_folders[:3]]
    return run, results


def test_the_preset_is_ranpacs_first_session_recipe():
    config = RunConfig.for_method("ranpac", preset="published")
    assert config.adapter.peft == "adaptformer" and config.adapter.adapter_dim == 64
    train = config.train
    assert (train.loss, train.epochs, train.lr, train.batch_size, train.kd_weight) == ("ce", 20, 0.01, 48, 0.0)
    assert RunConfig.for_method("ranpac").adapter.peft == "none"  # RanPAC without its first phase


def test_stage_one_alone_is_trained_and_stored(published_run):
    run, results = published_run
    assert [r.training_skipped for r in results] == [False, True, True]
    assert (
        len(results[0].epoch_losses) == 2
        and results[0].num_params == AdapterNetwork(_tiny_ptm(), AdapterConfig()).new_stage(seed=0).num_params()
    )
    assert "adapts the PTM in stage 1 only" in results[1].skipped_because
    loaded = load_run(run, device="cpu")
    network = loaded.model.network
    assert isinstance(network, AdapterNetwork) and network.num_stages == 1
    assert network.stages[0].up.abs().sum() > 0  # trained: Up starts at zero
    metas = loaded.stage_metas
    assert sorted(metas[0]) == sorted(metas[1])  # the same record shape for a trained and an untrained stage
    assert metas[0]["train"]["loss"] == "ce" and metas[1]["train"] is None and metas[2]["train"] is None
    assert [s["num_params"] for s in info(run)["stages"]][0] == results[0].num_params


def test_the_adapted_pass_is_adaptformer_and_the_head_reads_it(published_run, images):
    run, _ = published_run
    model = load_run(run, device="cpu").model
    network = model.network
    ease = EaseNetwork(network.ptm, EaseConfig(adapter_dim=64, scale=0.1))
    ease.stages.append(network.stages[0])
    with torch.no_grad():
        adapted = network(images)
        bare = AdapterNetwork(network.ptm, AdapterConfig())(images)
        assert adapted.shape == (len(images), 2, network.width)
        torch.testing.assert_close(adapted[:, 0], ease(images)[:, 0])
        torch.testing.assert_close(adapted[:, 1], adapted[:, 0])  # stage 1's subspace is the same feature
        assert not torch.allclose(adapted[:, 0], bare[:, 0], atol=1e-4)
        # the head scores the adapted feature: the model's features are the network's f_0
        torch.testing.assert_close(model.features(images)[:, 0], adapted[:, 0])


def test_eval_export_predict_and_forget(published_run, stage_folders, tmp_path):
    run, _ = published_run
    assert evaluate(run, all_seen=True, device="cpu").report.num_images == 9 * 4
    pictures = sorted(str(p) for p in stage_folders[1][1].rglob("*.png"))
    from_run = _answers(predict_sources(pictures, run_dir=run, device="cpu"))
    for name in ("m.drl", "m.onnx"):
        export_run(run, tmp_path / name)
        assert _answers(predict_sources(pictures, model_path=tmp_path / name, device="cpu")) == from_run
    assert load_model(tmp_path / "m.drl").class_names == sum((s["classes"] for s in info(run)["stages"]), [])
    name = info(run)["stages"][1]["classes"][0]
    forget_class(run, name)
    assert name not in load_model(export_run(run, tmp_path / "after.drl").path).class_names
    restore_class(run, name)
    assert _answers(predict_sources(pictures, run_dir=run, device="cpu")) == from_run


def test_plain_ranpac_trains_and_stores_no_network(tmp_path, stage_folders):
    run = tmp_path / "run"
    init_run(
        run,
        ptm=TINY_PTM,
        random_init=True,
        ptm_kwargs=TINY_PTM_KWARGS,
        config=RunConfig.for_method("ranpac", {"ridge": {"proj_dim": 96}}),
    )
    result = learn_stage(run, data_dir=stage_folders[0][0], device="cpu")
    assert result.training_skipped and "trains none" in result.skipped_because
    tensors = load_run(run, device="cpu").stage_tensors[0]
    assert not [k for k in tensors if k.startswith(get_method("ranpac").tensor_prefix)]


@pytest.mark.parametrize(
    "sections, problem",
    [
        ({"first_session": {"peft": "adaptformer"}, "train": {"kd_weight": 0.5}}, "train.kd_weight must be 0"),
        ({"first_session": {"peft": "ssf"}}, "adapter.peft must be one of"),
        ({"first_session": {"peft": "adaptformer", "blocks": 0.0}}, "adapter.blocks must be"),
        ({"first_session": {"peft": "adaptformer", "blocks": 1.5}}, "adapter.blocks must be"),
        ({"first_session": {"stages": "all"}}, "schedule.stages all trains the adapter set"),
    ],
)
def test_first_session_options_are_checked(sections, problem):
    from drlcli.config import validate

    with pytest.raises(UsageError, match=problem):
        validate(RunConfig.for_method("ranpac", sections))


def test_leading_blocks_only_are_adapted_as_a_full_set_with_zero_adapters_after_them(images):
    ptm = _tiny_ptm().eval()  # 4 blocks
    half = AdapterNetwork(ptm, AdapterConfig(blocks=0.5, dropout=0.0))
    full = AdapterNetwork(ptm, AdapterConfig(dropout=0.0))
    assert half.adapted_blocks == 2 and AdapterNetwork(ptm, AdapterConfig(blocks=0.01)).adapted_blocks == 1
    lead, every = half.new_stage(seed=3), full.new_stage(seed=3)
    assert lead.down.shape[0] == 2 and every.down.shape[0] == 4
    with torch.no_grad():
        for p in lead.parameters():
            p.normal_(0.0, 0.5)
        for name, p in every.named_parameters():
            p.zero_()
            p[:2] = getattr(lead, name)
        torch.testing.assert_close(half(images), full(images))
        assert not torch.allclose(half(images), AdapterNetwork(ptm, AdapterConfig())(images), atol=1e-4)


def test_a_run_with_half_the_blocks_adapted_stores_and_reloads_them(tmp_path, stage_folders, images):
    run = tmp_path / "run"
    sections = {**SMALL, "first_session": {"blocks": 0.5}}
    config = RunConfig.for_method("ranpac", sections, preset="published")
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    result = learn_stage(run, data_dir=stage_folders[0][0], device="cpu")
    assert result.num_params == AdapterNetwork(_tiny_ptm(), AdapterConfig(blocks=0.5)).new_stage(seed=0).num_params()
    model = load_run(run, device="cpu").model
    assert model.network.stages[0].up.shape[0] == 2 and model.network.stages[0].up.abs().sum() > 0
    assert "blocks: 0.5" in (run / "run.yaml").read_text()


def test_cli_init_preset_published(tmp_path):
    args = ["--ptm", TINY_PTM] + [a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")]
    run = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["init", "--run", str(run), *args, "--random-init", "--method", "ranpac", "--preset", "published"]
    )
    assert result.exit_code == 0, result.output
    assert "peft: adaptformer" in (run / "run.yaml").read_text()


def _answers(predictions):
    """Each image's ranked classes (an export's scores may differ in the last digit)."""
    return [[c["class"] for c in p.top] for p in predictions]


def _tiny_ptm():
    from drlcli.ptm.backbone import PTMSource, create_ptm

    return create_ptm(TINY_PTM, source=PTMSource(random_init=True), kwargs=TINY_PTM_KWARGS)


@pytest.mark.parametrize("keeps", [True, False])
def test_decide_keeps_the_adapters_only_when_they_win(tmp_path, stage_folders, monkeypatch, keeps):
    from drlcli.stage import decide as first_session

    seen = {}
    decide = first_session.decide

    def spy(stage, head, adapted, frozen, labels):
        found = decide(stage, head, adapted, frozen, labels)
        seen["decision"] = found
        return first_session.Decision(100.0 if keeps else 0.0, 50.0, found.held_out)

    monkeypatch.setattr("drlcli.stage.fit.decide", spy)
    run = tmp_path / "run"
    sections = {**SMALL, "first_session": {"decide": True}}
    config = RunConfig.for_method("ranpac", sections, preset="published")
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    result = learn_stage(run, data_dir=stage_folders[0][0], device="cpu")
    found = seen["decision"]
    assert 0 <= found.adapted <= 100 and 0 <= found.frozen <= 100 and found.held_out == 6  # 2 of 12 per class
    assert result.first_session["kept"] == ("adapted" if keeps else "frozen")
    assert info(run)["stages"][0]["first_session"] == result.first_session
    loaded = load_run(run, device="cpu")
    stored = [k for k in loaded.stage_tensors[0] if k.startswith("adapt.")]
    assert bool(stored) == keeps and loaded.model.network.num_stages == int(keeps)
    if keeps:
        return
    # the frozen PTM kept: the same answers as RanPAC without a first session
    plain = tmp_path / "plain"
    init_run(
        plain,
        ptm=TINY_PTM,
        random_init=True,
        ptm_kwargs=TINY_PTM_KWARGS,
        config=RunConfig.for_method("ranpac", {"ridge": {"proj_dim": 96}}),
    )
    learn_stage(plain, data_dir=stage_folders[0][0], device="cpu")
    pictures = sorted(str(p) for p in stage_folders[0][1].rglob("*.png"))
    assert _answers(predict_sources(pictures, run_dir=run, device="cpu")) == _answers(
        predict_sources(pictures, run_dir=plain, device="cpu")
    )
    learn_stage(run, data_dir=stage_folders[1][0], device="cpu")  # later stages add nothing either way
    assert load_run(run, device="cpu").model.network.num_stages == 0


def test_deciding_trains_on_the_fit_part_only(tmp_path, stage_folders, monkeypatch):
    from drlcli.stage import resume

    trained_on = []
    real = resume.train_stage
    monkeypatch.setattr(
        resume,
        "train_stage",
        lambda network, images, *a, **k: trained_on.append(images) or real(network, images, *a, **k),
    )
    run = tmp_path / "run"
    config = RunConfig.for_method("ranpac", {**SMALL, "first_session": {"decide": True}}, preset="published")
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    result = learn_stage(run, data_dir=stage_folders[0][0], device="cpu")
    images = trained_on[0]
    assert len(images) == 36 - result.first_session["held_out"]
    assert images.class_names == tuple(info(run)["stages"][0]["classes"])


@pytest.mark.parametrize(
    "crafted",
    [
        {"kept": "both", "adapted_top1": 1.0, "frozen_top1": 2.0, "held_out": 3},
        {"kept": "frozen", "adapted_top1": "x", "frozen_top1": 2.0, "held_out": 3},
        {"kept": "frozen", "adapted_top1": 1.0, "frozen_top1": 1e9, "held_out": 3},
        {"kept": "adapted", "adapted_top1": 1.0, "frozen_top1": 2.0, "held_out": True},
        [1, 2],
    ],
)
def test_a_crafted_first_session_record_is_read_as_none(crafted):
    from drlcli.run.records import first_session_record

    assert first_session_record({"first_session": crafted}) is None
    good = {"kept": "adapted", "adapted_top1": 91, "frozen_top1": 90.5, "held_out": 12}
    assert first_session_record({"first_session": good})["adapted_top1"] == 91.0


def test_a_reopened_set_learns_again_held_near_where_it_began(images):
    """schedule.stages all (a carried run's network): new_stage reopens the one set and keeps a
    frozen copy of it as it began; forward_train adds hold_weight times the read tokens' move from it."""
    from drlcli.features.adapter.network import hold_loss

    ptm = _tiny_ptm().eval()
    network = AdapterNetwork(ptm, AdapterConfig(dropout=0.0), carried=True, hold_weight=2.0, read_grid=2)
    stage = network.new_stage(seed=0)
    assert network.start is None and len(network.forward_train(images)) == 2  # stage 1: no hold term
    with torch.no_grad():
        stage.up.normal_(0.0, 0.3)
    stage.requires_grad_(False)  # as train_stage leaves it
    again = network.new_stage(seed=1)
    assert again is stage and network.num_stages == 1 and all(p.requires_grad for p in stage.parameters())
    assert network.start is not stage and not any(p.requires_grad for p in network.start.parameters())
    assert not any(k.startswith("start") for k in network.state_dict())  # never stored or exported
    _, feature, term = network.forward_train(images)
    assert term.item() == 0.0  # nothing moved yet
    with torch.no_grad():
        before = network(images, layout=2)  # the set as the stage began
        stage.up.add_(0.1)
        began = network(images, layout=2)
        assert not torch.allclose(began, before)
    _, _, term = network.forward_train(images)
    after_tokens, start_tokens = began[:, [0, 2, 3, 4, 5]], before[:, [0, 2, 3, 4, 5]]
    torch.testing.assert_close(term, 2.0 * hold_loss(after_tokens, start_tokens), rtol=1e-4, atol=1e-6)
    term.backward()
    assert stage.up.grad is not None and network.start.up.grad is None
    network.drop_start()
    assert network.start is None and len(network.forward_train(images)) == 2


def moved_since_the_stage_began(adapter: AdapterConfig | None = None, **options) -> AdapterNetwork:
    """A carried network reopened at stage 2 (hold weight 2 unless ``options`` say), its set moved since the
    stage began."""
    adapter = adapter or AdapterConfig(dropout=0.0)
    network = AdapterNetwork(_tiny_ptm().eval(), adapter, carried=True, **{"hold_weight": 2.0, **options})
    stage = network.new_stage(seed=0)
    stage.requires_grad_(False)
    network.new_stage(seed=1)
    with torch.no_grad():
        stage.up.normal_(0.0, 0.3)
    return network


def test_the_hold_reads_a_share_of_the_batch(images):
    """hold_share: the hold term of the batch's leading images only, equal to the term of a batch of
    just them; the starting set passes only those (its forward is counted in the stage's passes)."""
    network = moved_since_the_stage_began(hold_share=0.5)
    assert [network.held(b) for b in (1, 2, 3, 48)] == [1, 1, 2, 24]
    calls = []
    real = network._pass

    def counted(batch, probes, stage=None, kept=None):
        calls.append((len(batch), stage is network.start))
        return real(batch, probes, stage=stage, kept=kept)

    network._pass = counted
    _, _, term = network.forward_train(images)
    k = network.held(len(images))
    assert calls == [(len(images), False), (k, True)]
    network._pass, network.hold_share = real, 1.0
    _, _, alone = network.forward_train(images[:k])  # the whole of a batch of just them
    torch.testing.assert_close(term, alone)
    assert term.item() > 0


def test_the_hold_s_share_under_torchrun_is_the_one_process_s(monkeypatch):
    """K processes each hold positions r, r+K, ... of the global batch: the mean of their weighted hold
    terms (their gradients are averaged) is the one process's term, at K 2, 3 and 4."""
    from drlcli import distributed

    network = moved_since_the_stage_began(hold_share=0.25)
    batch = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(1))  # the one process holds 3
    one = network.forward_train(batch)[2]
    for world in (2, 3, 4):
        monkeypatch.setattr(distributed, "world_size", lambda w=world: w)
        terms, held = [], []
        for rank in range(world):
            monkeypatch.setattr(distributed, "rank", lambda r=rank: r)
            terms.append(network.forward_train(batch[rank::world])[2])
            held.append(network.held_rows(12 // world)[0])
        torch.testing.assert_close(sum(terms) / world, one)
        assert sum(held) == network.held(12) == 3


def test_hold_loss_by_hand():
    from drlcli.features.adapter.network import hold_loss

    target = torch.tensor([[[3.0, 4.0]], [[1.0, 0.0]]])  # ‖t₀‖² 25 and 1
    tokens = torch.tensor([[[3.0, 5.0]], [[1.0, 0.0]]])  # moved by 1 and 0
    assert hold_loss(tokens, target).item() == pytest.approx((1 / 25 + 0) / 2)
