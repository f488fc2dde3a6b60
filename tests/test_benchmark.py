"""``drl benchmark``: variant parsing, protocol (class order, stages, data layouts), end to end."""

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from drlcli.benchmark.protocol import class_order, load_data, parse_split, stage_classes
from drlcli.benchmark.variants import parse_methods, parse_variant
from drlcli.cli import app
from drlcli.errors import DataError, UsageError
from drlcli.run.directory import RunDir
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

TINY_ARGS = ["--ptm", TINY_PTM, "--random-init"] + [
    a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")
]


def test_variants_resolve_short_and_dotted_keys():
    v = parse_variant("drl/loss=ce/gate=sum/rule=concat/kd_weight=0")
    cfg = v.config(epochs=4, seed=7)
    assert (cfg.train.loss, cfg.ipa.gate, cfg.score.rule, cfg.train.kd_weight) == ("ce", "sum", "concat", 0.0)
    assert (cfg.train.epochs, cfg.train.seed) == (4, 7)
    assert parse_variant("drl/epochs=2").config(epochs=4, seed=0).train.epochs == 2  # variant wins
    ease = parse_variant("ease/ease.adapter_dim=16/lr=0.05").config(epochs=None, seed=0)
    assert (ease.ease.adapter_dim, ease.train.lr, ease.train.loss) == (16, 0.05, "ce")
    with pytest.raises(UsageError, match="ambiguous"):
        parse_variant("drl/adapter_dim=8")  # ipa.adapter_dim or ease.adapter_dim
    with pytest.raises(UsageError, match="unknown variant option"):
        parse_variant("drl/bogus=1")
    with pytest.raises(UsageError, match="unknown method"):
        parse_variant("l2p")
    with pytest.raises(UsageError, match="gate must be one of"):
        parse_variant("drl/gate=wide")
    with pytest.raises(UsageError, match="twice"):
        parse_methods("drl,drl")


def test_split_and_class_order_follow_the_protocol():
    assert parse_split("B0Inc10") == (0, 10) and parse_split("b50inc5") == (50, 5)
    with pytest.raises(UsageError, match="B<m>Inc<n>"):
        parse_split("10x10")
    names = [f"c{i:03d}" for i in range(101)]
    order = class_order(names, seed=1993, shuffle=True)
    assert order == [sorted(names)[i] for i in np.random.RandomState(1993).permutation(101)]  # PILOT's order
    assert class_order(names, seed=1993, shuffle=False) == sorted(names)
    stages = stage_classes(order, 0, 10)
    assert [len(s) for s in stages] == [10] * 10 + [1]
    assert [len(s) for s in stage_classes(order, 51, 10)] == [51] + [10] * 5


def test_list_file_layout_skips_background_and_reports_missing_images(tmp_path):
    root = tmp_path / "cal"
    make_class_folders(root / "Objects", [0, 1], images_per_class=3)
    lines = ["class_00/img_000.png", "class_00/img_001.png", "BACKGROUND_Google/x.jpg", "class_01/img_000.png"]
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    (root / "test.txt").write_text("class_00/img_002.png\nclass_01/img_002.png\n")
    data = load_data(root, skip_classes={"BACKGROUND_Google"})
    assert {c: len(v) for c, v in data.train.items()} == {"class_00": 2, "class_01": 1}
    assert data.test["class_01"][0] == root / "Objects" / "class_01" / "img_002.png"
    (root / "test.txt").write_text("class_00/img_002.png\nclass_01/img_009.png\n")
    with pytest.raises(DataError, match="missing"):
        load_data(root, skip_classes=set())
    with pytest.raises(DataError, match="neither"):
        load_data(root / "Objects", skip_classes=set())


def test_benchmark_end_to_end_writes_results_and_resumes(tmp_path):
    data = tmp_path / "data"
    make_class_folders(data / "train", list(range(5)), images_per_class=8)
    make_class_folders(data / "test", list(range(5)), images_per_class=3, offset=8)
    out = tmp_path / "out"
    args = ["benchmark", "--data", data, "--out", out, *TINY_ARGS, "--split", "B0Inc2", "--epochs", "1"]
    args += [
        "--methods",
        "drl/preset=frozen/skip_unread=false,ease/batch_size=8,simplecil,drl/preset=frozen/loss=ce/skip_unread=false,"
        "drl/preset=frozen,drl",
        "--device",
        "cpu",
    ]
    args += ["--rescore", "beta=1", "--rescore", "rule=concat", "--json"]
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    labels = [r["label"] for r in report["results"]]
    trained = "drl/preset=frozen/skip_unread=false"
    assert labels[:4] == [trained, f"{trained} [score beta=1]", f"{trained} [score rule=concat]", "ease/batch_size=8"]
    assert (
        "simplecil [score beta=1]" not in labels
        and "drl/preset=frozen/loss=ce/skip_unread=false [score rule=concat]" in labels
    )
    # the frozen drl trains no stage (its head reads none): no rescoring would read trained subspaces
    assert labels[-2] == "drl/preset=frozen" and "not rescored: its stages were not trained" in result.stderr
    # nor the default, whose network moves at every stage it trains (the bank's rows are of older ones)
    assert labels[-1] == "drl" and "not rescored: its network is carried" in result.stderr
    by_label = {r["label"]: r for r in report["results"]}
    # rescoring with the run's own options reproduces the A_t recorded stage by stage
    assert by_label[f"{trained} [score beta=1]"]["accuracy"] == by_label[trained]["accuracy"]
    assert by_label["ease/batch_size=8 [score beta=1]"]["accuracy"] == by_label["ease/batch_size=8"]["accuracy"]
    assert by_label[f"{trained} [score rule=concat]"]["config"]["score"]["rule"] == "concat"
    # and its answers are those of the run that trained its stages
    assert by_label["drl/preset=frozen"]["accuracy"] == by_label[trained]["accuracy"]
    # the default answers from its frozen track after stage 1: the frozen head's answers
    assert by_label["drl"]["accuracy"][0] == by_label["drl/preset=frozen"]["accuracy"][0]
    assert report["protocol"]["stages"] == [2, 2, 1]
    for r in report["results"]:
        assert len(r["accuracy"]) == 3 and r["average"] == pytest.approx(sum(r["accuracy"]) / 3, abs=1e-3)
        assert r["inference_ms_per_image"] > 0
    assert by_label["simplecil"]["params_per_stage"] == [0, 0, 0]
    # every method's learning time (SGD, feature pass, fit) is recorded, stage by stage
    assert all(r["learn_seconds"] > 0 and len(r["stage_learn_seconds"]) == 3 for r in report["results"])
    assert by_label[trained]["learn_seconds"] >= by_label[trained]["train_seconds"]  # SGD and the pass
    # the frozen drl stores no stage network: its parameters are the head's W, fewer than the adapters
    assert 0 < by_label["drl/preset=frozen"]["params_per_stage"][0] < by_label[trained]["params_per_stage"][0]
    assert json.loads((out / "results.json").read_text())["results"] == report["results"]
    table = (out / "results.md").read_text()
    assert "| `ease/batch_size=8` |" in table
    # each variant's learn seconds, passes per image, MiB read and the run's size, stage by stage, side by side
    costs = table.split("| learn s (passes/img; MiB read; run MiB) | stage 1 | stage 2 | stage 3 |")[1]
    frozen_row = next(line for line in costs.splitlines() if line.startswith("| `drl/preset=frozen` |"))
    cells = [c.strip().split(" (")[1].rstrip(")").split("; ") for c in frozen_row.strip("|").split("|")[1:]]
    assert [c[0] for c in cells] == ["1.0"] * 3  # one feature pass a stage
    frozen = by_label["drl/preset=frozen"]
    assert all(m > 0 for m in frozen["stage_read_mib"])  # its images at least (Linux /proc/self/io)
    stored = [float(c[2]) for c in cells]
    assert stored == pytest.approx(frozen["stage_stored_mib"], abs=0.051) and stored == sorted(stored)
    for r in report["results"]:  # the whole run directory after its last stage: a default run's frozen track too
        if "[score" not in r["label"]:
            size = RunDir(Path(r["run_dir"])).size_bytes() / 2**20
            assert r["stage_stored_mib"][-1] == pytest.approx(size, abs=0.006)
            assert size >= sum(r["bytes_per_stage"]) / 2**20 - 0.006
    # the same command again reuses every finished run: same numbers, no new stage (so nothing read)
    again = json.loads(CliRunner().invoke(app, [str(a) for a in args]).stdout)
    assert [r["accuracy"] for r in again["results"]] == [r["accuracy"] for r in report["results"]]
    assert all(r["stage_read_mib"] == r["stage_stored_mib"] == [None] * 3 for r in again["results"])
    # other settings for an existing run are refused, not mixed in
    changed = CliRunner().invoke(app, [str(a) for a in args[:-1]] + ["--epochs", "2"])
    assert changed.exit_code == 2 and "other settings" in changed.stderr
    # and another protocol in the same --out is refused before anything is touched
    other = CliRunner().invoke(app, [str(a) for a in args[:-1]] + ["--split", "B0Inc3"])
    assert other.exit_code == 2 and "other split" in other.stderr


def test_validation_split_holds_out_train_images(tmp_path):
    from drlcli.benchmark.protocol import split_validation

    make_class_folders(tmp_path / "d" / "train", [0, 1], images_per_class=10)
    make_class_folders(tmp_path / "d" / "test", [0, 1], images_per_class=2)
    data = load_data(tmp_path / "d", skip_classes=set())
    held = split_validation(data, 0.2, seed=1)
    for cls in data.train:
        assert len(held.test[cls]) == 2 and len(held.train[cls]) == 8
        assert not set(held.test[cls]) & set(held.train[cls])
        assert set(held.test[cls]) | set(held.train[cls]) == set(data.train[cls])


def test_stages_runs_a_prefix_and_a_later_call_continues_it(tmp_path):
    data = tmp_path / "data"
    make_class_folders(data / "train", list(range(5)), images_per_class=4)
    make_class_folders(data / "test", list(range(5)), images_per_class=2, offset=4)
    args = ["benchmark", "--data", data, "--out", tmp_path / "out", *TINY_ARGS, "--split", "B0Inc2"]
    args += ["--methods", "simplecil", "--device", "cpu", "--json"]
    first = CliRunner().invoke(app, [str(a) for a in [*args, "--stages", "2"]])
    assert first.exit_code == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["protocol"]["stages"] == [2, 2] and report["protocol"]["test_images"] == 8
    assert len(report["results"][0]["accuracy"]) == 2
    full = json.loads(CliRunner().invoke(app, [str(a) for a in args]).stdout)
    assert full["protocol"]["stages"] == [2, 2, 1]
    assert full["results"][0]["accuracy"][:2] == report["results"][0]["accuracy"]
    assert len(RunDir(tmp_path / "out" / "runs" / "simplecil").stage_indices()) == 3


def test_params_per_stage_keep_stage_order():
    from drlcli.benchmark.report import per_stage

    assert per_stage([297_984, 60_000, 90_000]) == "297,984/60,000/90,000"  # stage 1 first, not sorted
    assert per_stage([148_992] * 3) == "148,992" and per_stage([]) == "0"


def test_mean_and_std_over_class_orders_on_known_inputs():
    from drlcli.benchmark.report import aggregate, markdown_table

    def row(label, acc, forgetting, seconds):
        avg = sum(acc) / len(acc)
        return {
            "label": label,
            "method": label,
            "accuracy": acc,
            "average": avg,
            "last": acc[-1],
            "mean_forgetting": forgetting,
            "train_seconds": seconds,
            "learn_seconds": seconds + 1,
            "inference_ms_per_image": 1.0,
        }

    reports = {
        s: {"protocol": {"split": "B0Inc2", "seed": s, "class_order": [str(s)], "stages": [2, 2]}, "wall_seconds": 1}
        for s in (1, 2, 3)
    }
    reports[1]["results"] = [row("a", [90.0, 80.0], 2.0, 10.0), row("b", [100.0, 70.0], None, 0.0)]
    reports[2]["results"] = [row("a", [94.0, 84.0], 4.0, 20.0), row("b", [100.0, 70.0], 1.0, 0.0)]
    reports[3]["results"] = [row("a", [92.0, 88.0], 6.0, 30.0), row("b", [100.0, 70.0], 1.0, 0.0)]
    report = aggregate(reports)
    a, b = report["summary"]
    assert a["last"] == {"mean": 84.0, "std": 4.0}  # 80, 84, 88: sample std 4
    assert a["average"]["mean"] == 88.0 and a["average"]["std"] == pytest.approx(7**0.5, abs=1e-4)  # 85, 89, 90
    assert a["mean_forgetting"] == {"mean": 4.0, "std": 2.0} and a["train_seconds"] == {"mean": 20.0, "std": 10.0}
    assert a["learn_seconds"] == {"mean": 21.0, "std": 10.0}
    assert a["accuracy"][0] == {"mean": 92.0, "std": 2.0}
    assert b["last"] == {"mean": 70.0, "std": 0.0} and b["mean_forgetting"] == {"mean": None, "std": None}
    assert report["protocol"]["seeds"] == [1, 2, 3] and "seed" not in report["protocol"]
    assert set(report["per_seed"]) == {"1", "2", "3"}
    table = markdown_table(report)
    assert "| `a` | 88.00 ± 2.65 | 84.00 ± 4.00 | 4.00 ± 2.00 | 21 ± 10 |" in table  # learn s
    assert "| `b` | 1 | 85.00 | 70.00 | – | 1 |" in table


def test_several_class_orders_in_one_command_each_in_its_folder(tmp_path):
    data = tmp_path / "data"
    make_class_folders(data / "train", list(range(4)), images_per_class=5)
    make_class_folders(data / "test", list(range(4)), images_per_class=2, offset=5)
    out = tmp_path / "out"
    args = ["benchmark", "--data", data, "--out", out, *TINY_ARGS, "--split", "B0Inc2", "--device", "cpu"]
    args += ["--methods", "simplecil,ranpac/proj_dim=32", "--seeds", "5,6", "--json"]
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert [r["label"] for r in report["summary"]] == ["simplecil", "ranpac/proj_dim=32"]
    for seed in (5, 6):
        single = json.loads((out / f"seed_{seed}" / "results.json").read_text())
        assert single["protocol"]["seed"] == seed and single["results"] == report["per_seed"][str(seed)]
        assert len(RunDir(out / f"seed_{seed}" / "runs" / "ranpac__proj_dim=32").stage_indices()) == 2
    orders = report["protocol"]["class_orders"]
    assert orders["5"] != orders["6"]
    lasts = [r["last"] for r in report["per_seed"].values() for r in [r[0]]]
    assert report["summary"][0]["last"]["mean"] == pytest.approx(sum(lasts) / 2, abs=1e-3)
    assert "± " in (out / "results.md").read_text()
    # the same command again reuses both orders' runs; --seed with --seeds is refused
    again = json.loads(CliRunner().invoke(app, [str(a) for a in args]).stdout)
    assert [r["average"] for r in again["summary"]] == [r["average"] for r in report["summary"]]
    both = CliRunner().invoke(app, [str(a) for a in [*args, "--seed", "1"]])
    assert both.exit_code == 2 and "not both" in both.stderr


@pytest.mark.parametrize("text", ["-1,2", "1,99999999999", "1,1", "1,x"])
def test_bad_seeds_are_usage_errors(text):
    from drlcli.benchmark.protocol import parse_seeds
    from drlcli.errors import UsageError

    with pytest.raises(UsageError, match="--seeds"):
        parse_seeds(text)
