"""A switched run (``ranpac --preset switched``, ``run/track.py``): a carried run with the frozen
default learning beside it (its frozen track, files beside the run's in its own stage folders and
manifest, format 5), answering from the track the run's forward transfer picks."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import rewrite_stage_meta
from safetensors.torch import load_file, save
from typer.testing import CliRunner

from drlcli import evaluate, export_run, forget_class, learn_stage, load_model, restore_class
from drlcli.api import info, verify
from drlcli.cli import app
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.errors import IntegrityError, UsageError
from drlcli.metrics import Transfer
from drlcli.run.directory import RunDir
from drlcli.run.layout import sha256_bytes
from drlcli.run.load import load_run
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

SMALL = {
    "ridge": {"proj_dim": 96, "carry_draws": 4, "carry_rank": 3},
    "train": {"epochs": 2, "batch_size": 8, "seed": 3},
}


def _init(run, preset="switched"):
    config = RunConfig.for_method("ranpac", SMALL, preset=preset)
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)


def _track(run):
    """The run's frozen track, as the run reads it."""
    from drlcli.run.track import frozen_track

    own = RunDir(run)
    return frozen_track(own, own.manifest())


def _record_phases(monkeypatch) -> list:
    """The phase of every pass over a stage's images (``begin.embed_stage``, which the feature phase shares)."""
    import drlcli.stage.begin as begin_module
    import drlcli.stage.fit as fit_module

    phases, embed = [], begin_module.embed_stage

    def recorded(*args, phase="prototypes", **kwargs):
        phases.append(phase)
        return embed(*args, phase=phase, **kwargs)

    monkeypatch.setattr(begin_module, "embed_stage", recorded)
    monkeypatch.setattr(fit_module, "embed_stage", recorded)
    return phases


def _learn(run, folders):
    return [learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu") for train, test in folders]


def _transfers(monkeypatch, value: bool, stalls: bool = False) -> None:
    """What the run's forward transfer says, whatever the tiny random PTM's counts are."""
    monkeypatch.setattr(Transfer, "transfers", property(lambda self: value and self.images > 0))
    monkeypatch.setattr(Transfer, "stalls", property(lambda self: stalls and self.images > 0))


@pytest.fixture(scope="module")
def switched(tmp_path_factory, stage_folders):
    """A switched run whose transfer never pays, and the frozen head (`drl --preset frozen`) learning the same stages."""
    root = tmp_path_factory.mktemp("switched")
    run, default = root / "run", root / "default"
    _init(run)
    config = RunConfig.for_method("drl", {"train": {"seed": 3}}, preset="frozen")
    init_run(default, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    with pytest.MonkeyPatch.context() as patch:
        _transfers(patch, False)  # and never stalls: the carried network trains every stage
        results = _learn(run, stage_folders)
    return run, default, results, _learn(default, stage_folders)


def test_the_preset_is_the_carried_schedule_with_the_switch():
    switched = RunConfig.for_method("ranpac", preset="switched").to_dict()
    carried = RunConfig.for_method("ranpac", preset="carried").to_dict()
    assert switched["schedule"].pop("switch") == "transfer" and carried["schedule"].pop("switch") == "none"
    assert switched["schedule"].pop("pause") == "transfer" and carried["schedule"].pop("pause") == "none"
    assert switched == carried
    with pytest.raises(UsageError, match="set schedule.stages all"):
        RunConfig.for_method("ranpac", {"first_session": {"peft": "adaptformer", "switch": "transfer"}})
    with pytest.raises(UsageError, match="set schedule.switch transfer"):
        RunConfig.for_method("ranpac", {"first_session": {"pause": "transfer"}}, preset="carried")


@pytest.mark.parametrize(
    ("counts", "stalls"),
    [
        ((0, 0, 0), False),  # nothing compared yet
        ((0, 0, 60), False),  # two photo classes: too few images to bound the gain under 1 %
        ((0, 0, 722), True),  # the photos' stage 2 in the fourteenth round's replay
        ((3, 0, 325), False),
        ((3, 0, 1590), True),  # the photos' stages 2-4
        ((13, 3, 310), False),  # the sketches' stage 2 (order 1995)
        ((1, 9, 400), True),  # adapting costs
    ],
)
def test_adapting_stalls_when_even_the_gains_upper_bound_is_under_the_floor(counts, stalls):
    transfer = Transfer(*counts)
    assert transfer.stalls is stalls and not (stalls and transfer.transfers)
    assert transfer.ceiling >= transfer.gain


@pytest.mark.parametrize(
    "counts, loses", [((0, 9, 40), True), ((3, 1, 40), False), ((4, 9, 40), False), ((0, 0, 0), False)]
)
def test_adapting_loses_when_more_images_only_the_frozen_ptm_gets_right_than_chance_allows(counts, loses):
    assert Transfer(*counts).loses is loses


def test_until_adapting_transfers_the_run_answers_as_the_frozen_default(switched, stage_folders):
    run, default, results, reference = switched
    assert [r.switch["answers"] for r in results] == ["frozen"] * 3
    assert [r.eval.top1 for r in results] == [r.eval.top1 for r in reference]
    assert [r.switch["top1"]["frozen"] for r in results] == [r.eval.top1 for r in reference]
    assert all(r.switch["top1"]["carried"] is not None for r in results)
    assert all(not r.training_skipped and r.epoch_losses for r in results)  # the carried network still learns
    loaded = load_run(run, device="cpu")
    assert loaded.config.method == "drl" and loaded.run.path == run  # the frozen track's model, the run's records
    assert [m["switch"]["answers"] for m in loaded.stage_metas] == ["frozen"] * 3
    test = stage_folders[2][1]
    ours, theirs = evaluate(run, data_dir=test, device="cpu"), evaluate(default, data_dir=test, device="cpu")
    assert ours.report == theirs.report
    # one manifest: the track's files are the run's, and the track loads as the frozen default
    assert not (run / "frozen" / "manifest.json").exists() and load_run(_track(run), device="cpu").model.num_stages == 3
    assert load_run(_track(run), device="cpu").model.class_names == load_run(default, device="cpu").model.class_names


def test_an_export_of_a_run_answering_from_its_frozen_track_is_the_frozen_default(switched, tmp_path, stage_folders):
    run, default, _, _ = switched
    export_run(run, tmp_path / "ours.drl")
    export_run(default, tmp_path / "theirs.drl")
    ours, theirs = load_model(tmp_path / "ours.drl"), load_model(tmp_path / "theirs.drl")
    assert type(ours.network).__name__ == type(theirs.network).__name__ == "IPANetwork"
    size = ours.data_config["input_size"][1:]
    images = torch.rand(4, 3, *size)
    assert torch.equal(ours.classify(images)[0], theirs.classify(images)[0])


def test_the_run_records_both_tracks_and_their_cost(switched):
    run, _, results, _ = switched
    shown = info(run)
    assert shown["frozen_track"]["num_stages"] == 3 and shown["frozen_track"]["total_bytes"] > 0
    assert [s["switch"]["answers"] for s in shown["stages"]] == ["frozen"] * 3
    metas = load_run(run, device="cpu").stage_metas
    for meta in metas:
        assert meta["metrics"]["learn_seconds"] >= meta["switch"]["frozen_seconds"] > 0
    checked = verify(run)
    assert checked.frozen_track["num_stages"] == 3 and checked.frozen_track["files_checked"] > 0
    from drlcli.benchmark.report import _stage_bytes

    loaded = load_run(run, device="cpu")
    own, track = loaded.run, _track(run)
    both = [own.stage_bytes(i, own.manifest()) + track.stage_bytes(i, track.manifest()) for i in (1, 2, 3)]
    assert _stage_bytes(loaded, RunConfig.for_method("ranpac", SMALL, preset="switched")) == both


def test_once_adapting_transfers_the_carried_network_answers(tmp_path, stage_folders, monkeypatch):
    run = tmp_path / "run"
    _init(run)
    _transfers(monkeypatch, True)
    results = _learn(run, stage_folders[:2])
    assert [r.switch["answers"] for r in results] == ["frozen", "carried"]  # stage 1 has no transfer to measure
    assert results[1].eval.top1 == results[1].switch["top1"]["carried"]
    loaded = load_run(run, device="cpu")
    assert loaded.config.method == "ranpac" and loaded.config.schedule.switch == "transfer"
    assert evaluate(run, all_seen=True, device="cpu").report.top1 == results[1].eval.top1
    export_run(run, tmp_path / "model.drl")
    assert type(load_model(tmp_path / "model.drl").network).__name__ == "AdapterNetwork"


@pytest.mark.parametrize("pause", ["transfer", "none"])
def test_while_adapting_stalls_a_paused_run_keeps_its_carried_network_as_it_stood(
    tmp_path, stage_folders, monkeypatch, pause
):
    run = tmp_path / "run"
    config = RunConfig.for_method("ranpac", {**SMALL, "first_session": {"pause": pause}}, preset="switched")
    assert config.schedule.switch == "transfer" and config.schedule.stages == "all"
    init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    _transfers(monkeypatch, False, stalls=True)
    results = _learn(run, stage_folders[:1])
    sets = [{k: v.clone() for k, v in _carried_set(run).items()}]
    phases = _record_phases(monkeypatch)
    results += _learn(run, stage_folders[1:])
    sets.append(_carried_set(run))
    paused = pause == "transfer"
    # each stage: the frozen track's pass (whose f_0 the transfer reads), the carried network's as
    # the stage began, and the fit's, which a paused stage reads from the one before (nothing moved)
    passes = ["prototypes", "carry"] + ([] if paused else ["prototypes"])
    assert phases == passes * 2
    # stage 2's own forward transfer already says adapting stalls: from it on, no stage trains
    assert [bool(r.epoch_losses) for r in results] == [True, not paused, not paused]
    assert all(r.carry["transfer"]["stalls"] and bool(r.carry.get("paused")) is paused for r in results[1:])
    assert all(torch.equal(sets[0][k], sets[1][k]) for k in sets[0]) is paused
    assert results[2].switch["answers"] == "frozen" and results[2].switch["top1"]["carried"] is not None
    loaded = load_run(run, device="cpu")
    meta = loaded.stage_metas[2]
    assert (meta["metrics"]["train"].get("paused") is True) is paused and (meta["carry"]["move"] == 0) is paused
    # a paused stage reads the sums the stage before kept (no draws); a run that never pauses keeps none
    assert [r.carry["draws"] for r in results[1:]] == ([0, 0] if paused else [4, 4])
    totals = load_run(run, device="cpu", scoring=False).stage_totals[-1]  # the carried run's own
    assert ("q_fit_carried" in totals and "gram_fit" in totals) is paused
    assert not paused or totals["q_fit_carried"].shape[1] == 9
    shown = info(run)
    assert [s["paused"] for s in shown["stages"]] == [False, paused, paused]
    assert verify(run).frozen_track["num_stages"] == 3
    from drlcli.cli import render

    text = render.learn_stage(results[2].to_dict())
    assert ("the carried network was not trained" in text) is paused
    assert ("the head read the sums the stage before kept" in text) is paused
    assert "even its upper bound" in text


def test_a_class_forgotten_before_paused_stages_comes_back(tmp_path, stage_folders, monkeypatch):
    """A paused stage moves none of the carried classes, so a class forgotten before it comes back
    from its kept rows, its Gaussian's directions padded as classes with more joined (stage 1 has 6
    images a class, the later stages 12, carry_rank 8): both tracks then hold what the same run that
    never forgot it holds. Kept rows whose classes would not fit the next learn-stage are refused."""
    first = tmp_path / "first"
    make_class_folders(first / "train", [0, 1, 2], images_per_class=6, seed=5)
    make_class_folders(first / "test", [0, 1, 2], images_per_class=4, seed=6, offset=100)
    never = tmp_path / "never"
    config = RunConfig.for_method("ranpac", {**SMALL, "ridge": {**SMALL["ridge"], "carry_rank": 8}}, preset="switched")
    init_run(never, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    _transfers(monkeypatch, False, stalls=True)  # stages 2 and 3 pause
    _learn(never, [(first / "train", first / "test")])
    run = Path(shutil.copytree(never, tmp_path / "run"))
    name = load_run(run, device="cpu").model.class_names[1]
    forget_class(run, name)
    assert [r.carry.get("paused") for r in _learn(run, stage_folders[1:])] == [True, True]
    _learn(never, stage_folders[1:])
    factor = load_run(run, device="cpu", scoring=False).stage_totals[-1]["ranpac.carry_factor"]
    assert factor.shape[1] == 8  # wider than the 6 directions its stage-1 classes were kept with
    crafted = Path(shutil.copytree(run, tmp_path / "crafted"))
    (rows,) = crafted.glob("forgotten/rows-*.safetensors")
    kept = load_file(str(rows))
    key = next(k for k in kept if k.endswith("/ranpac.carry_rank"))
    data = save(dict(kept, **{key: torch.full_like(kept[key], 99)}))
    rows.write_bytes(data)
    manifest = json.loads((crafted / "manifest.json").read_text())
    manifest["files"][rows.relative_to(crafted).as_posix()] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (crafted / "manifest.json").write_text(json.dumps(manifest))
    before = (crafted / "manifest.json").read_bytes()
    with pytest.raises(IntegrityError, match="the classes it gives back do not fit"):
        restore_class(crafted, name)
    assert (crafted / "manifest.json").read_bytes() == before
    restore_class(run, name)
    for track in ("", "frozen"):
        a, b = (load_run(_track(p) if track else p, device="cpu", scoring=False) for p in (run, never))
        assert a.model.class_names == b.model.class_names and len(a.model.class_names) == 9
        assert a.stage_metas[-1]["ridge"]["lambda"] == b.stage_metas[-1]["ridge"]["lambda"]
        totals, want = a.stage_totals[-1], b.stage_totals[-1]
        assert set(totals) == set(want) and ("q_fit_carried" in totals) is (track == "")
        for key, tensor in want.items():  # W solved again at stage 3's λ; the carried rows as kept
            # (the frozen track's λ is 0.01 on this tiny random PTM: its restored column, solved
            # again from the Grams as stored in float32, is as close as that conditioning allows)
            close = 5e-3 if (track, key) == ("frozen", "ranpac.weight") else 1e-5
            assert torch.allclose(totals[key], tensor, atol=close, rtol=1e-4), (track, key)
    ours, theirs = (evaluate(p, all_seen=True, device="cpu").report for p in (run, never))
    assert ours.top1 == theirs.top1
    make_class_folders(tmp_path / "extra", [9, 10], images_per_class=6, seed=7)
    learn_stage(run, data_dir=tmp_path / "extra", device="cpu")  # the next stage reads the restored classes


def _carried_set(run: Path) -> dict[str, torch.Tensor]:
    """The carried network's adapter set, as the run's newest stage holds it."""
    network = load_run(run, device="cpu", scoring=False).model.network
    assert type(network).__name__ == "AdapterNetwork"
    return network.stages[0].state_dict()


@pytest.mark.parametrize(
    "change",
    [
        lambda meta: meta["switch"].update(answers="carried"),  # not what its counts say
        lambda meta: meta.pop("switch"),
        lambda meta: meta["carry"]["transfer"]["run"].update(better=30, images=99),  # counts that do not add up
        lambda meta: meta.pop("carry"),  # a later stage of a carried run without its forward transfer
    ],
)
def test_a_crafted_switch_record_is_refused(switched, tmp_path, change):
    run = Path(shutil.copytree(switched[0], tmp_path / "copy"))
    rewrite_stage_meta(run, 3, change)
    with pytest.raises(IntegrityError, match="stage 3 of switched run"):
        load_run(run, device="cpu")


def _resign(run: Path, names) -> None:
    """List ``names`` (run-relative) in the run's manifest as they are now, and no other file of the
    frozen track (a crafted run)."""
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["files"] = {n: e for n, e in manifest["files"].items() if "/frozen-" not in n}
    for name in names:
        data = (run / name).read_bytes()
        manifest["files"][name] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (run / "manifest.json").write_text(json.dumps(manifest))


def _track_files(run: Path) -> list[str]:
    """The frozen track's files (format 5: beside the run's, ``frozen-`` names)."""
    return sorted(p.relative_to(run).as_posix() for p in run.rglob("frozen-*"))


def _stand_in(run: Path, source: Path, prefix: str = "") -> list[str]:
    """Replace the run's frozen track's stage files by ``source``'s (``prefix``: their names there)."""
    for name in _track_files(run):
        (run / name).unlink()
    names = []
    for path in sorted((source / "stages").rglob(f"{prefix}*")):
        if path.is_file() and (prefix or not path.name.startswith("frozen-")):
            name = f"stages/{path.parent.name}/frozen-{path.name[len(prefix) :]}"
            shutil.copyfile(path, run / name)
            names.append(name)
    return names


def test_another_run_cannot_stand_in_for_the_frozen_track(switched, tmp_path):
    """The track's files are checked by the run's manifest, and the run's switch records hold the
    sha256 of the track's stage records: another run's files in their place are damage; re-signed
    in the manifest, the frozen default learning the same stages is still refused, and so are the
    run's own files, and a track config of another kind in the run's run.yaml."""
    run, default = (Path(shutil.copytree(p, tmp_path / p.name)) for p in switched[:2])
    names = _stand_in(run, default)
    with pytest.raises(IntegrityError, match="checksum mismatch|is missing|more than the"):
        load_run(run, device="cpu")
    _resign(run, names)
    with pytest.raises(IntegrityError, match="is not the one run"):
        load_run(run, device="cpu")
    with pytest.raises(IntegrityError, match="is not the one run"):
        verify(run)
    _resign(run, _stand_in(run, switched[0]))  # a switched run's own files as its frozen track
    with pytest.raises(IntegrityError, match="is not the one run"):
        load_run(run, device="cpu")
    _resign(run, _stand_in(run, switched[0], "frozen-"))  # its track again, and in run.yaml another one
    load_run(run, device="cpu")
    record = yaml.safe_load((run / "run.yaml").read_text())
    record["frozen_track"]["train"]["seed"] += 1
    (run / "run.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    _resign(run, ["run.yaml", *_track_files(run)])
    with pytest.raises(IntegrityError, match="another config"):
        load_run(run, device="cpu")


def test_a_stage_refused_after_the_frozen_track_learned_it_commits_in_neither(switched, tmp_path):
    """The frozen track commits only once the run's stage is recorded: a call refused later (here a
    training option out of range) leaves both tracks as they were, and other data can follow."""
    run = Path(shutil.copytree(switched[0], tmp_path / "copy"))
    more = make_class_folders(tmp_path / "more", [20, 21], images_per_class=6)
    with pytest.raises(UsageError):
        learn_stage(run, data_dir=more, device="cpu", train_overrides={"lr": -1.0})
    assert len(json.loads((run / "manifest.json").read_text())["stages"]) == 3
    assert _track(run).stage_indices() == [1, 2, 3]
    assert load_run(run, device="cpu").model.num_stages == 3


def test_a_frozen_track_file_that_is_a_link_or_missing_is_refused(switched, tmp_path, stage_folders):
    run = Path(shutil.copytree(switched[0], tmp_path / "copy"))
    name = "stages/002/frozen-weights.safetensors"
    outside = Path(shutil.copyfile(run / name, tmp_path / "outside.safetensors"))
    (run / name).unlink()
    more = make_class_folders(tmp_path / "more", [20, 21], images_per_class=6)
    with pytest.raises(IntegrityError, match="is missing"):
        learn_stage(run, data_dir=more, device="cpu")
    for command in (lambda: load_run(run, device="cpu"), lambda: verify(run), lambda: info(run)):
        with pytest.raises(IntegrityError, match="is missing"):
            command()
    (run / name).symlink_to(outside)
    with pytest.raises(IntegrityError, match="symbolic link"):
        load_run(run, device="cpu")
    assert len(json.loads((run / "manifest.json").read_text())["stages"]) == 3


def test_a_default_run_holds_one_manifest_and_no_nested_run(switched, tmp_path):
    """Format 5: the frozen track's files lie beside the run's in its stage folders (``frozen-``
    names), its run.yaml derived from the run's and its PTM weights the run's; no ``frozen/``
    folder, one manifest, and ``drl verify`` passes (from the CLI too)."""
    run = switched[0]
    assert not (run / "frozen").exists() and [p.name for p in run.rglob("manifest.json")] == ["manifest.json"]
    manifest = RunDir(run).manifest()
    assert manifest["format_version"] == 5
    for index in (1, 2, 3):
        assert f"stages/{index:03d}/frozen-stage.json" in manifest["files"]
    assert not any(name.endswith(".yaml") and name != "run.yaml" for name in manifest["files"])
    assert "frozen_track" in yaml.safe_load((run / "run.yaml").read_text())
    out = CliRunner().invoke(app, ["verify", "--run", str(run)])
    assert out.exit_code == 0, out.output
    track = _track(run)
    assert (
        track.read_bytes("run.yaml")
        and track.manifest()["files"]["ptm.safetensors"] == manifest["files"]["ptm.safetensors"]
    )
    with pytest.raises(IntegrityError, match="no file"):
        track._inside("manifest.json")  # nothing outside its stage and forget files (and the run's PTM)


def test_a_run_listing_its_frozen_track_both_ways_is_refused(switched, tmp_path):
    """Format 5's names and format 4's ``frozen/`` in one manifest: crafted (exit 5), never read as either."""
    run = Path(shutil.copytree(switched[0], tmp_path / "copy"))
    (run / "frozen").mkdir()
    shutil.copyfile(run / "run.yaml", run / "frozen" / "run.yaml")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["files"]["frozen/run.yaml"] = manifest["files"]["run.yaml"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    for command in (lambda: load_run(run, device="cpu"), lambda: verify(run), lambda: info(run)):
        with pytest.raises(IntegrityError, match="lists its frozen track's files twice"):
            command()


def test_forget_and_restore_reach_the_frozen_track(switched, tmp_path):
    run = Path(shutil.copytree(switched[0], tmp_path / "copy"))
    name = load_run(run, device="cpu").model.class_names[4]
    forget_class(run, name)
    assert name not in load_run(run, device="cpu").model.class_names
    assert name not in load_run(_track(run), device="cpu").model.class_names
    restore_class(run, name)
    assert name in load_run(run, device="cpu").model.class_names
    assert name in load_run(_track(run), device="cpu").model.class_names
    forget_class(run, name, purge=True)
    loaded = load_run(run, device="cpu")
    assert name not in loaded.model.class_names and len(loaded.model.class_names) == 8
    assert not any(n.startswith("forgotten/frozen-rows") for n in RunDir(run).manifest()["files"])
    assert any(n.startswith("forgotten/frozen-log") for n in RunDir(run).manifest()["files"])


def test_the_cli_says_which_track_answers(tmp_path, stage_folders, monkeypatch):
    run = tmp_path / "run"
    _init(run)
    _transfers(monkeypatch, False)
    runner = CliRunner()
    train, test = stage_folders[0]
    out = runner.invoke(
        app, ["learn-stage", "--run", str(run), "--data", str(train), "--eval-data", str(test), "--device", "cpu"]
    )
    assert out.exit_code == 0, out.output
    assert "the run answers from its frozen track" in out.output
    shown = runner.invoke(app, ["info", "--run", str(run)])
    assert "frozen track" in shown.output and "1 stages" in shown.output


def test_a_carried_run_has_no_frozen_track(tmp_path, stage_folders):
    run = tmp_path / "run"
    _init(run, preset="carried")
    _learn(run, stage_folders[:1])
    assert not (run / "frozen").exists() and info(run)["frozen_track"] is None
    assert "switch" not in load_run(run, device="cpu").stage_metas[0]
    assert torch.is_tensor(load_run(run, device="cpu").model.class_stage)


def test_the_transfer_reads_the_frozen_tracks_f0_as_a_carried_run_reads_its_own_pass(switched, tmp_path, stage_folders):
    """A switched run's forward transfer takes the frozen PTM's f_0 from its frozen track's pass (no
    pass of its own); a carried run learning the same stages passes the frozen PTM itself. The counts agree."""
    run = tmp_path / "carried"
    _init(run, preset="carried")
    carried = _learn(run, stage_folders)
    counts = ("better", "worse", "images")
    for own, theirs in zip(switched[2][1:], carried[1:]):
        assert [own.carry["transfer"][k] for k in counts] == [theirs.carry["transfer"][k] for k in counts]
        assert own.carry["move"] == pytest.approx(theirs.carry["move"])


def test_a_paused_stage_takes_each_process_share_of_the_rows_it_began_with():
    """Under torchrun a paused stage's fit reads this process's shard of the rows the pass before
    training gathered in image order (``fit._own_share``), labels alike."""
    from types import SimpleNamespace

    from drlcli.stage.context import Began
    from drlcli.stage.fit import _own_share

    rows, rmd = torch.arange(10.0).view(5, 1, 2), torch.arange(5.0).view(5, 1)
    began = Began(rows, rmd, {}, True, 0.0)
    stage = SimpleNamespace(images=SimpleNamespace(labels=(0, 1, 0, 2, 1)))
    feats, rmd_feats, labels = _own_share(began, stage, [1, 3])
    assert torch.equal(feats, rows[[1, 3]]) and torch.equal(rmd_feats, rmd[[1, 3]]) and labels.tolist() == [1, 2]
    whole = _own_share(began, stage, None)
    assert whole[0] is rows and whole[2].dtype == torch.long and whole[2].tolist() == [0, 1, 0, 2, 1]


def test_the_transfer_passes_itself_when_the_frozen_track_listed_other_images(tmp_path, stage_folders, monkeypatch):
    """The frozen track's f_0 stands in for the run's own pass only for the very images the run lists
    (its data's fingerprint); a folder that changed between the two listings makes the run pass them."""
    import itertools

    from drlcli.data.images import ImageSet

    run = tmp_path / "run"
    _init(run)
    _transfers(monkeypatch, False)
    _learn(run, stage_folders[:1])
    phases = _record_phases(monkeypatch)
    listing = itertools.count()
    monkeypatch.setattr(ImageSet, "fingerprint", lambda self: f"listing {next(listing)}")
    result = _learn(run, stage_folders[1:2])[0]
    assert "transfer" in phases and result.carry["transfer"]["images"] > 0


class _Interrupt(Exception):
    pass


def test_a_resumed_stage_does_not_learn_the_frozen_track_again(tmp_path, stage_folders, monkeypatch):
    """The frozen track's stage rides in the interrupted stage's epoch checkpoint (checksummed with
    it): the resumed call commits it as learned, without the track's pass, and answers as a call
    that was never interrupted."""
    run, straight = tmp_path / "run", tmp_path / "straight"
    _init(run)
    _init(straight)
    _transfers(monkeypatch, False)
    train, test = stage_folders[0]

    def stop_in_the_second_epoch(event):
        if event.phase == "train" and event.epoch == 2:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu", progress=stop_in_the_second_epoch)
    events = []
    result = learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu", progress=events.append)
    assert result.resumed_from_epoch == 1
    assert not [e for e in events if (e.detail or "").startswith("frozen track")]  # no pass of the track
    reference = learn_stage(straight, data_dir=train, eval_data_dir=test, device="cpu")
    assert result.switch["top1"] == reference.switch["top1"] and result.eval == reference.eval
    verify(run)
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ours, theirs = (load_run(p, device="cpu").model.classify(images)[0] for p in (run, straight))
    assert torch.equal(ours, theirs)
    assert (
        load_run(_track(run), device="cpu").model.class_names
        == load_run(_track(straight), device="cpu").model.class_names
    )
