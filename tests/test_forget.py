"""``drl forget`` (issue 19, part 4), through the CLI: a forgotten class never comes out of eval,
predict or a later export; restore brings back exactly the scores of before; ``--purge`` keeps
nothing and refuses restore; later stages work around it; a crash at any storage call of its
commit leaves the old state or the new one; a crafted forget log is refused (exit 5)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_crash_points import Crash, FailAt  # the storage fault injector of the learn-stage crash points
from typer.testing import CliRunner

from drlcli.api import verify
from drlcli.cli import app
from drlcli.commands.forget import forget_class
from drlcli.errors import RunStateError, StorageError
from drlcli.run.directory import RunDir
from drlcli.run.load import load_run
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

runner = CliRunner()
TINY_ARGS = ["--ptm", TINY_PTM] + [a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")]
FAST = ["--epochs", "1", "--batch-size", "12", "--device", "cpu"]
GONE = "class_01"  # a class of stage 1


def drl(*args):
    return runner.invoke(app, [str(a) for a in args])


def drl_json(*args):
    result = drl(*args, "--json")
    return result, json.loads(result.stdout.strip().splitlines()[-1])


def _make_run(root: Path, stage_folders, config: str | None, preset: str | None = None) -> Path:
    run = root / "run"
    args = ["init", "--run", run, *TINY_ARGS, "--random-init", "--preset", preset or "frozen"]
    if config is not None:
        (root / "config.yaml").write_text(config)
        args += ["--config", root / "config.yaml"]
    assert drl(*args).exit_code == 0
    for train, test in stage_folders[:2]:
        result = drl("learn-stage", "--run", run, "--data", train, "--eval-data", test, *FAST)
        assert result.exit_code == 0, result.stderr
    return run


@pytest.fixture(scope="module")
def ridge_run(tmp_path_factory, stage_folders) -> Path:
    """The default drl (ridge head: Q in each stage's statistics, W in the newest's totals), a narrow
    projection; 2 stages."""
    return _make_run(tmp_path_factory.mktemp("forget-ridge"), stage_folders, "ridge: {proj_dim: 64}\n")


@pytest.fixture(scope="module")
def proto_run(tmp_path_factory, stage_folders) -> Path:
    """drl --preset paper: prototype scoring over trained stage subspaces (synthesised prototypes)."""
    return _make_run(tmp_path_factory.mktemp("forget-proto"), stage_folders, None, preset="paper")


@pytest.fixture(params=["ridge", "prototypes"])
def any_run(request, tmp_path) -> Path:
    source = request.getfixturevalue("ridge_run" if request.param == "ridge" else "proto_run")
    return shutil.copytree(source, tmp_path / f"{request.param}-run")  # the depth of the registered eval paths


@pytest.fixture
def run(ridge_run, tmp_path) -> Path:
    return shutil.copytree(ridge_run, tmp_path / "run")


def _predict(target: list, images: list[Path]) -> list[dict]:
    result = drl("predict", *target, *images, "--top-k", "9", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def _classes_out(predictions: list[dict]) -> set[str]:
    return {t["class"] for p in predictions for t in p["top"]}


def _all_tensors(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every stage's weights and statistics, by stage index and file kind (names as listed now)."""
    run = RunDir(path)
    return {
        index: {"weights": run.stage(index).tensors, "statistics": run.stage_statistics(index)}
        for index in run.stage_indices()
    }


def _same_tensors(a, b) -> bool:
    return a.keys() == b.keys() and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for i in a
        for x, y in ((a[i]["weights"], b[i]["weights"]), (a[i]["statistics"], b[i]["statistics"]))
    )


def _files(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and ".quarantine" not in p.parts}


# ------------------------------------------------------------------------ the answers


def test_forget_takes_the_class_out_of_eval_predict_and_exports(any_run, stage_folders, tmp_path):
    run = any_run
    images = sorted((stage_folders[0][1] / GONE).glob("*.png")) + sorted((stage_folders[1][1]).rglob("*.png"))[:2]
    before_export = tmp_path / "before.drl"
    assert drl("export", "--run", run, "--out", before_export).exit_code == 0
    assert GONE in _classes_out(_predict(["--run", run], images))

    result, out = drl_json("forget", "--run", run, "--class", GONE, "--reason", "wrong label")
    assert result.exit_code == 0, result.stderr
    assert (out["ok"], out["action"], out["class"], out["stage"], out["reason"]) == (
        True,
        "forget",
        GONE,
        1,
        "wrong label",
    )
    assert out["kept"] and out["num_classes"] == 5 and out["forgotten"] == [GONE] and out["at"].endswith("Z")
    assert out["generation"] == 4 and "forgotten/rows-g000004.safetensors" in out["files"]

    _, ev = drl_json("eval", "--run", run, "--all-seen", "--device", "cpu", "--confusions", "50")
    assert ev["ok"], ev
    assert ev["num_classes"] == 5 and ev["accuracy"]["num_images"] == 20  # its 4 test images are left out
    assert all(GONE not in (c["true"], c["predicted"]) for c in ev["confused"])
    result = drl("eval", "--run", run, "--data", stage_folders[0][1], "--device", "cpu")
    assert result.exit_code == 3 and GONE in result.stderr  # a folder with it is not a folder of learned classes
    assert GONE not in _classes_out(_predict(["--run", run], images))

    # the graphs once (slow to write); the ridge head is the default
    formats = ["m.drl"] + (["m.pt"] + (["m.onnx"] if _has_onnx() else []) if run.name == "ridge-run" else [])
    for name in formats:
        result, ex = drl_json("export", "--run", run, "--out", tmp_path / name)
        assert result.exit_code == 0 and ex["num_classes"] == 5, result.stderr
        trust = ["--trust-code"] if name.endswith(".pt") else []
        assert GONE not in _classes_out(_predict(["--model", tmp_path / name, *trust], images)), name
    assert GONE in _classes_out(_predict(["--model", before_export], images))  # made before: unchanged

    _, info = drl_json("info", "--run", run)
    assert info["num_classes"] == 5 and info["stages"][0]["classes"] == ["class_00", GONE, "class_02"]  # as learned
    assert info["stages"][0]["num_classes"] == 2 and info["stages"][0]["forgotten"] == [GONE]
    assert info["format_version"] == 3  # the newest stage carries the run's totals (format 3 since they came)
    (entry,) = info["forgotten"]
    assert (entry["class"], entry["stage"], entry["reason"], entry["kept"]) == (GONE, 1, "wrong label", True)
    assert [e["action"] for e in info["forget_history"]] == ["forget"]
    text = drl("info", "--run", run).stdout
    assert f"forgotten: '{GONE}' of stage 1 at {entry['at']} (wrong label); restorable" in text
    result, verified = drl_json("verify", "--run", run)
    assert result.exit_code == 0 and verified["generation"] == 4


def ev_classes(run: Path) -> list[str]:
    return load_run(run, device="cpu").model.class_names


def _has_onnx() -> bool:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def test_forget_then_restore_gives_back_identical_scores_and_files(any_run, stage_folders):
    run = any_run
    images = sorted(stage_folders[0][1].rglob("*.png"))[:6]
    before, tensors = _predict(["--run", run], images), _all_tensors(run)
    assert drl("forget", "--run", run, "--class", GONE).exit_code == 0
    assert _predict(["--run", run], images) != before
    result, out = drl_json("forget", "--run", run, "--restore", GONE, "--reason", "label was right")
    assert result.exit_code == 0, result.stderr
    assert (out["action"], out["class"], out["num_classes"], out["forgotten"]) == ("restore", GONE, 6, [])
    assert _predict(["--run", run], images) == before  # every score, to the last printed digit
    assert _same_tensors(_all_tensors(run), tensors)  # bit for bit
    assert not any(name.startswith("forgotten/rows") for name in _files(run))  # restored rows are not kept twice
    _, info = drl_json("info", "--run", run)
    assert info["forgotten"] == [] and [e["action"] for e in info["forget_history"]] == ["forget", "restore"]
    assert info["forget_history"][1]["reason"] == "label was right"


# ------------------------------------------------------------------------------- purge


def test_purge_keeps_nothing_and_restore_is_refused(run):
    old = _files(run)
    result, out = drl_json("forget", "--run", run, "--class", GONE, "--purge", "--reason", "deletion request")
    assert result.exit_code == 0 and out["action"] == "forget" and out["kept"] is False
    files = _files(run)
    assert not any(name.startswith("forgotten/rows") for name in files)
    superseded = {  # its rows in stage 1's weights and statistics, its column of W in stage 2's totals
        "stages/001/weights.safetensors",
        "stages/001/statistics.safetensors",
        "stages/002/totals.safetensors",
    }
    assert superseded <= old and not superseded & files  # the files that held its slices are deleted
    assert json.loads((run / "manifest.json").read_text())["superseded"] == sorted(superseded)
    result, err = drl_json("forget", "--run", run, "--restore", GONE)
    assert result.exit_code == 7 and "nothing of it was kept, so it cannot be restored" in err["error"]["message"]
    result, err = drl_json("forget", "--run", run, "--class", GONE, "--purge")
    assert result.exit_code == 7 and "already forgotten and purged" in err["error"]["message"]
    assert "forgotten: 'class_01' of stage 1" in drl("info", "--run", run).stdout
    assert "; purged" in drl("info", "--run", run).stdout


def test_purge_of_a_class_forgotten_before_deletes_what_was_kept(run):
    assert drl("forget", "--run", run, "--class", GONE).exit_code == 0
    assert "forgotten/rows-g000004.safetensors" in _files(run)
    result, out = drl_json("forget", "--run", run, "--class", GONE, "--purge")
    assert result.exit_code == 0 and out["action"] == "purge" and out["kept"] is False
    assert not any(name.startswith("forgotten/rows") for name in _files(run))
    assert drl("forget", "--run", run, "--restore", GONE).exit_code == 7
    _, info = drl_json("info", "--run", run)
    assert [(e["action"], e["kept"]) for e in info["forget_history"]] == [("forget", True), ("purge", False)]
    assert "its slices are kept" in drl("forget", "--run", run, "--class", "class_02").stdout
    text = drl("forget", "--run", run, "--class", "class_02", "--purge").stdout
    assert text.startswith("purged what was kept of forgotten class 'class_02' (stage 1)")


# -------------------------------------------------------------------------- later stages


def test_later_stages_learn_around_a_forgotten_class_and_may_learn_it_again(run, stage_folders, tmp_path):
    assert drl("forget", "--run", run, "--class", GONE).exit_code == 0
    result, out = drl_json("learn-stage", "--run", run, "--data", stage_folders[0][0], *FAST)
    assert result.exit_code == 0 and out["status"] == "unchanged"  # the same drop again: not new, not relearned
    result, out = drl_json(
        "learn-stage", "--run", run, "--data", stage_folders[2][0], "--eval-data", stage_folders[2][1], *FAST
    )
    assert result.exit_code == 0 and out["stage"] == 3 and out["eval"]["num_images"] == 32, result.stderr
    assert GONE not in ev_classes(run) and len(ev_classes(run)) == 8
    # stage 3's W was solved without it; a restore solves its column again at stage 3's λ
    result, out = drl_json("forget", "--run", run, "--restore", GONE)
    assert result.exit_code == 0 and out["num_classes"] == 9
    assert ev_classes(run)[1] == GONE

    # a wrong label fixed with new images: forgotten, then learned again by a later stage
    assert drl("forget", "--run", run, "--class", GONE, "--reason", "mislabelled").exit_code == 0
    fixed = make_class_folders(tmp_path / "fixed", [1], images_per_class=6, offset=40)
    result, out = drl_json("learn-stage", "--run", run, "--data", fixed, *FAST)  # one class: a stage of its own
    assert result.exit_code == 0 and out["stage"] == 4 and out["classes"] == [GONE], result.stderr
    model = load_run(run, device="cpu").model
    assert model.class_names.count(GONE) == 1 and int(model.class_stage[model.class_names.index(GONE)]) == 4
    result, err = drl_json("forget", "--run", run, "--restore", GONE)
    assert result.exit_code == 7 and "learned again in stage 4" in err["error"]["message"]
    active = make_class_folders(tmp_path / "active", [0], images_per_class=4, offset=40)  # new images, active class
    result, err = drl_json("learn-stage", "--run", run, "--data", active, *FAST)
    assert result.exit_code == 3 and "'class_00' in --data was already learned in stage 1" in err["error"]["message"]
    # the new one may be forgotten too, leaving stage 4 without a class: exports still load
    assert drl("forget", "--run", run, "--class", GONE).exit_code == 0
    assert drl("export", "--run", run, "--out", tmp_path / "m.drl").exit_code == 0
    assert GONE not in _classes_out(_predict(["--model", tmp_path / "m.drl"], sorted(fixed.rglob("*.png"))))
    assert drl("verify", "--run", run).exit_code == 0


def test_restore_after_a_later_stage_matches_a_run_that_never_forgot(ridge_run, stage_folders, tmp_path):
    never = shutil.copytree(ridge_run, tmp_path / "never")
    run = shutil.copytree(ridge_run, tmp_path / "run")
    assert drl("forget", "--run", run, "--class", "class_04").exit_code == 0
    for target in (never, run):
        args = ["learn-stage", "--run", target, "--data", stage_folders[2][0], *FAST]
        assert drl(*args).exit_code == 0
    assert drl("forget", "--run", run, "--restore", "class_04").exit_code == 0
    a, b = RunDir(run), RunDir(never)
    if a.stage_meta(3)["ridge"]["lambda"] != b.stage_meta(3)["ridge"]["lambda"]:
        pytest.skip("stage 3 chose another λ without the class's validation targets")
    w_a, w_b = a.stage(3).merged["ranpac.weight"], b.stage(3).merged["ranpac.weight"]
    assert w_a.shape == w_b.shape and torch.allclose(w_a, w_b, atol=1e-5, rtol=1e-4)
    assert all(torch.equal(a.stage(i).tensors[k], v) for i in (1, 2) for k, v in b.stage(i).tensors.items())
    assert torch.equal(a.stage_statistics(2)["q_fit"], b.stage_statistics(2)["q_fit"])


# ------------------------------------------------------------------------------ errors


def test_errors_are_one_line_with_their_exit_codes(run):
    before = (run / "manifest.json").read_bytes()
    cases = [
        (["--class", "nope"], 3, "class 'nope' is not a class of run"),
        (["--class", "CLASS_01"], 3, "did you mean 'class_01'?"),
        (["--restore", "nope"], 3, "class 'nope' is not a class of run"),
        (["--restore", GONE], 7, "is not forgotten (stage 1 learned it); nothing to restore"),
        ([], 2, "pass exactly one of --class NAME"),
        (["--class", GONE, "--restore", GONE], 2, "pass exactly one of --class NAME"),
        (["--restore", GONE, "--purge"], 2, "--purge goes with --class"),
        (["--class", GONE, "--reason", "two\nlines"], 2, "--reason must be one line"),
    ]
    for args, code, message in cases:
        result, out = drl_json("forget", "--run", run, *args)
        assert result.exit_code == code and message in out["error"]["message"], (args, out)
        assert result.stderr.strip().splitlines() == [f"error: {out['error']['message']}"]
    assert (run / "manifest.json").read_bytes() == before
    assert drl("forget", "--run", run, "--class", GONE).exit_code == 0
    result, out = drl_json("forget", "--run", run, "--class", GONE)
    assert result.exit_code == 7 and "already forgotten with its slices kept" in out["error"]["message"]
    assert f"drl forget --restore {GONE}" in out["error"]["message"]
    with RunDir(run).writer():  # another writer holds the lock
        result, out = drl_json("forget", "--run", run, "--class", "class_00")
    assert result.exit_code == 4 and "is busy" in out["error"]["message"]
    result = drl("forget", "--run", run.parent / "missing", "--class", GONE)
    assert result.exit_code == 7


def test_the_last_class_is_never_forgotten(run):
    for name in ["class_00", "class_01", "class_02", "class_03", "class_04"]:
        assert drl("forget", "--run", run, "--class", name, "--purge").exit_code == 0
    result, out = drl_json("forget", "--run", run, "--class", "class_05")
    assert result.exit_code == 7 and "the only class run" in out["error"]["message"]
    assert ev_classes(run) == ["class_05"]
    result, out = drl_json("eval", "--run", run, "--all-seen", "--device", "cpu")
    assert result.exit_code == 0 and out["accuracy"]["num_images"] == 4 and out["accuracy"]["top1"] == 100


# ------------------------------------------------------------------------------ crashes


@pytest.mark.parametrize("purge", [False, True])
def test_a_crash_at_any_storage_call_of_a_forget_leaves_the_old_or_the_new_state(
    ridge_run, tmp_path, monkeypatch, purge
):
    faults = FailAt(monkeypatch)
    straight = shutil.copytree(ridge_run, tmp_path / "straight")
    old = _all_tensors(straight)
    faults.arm(None)
    forget_class(straight, GONE, purge=purge)
    new, num_calls = _all_tensors(straight), len(faults.calls)
    assert {"write_new", "replace", "fsync_dir", "remove"} <= set(faults.calls), faults.calls
    outcomes = set()
    for k in range(1, num_calls + 1):
        target = shutil.copytree(ridge_run, tmp_path / f"k{k:02d}")
        faults.arm(k)
        with pytest.raises(Crash):
            forget_class(target, GONE, purge=purge)
        faults.arm(None)
        verify(target)  # raises IntegrityError naming any damage
        state = _all_tensors(target)
        forgotten = _same_tensors(state, new)
        assert forgotten or _same_tensors(state, old), k
        outcomes.add(forgotten)
        try:  # the same command again: done now, or "already forgotten" after cleaning what the crash left
            forget_class(target, GONE, purge=purge)
        except RunStateError as exc:
            assert forgotten and "already forgotten" in str(exc), k
        assert _same_tensors(_all_tensors(target), new) and _files(target) == _files(straight), k
        shutil.rmtree(target)
    assert outcomes == {False, True}


def test_an_io_error_after_the_commit_point_says_the_state_is_committed(run, monkeypatch):
    def refuse(path):
        raise OSError(5, "Input/output error")

    from drlcli import storage

    monkeypatch.setattr(storage, "remove", refuse)
    with pytest.raises(StorageError, match="is committed, but deleting the files it superseded failed"):
        forget_class(run, GONE, purge=True)
    monkeypatch.undo()
    assert "stages/001/weights.safetensors" in _files(run)  # still on disk: the next writer deletes it
    assert drl("forget", "--run", run, "--class", GONE, "--purge").exit_code == 7
    assert "stages/001/weights.safetensors" not in _files(run)


# --------------------------------------------------------------------------- hostile runs


def _relist(run: Path, name: str, data: bytes | None = None, *, manifest_edit=None) -> None:
    """Replace a listed file's bytes and list them with a matching checksum (a crafted run)."""
    manifest = json.loads((run / "manifest.json").read_text())
    if data is not None:
        (run / name).write_bytes(data)
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    if manifest_edit is not None:
        manifest_edit(manifest)
    (run / "manifest.json").write_text(json.dumps(manifest))


def _log(run: Path) -> tuple[str, dict]:
    (path,) = run.glob("forgotten/log-*.json")
    return path.relative_to(run).as_posix(), json.loads(path.read_text())


LOG_CRAFTS = {
    "not a log": lambda log: ["a", "list"],
    "wrong kind": lambda log: {**log, "kind": "other"},
    "stage as text": lambda log: {**log, "forgotten": [{**log["forgotten"][0], "stage": "1"}]},
    "kept as int": lambda log: {**log, "forgotten": [{**log["forgotten"][0], "kept": 1}]},
    "unknown class": lambda log: {**log, "forgotten": [{**log["forgotten"][0], "class": "class_07"}]},
    "unknown stage": lambda log: {**log, "forgotten": [{**log["forgotten"][0], "stage": 9, "last_stage": 9}]},
    "rows not listed": lambda log: {**log, "forgotten": [{**log["forgotten"][0], "generation": 3}]},
    "twice": lambda log: {**log, "forgotten": log["forgotten"] * 2},
    "bad action": lambda log: {**log, "events": [{**log["events"][0], "action": "erase"}]},
    # an active class marked forgotten: its rows are still in the stage files
    "active marked": lambda log: {
        **log,
        "forgotten": [*log["forgotten"], {**log["forgotten"][0], "class": "class_00"}],
    },
    "none forgotten": lambda log: {**log, "forgotten": []},  # the rows are gone, the log says nothing is
}


@pytest.mark.parametrize("craft", sorted(LOG_CRAFTS))
def test_a_crafted_forget_log_is_refused_by_every_command(run, stage_folders, tmp_path, craft):
    assert drl("forget", "--run", run, "--class", GONE).exit_code == 0
    name, log = _log(run)
    _relist(run, name, json.dumps(LOG_CRAFTS[craft](log)).encode())
    image = next(stage_folders[0][1].rglob("*.png"))
    for args in (
        ["eval", "--run", run, "--all-seen", "--device", "cpu"],
        ["predict", "--run", run, image, "--device", "cpu"],
        ["export", "--run", run, "--out", tmp_path / "m.drl"],
        ["learn-stage", "--run", run, "--data", stage_folders[2][0], *FAST],
        ["forget", "--run", run, "--class", "class_02"],
        ["forget", "--run", run, "--restore", GONE],
        ["verify", "--run", run],
        ["info", "--run", run],
    ):
        if args[0] == "info" and craft in ("active marked", "none forgotten"):
            continue  # info reads no tensors: it shows what the log says
        result, out = drl_json(*args)
        assert result.exit_code == 5 and "restore it from a backup" in out["error"]["message"], (craft, args, out)


def test_crafted_kept_rows_and_manifest_are_refused(run):
    assert drl("forget", "--run", run, "--class", GONE).exit_code == 0
    rows = "forgotten/rows-g000004.safetensors"
    tensors = load_file(str(run / rows))
    key = next(k for k in tensors if k.endswith("/prototypes"))
    crafted = {**tensors, key: torch.zeros(1, 2, 3)}
    save_file(crafted, str(run / "x.safetensors"))
    original = (run / rows).read_bytes()
    _relist(run, rows, (run / "x.safetensors").read_bytes())
    for args in (["verify"], ["forget", "--restore", GONE]):
        result, out = drl_json(*args, "--run", run)
        assert result.exit_code == 5 and "rows-g000004.safetensors does not fit the run" in out["error"]["message"]
    _relist(run, rows, original)
    assert drl("verify", "--run", run).exit_code == 0
    # a superseded entry may only name a drl file no longer listed: never run.yaml or a listed file
    for bad in (["run.yaml"], ["stages/001/stage.json"], [rows], ["../outside.safetensors"]):
        _relist(run, rows, manifest_edit=lambda m, bad=bad: m.__setitem__("superseded", bad))
        result, out = drl_json("forget", "--run", run, "--restore", GONE)
        assert result.exit_code == 5 and "malformed" in out["error"]["message"], (bad, out)
    assert (run / "run.yaml").is_file() and (run / rows).is_file()
    _relist(run, rows, manifest_edit=lambda m: m.__setitem__("format_version", 9))
    result, out = drl_json("verify", "--run", run)
    assert result.exit_code == 5 and "this drl reads versions 1, 2, 3, 4" in out["error"]["message"]


def test_a_new_run_is_format_3(ridge_run):
    """Its newest stage carries the run's totals: a release that would sum them as one stage's
    increments must refuse it (format 1 and 2 runs of earlier releases: tests/test_run_totals.py)."""
    assert json.loads((ridge_run / "manifest.json").read_text())["format_version"] == 3
