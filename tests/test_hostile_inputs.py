"""Hostile inputs through the public CLI: a YAML alias bomb, values too big or malformed for an
option, and re-signed stage records of the wrong type or size.

Each is a clear one-line error with its documented exit code (2 for options and config files, 5
for a crafted run), never an uncaught exception (exit 1) or an allocation that never ends.
"""

import json
import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drlcli import errors, jsonio, learn_stage
from drlcli.cli import app
from drlcli.commands.init import init_run
from drlcli.config import RunConfig
from drlcli.run.layout import sha256_bytes
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

MAX_PROJ_DIM = 16_384  # ridge.proj_dim's upper bound (heads/ridge/options.py)

runner = CliRunner()
TINY_ARGS = ["--ptm", TINY_PTM, "--random-init"] + [
    a for k, v in TINY_PTM_KWARGS.items() for a in ("--ptm-arg", f"{k}={v}")
]
HUGE = "9" * 5000  # past Python's 4,300-digit limit of int() from text
BIG = "1" + "0" * 400  # a JSON or YAML int no float holds


def drl(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, code: int, *names: str) -> str:
    """The result's error: exit ``code``, one short line naming each of ``names``."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]  # not progress lines
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert len(lines[0]) < 400, lines[0]
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def alias_bomb(levels: int = 9, key: str = "i") -> str:
    """The "billion laughs": each level a list of 9 aliases of the level before (9^levels nodes)."""
    lines, before = ["a: &a [x, x, x, x, x, x, x, x, x]"], "a"
    for name in "bcdefghijklmnop"[: levels - 1]:
        lines.append(f"{name}: &{name} [{', '.join([f'*{before}'] * 9)}]")
        before = name
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------- 1. YAML alias bombs


def test_an_alias_bomb_is_refused_while_parsing():
    text = alias_bomb()
    assert len(text) < 600
    began = time.perf_counter()
    with pytest.raises(ValueError, match="aliases repeat more than"):
        jsonio.load_yaml(text)
    assert time.perf_counter() - began < 5


def test_an_alias_that_holds_itself_is_refused():
    with pytest.raises(ValueError, match="refers to a node that holds it"):
        jsonio.load_yaml("a: &a [1, *a]\n")


def test_aliases_that_share_a_small_section_still_read():
    data = jsonio.load_yaml("base: &base {lr: 0.1, epochs: 2}\ntrain: *base\nagain: [*base, *base]\n")
    assert data["train"] == {"lr": 0.1, "epochs": 2} and data["again"] == [data["train"]] * 2


def test_init_with_an_alias_bomb_config_is_a_usage_error(tmp_path):
    config = tmp_path / "bomb.yaml"
    config.write_text(alias_bomb())
    began = time.perf_counter()
    result = drl("init", "--run", tmp_path / "run", *TINY_ARGS, "--config", config)
    one_line_error(result, errors.UsageError.exit_code, str(config), "aliases")
    assert time.perf_counter() - began < 30
    assert not (tmp_path / "run").exists()


def test_an_alias_bomb_inside_an_option_is_a_usage_error(tmp_path):
    """The bomb as an option's value (``train.epochs: *i``), the value quoted in no message whole."""
    config = tmp_path / "bomb.yaml"
    config.write_text("x:\n" + "".join(f"  {line}\n" for line in alias_bomb(8).splitlines()) + "train:\n  epochs: *h\n")
    one_line_error(drl("init", "--run", tmp_path / "run", *TINY_ARGS, "--config", config), 2, "aliases")


def test_a_resigned_run_yaml_alias_bomb_is_damage(tmp_path):
    run = tmp_path / "run"
    assert drl("init", "--run", run, *TINY_ARGS).exit_code == 0
    data = (run / "run.yaml").read_bytes() + (
        "bomb:\n" + "".join(f"  {x}\n" for x in alias_bomb().splitlines())
    ).encode()
    _resign(run, "run.yaml", data)
    for command in (["info"], ["verify"]):
        one_line_error(drl(*command, "--run", run), errors.IntegrityError.exit_code, "run.yaml", "aliases")


@pytest.mark.parametrize(
    "value",
    [
        "x" * 100_000,
        10**4000,  # repr() of an int past 4,300 digits raises; this one is 4,001 digits
        [[["deep"] * 50] * 50] * 50,
    ],
)
def test_a_value_in_a_message_is_quoted_by_a_bounded_prefix(value):
    shown = errors.shown(value)
    assert len(shown) <= errors.SHOWN_CHARS
    with pytest.raises(errors.UsageError) as raised:
        RunConfig.for_method("drl", {"train": {"loss": value}})
    assert "train.loss" in str(raised.value) and len(str(raised.value)) < 300


def test_a_shared_structure_of_a_billion_nodes_is_shown_at_once():
    bomb = ["x"] * 9
    for _ in range(9):
        bomb = [bomb] * 9
    began = time.perf_counter()
    assert len(errors.shown(bomb)) <= errors.SHOWN_CHARS
    assert time.perf_counter() - began < 1
    assert errors.shown(10**5000) == "<an integer of about 5001 digits>"


def test_a_long_config_value_is_quoted_by_a_prefix_through_the_cli(tmp_path):
    config = tmp_path / "long.yaml"
    config.write_text(f"train:\n  loss: {'x' * 50_000}\n")
    line = one_line_error(drl("init", "--run", tmp_path / "run", *TINY_ARGS, "--config", config), 2, "train.loss")
    assert "..." in line


# ----------------------------------------------------------------- 2. values no option takes


def test_a_projection_whose_gram_cannot_be_allocated_is_refused_at_init(tmp_path):
    """ranpac.proj_dim 65536 passed init and every learn-stage then failed allocating 34 GB."""
    config = tmp_path / "wide.yaml"
    config.write_text("ranpac:\n  proj_dim: 65536\n")
    result = drl("init", "--run", tmp_path / "run", *TINY_ARGS, "--config", config)
    one_line_error(result, errors.UsageError.exit_code, "ridge.proj_dim", str(MAX_PROJ_DIM))
    assert not (tmp_path / "run").exists()
    assert RunConfig.for_method("drl", {"ridge": {"proj_dim": MAX_PROJ_DIM}}).ridge.proj_dim == MAX_PROJ_DIM
    assert MAX_PROJ_DIM**2 * 8 <= 2**31  # one (M, M) float64 Gram: 2 GiB at most


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("train:\n  epochs: !!python/name:os.system\n", ("python/name:os.system",)),
        (f"train:\n  epochs: {HUGE}\n", ("5000 digits",)),
        (f"train:\n  lr: {BIG}\n", ("train.lr",)),  # an int no float holds, for a float option
        (f"train:\n  epochs: {BIG}\n", ("train.epochs",)),
        ("train:\n  {1: 2, a: 3}\n", ("unknown",)),  # keys of two types
        ("method: [drl]\n", ("method",)),
    ],
)
def test_init_config_values_of_no_type_drl_reads_are_usage_errors(tmp_path, text, names):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    one_line_error(drl("init", "--run", tmp_path / "run", *TINY_ARGS, "--config", config), 2, *names)


@pytest.mark.parametrize(
    "value",
    ["[1", "!!python/name:os.system", HUGE, BIG, "{a: 1", "&a [*a]"],
)
def test_a_malformed_ptm_arg_is_a_usage_error(tmp_path, value):
    result = drl("init", "--run", tmp_path / "run", *TINY_ARGS, "--ptm-arg", f"img_size={value}")
    one_line_error(result, errors.UsageError.exit_code, "img_size")
    assert not (tmp_path / "run").exists()


def test_a_number_no_float_holds_is_refused_as_a_ptm_float(tmp_path):
    result = drl("init", "--run", tmp_path / "run", *TINY_ARGS, "--ptm-arg", f"mlp_ratio={BIG}")
    one_line_error(result, errors.UsageError.exit_code, "mlp_ratio", "401 digits")


@pytest.mark.parametrize(
    ("option", "value", "names"),
    [
        ("--methods", "drl/ranpac.proj_dim=65536", ("ridge.proj_dim",)),
        ("--methods", "drl/lr=[1", ("--methods drl/lr",)),
        ("--methods", "drl/epochs=!!int", ("--methods drl/epochs",)),
        ("--methods", f"drl/epochs={HUGE}", ("--methods drl/epochs", "5000 digits")),
        ("--methods", f"drl/lr={BIG}", ("train.lr",)),
        ("--methods", f"drl/preset={'p' * 5000}", ("preset",)),
        ("--rescore", "beta=[1", ("--rescore beta",)),
        ("--rescore", "beta=!!python/name:os.system", ("--rescore beta",)),
        ("--rescore", f"beta={HUGE}", ("--rescore beta", "5000 digits")),
        ("--rescore", f"tau={BIG}", ("score.tau",)),
    ],
)
def test_benchmark_option_values_are_usage_errors_before_any_work(tmp_path, option, value, names):
    """Refused before the data is read (``--data`` does not even exist)."""
    result = drl("benchmark", "--data", tmp_path / "none", "--out", tmp_path / "out", option, value)
    one_line_error(result, errors.UsageError.exit_code, *names)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------- 3. re-signed stage records

SMALL = {
    "ridge": {"proj_dim": 96, "carry_draws": 4, "carry_rank": 3},
    "train": {"epochs": 1, "batch_size": 8, "seed": 3},
}


def _resign(run: Path, name: str, data: bytes) -> None:
    """Write ``name`` and sign it in the run's manifest as if drl had (a crafted run)."""
    (run / name).write_bytes(data)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (run / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stage_folders) -> dict[str, Path]:
    """Two stages of the default (``drl``, preset switched) and of ``--preset frozen``, small."""
    out = {}
    for preset in ("switched", "frozen"):
        run = tmp_path_factory.mktemp(preset) / "run"
        config = RunConfig.for_method("drl", SMALL) if preset == "switched" else None
        config = config or RunConfig.for_method("drl", SMALL, preset=preset)
        init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
        for train, test in stage_folders[:2]:
            learn_stage(run, data_dir=train, eval_data_dir=test, device="cpu")
        out[preset] = run
    assert RunConfig.for_method("drl").schedule.switch == "transfer"  # the default is the switched one
    return out


MARK = "@@crafted@@"

# (stage, field path, JSON token): counts past any int64 or float, inf (1e400 parses as inf), null
CRAFTED = [
    (1, "num_params", BIG),
    (2, "num_params", "null"),
    (1, "images_per_class.*", BIG),
    (2, "images_per_class.*", "null"),
    (1, "metrics.learn_seconds", "1e400"),
    (1, "metrics.train.seconds", "1e400"),
    (1, "metrics.eval.top1", BIG),
    (2, "metrics.eval.num_images", "null"),
    (2, "metrics.eval.groups.1", "1e400"),
    (1, "metrics.eval.groups.1", "null"),
    (2, "open_set.threshold", BIG),
    (1, "open_set.rmd_threshold", "1e400"),
    (1, "stage", "true"),
]
SWITCHED_ONLY = [
    (2, "switch.top1.carried", BIG),
    (1, "switch.frozen_seconds", "1e400"),
    (2, "carry.transfer.images", BIG),
    (2, "carry.transfer.run.better", "null"),
]


def _craft(source: Path, target: Path, stage: int, field: str, token: str) -> None:
    run = Path(shutil.copytree(source, target, symlinks=True))
    name = f"stages/{stage:03d}/stage.json"
    meta = json.loads((run / name).read_text())
    *parents, last = field.split(".")
    holder = meta
    for key in parents:
        holder = holder[key]
    last = next(iter(holder)) if last == "*" else last
    assert last in holder, (field, holder)
    holder[last] = MARK
    _resign(run, name, json.dumps(meta).replace(json.dumps(MARK), token).encode())


@pytest.mark.parametrize("command", ["info", "info --json", "verify", "predict"])
@pytest.mark.parametrize(
    ("preset", "stage", "field", "token"),
    [("switched", *case) for case in CRAFTED + SWITCHED_ONLY] + [("frozen", *case) for case in CRAFTED[:10]],
)
def test_a_resigned_stage_record_of_the_wrong_type_or_size_is_damage(
    runs, stage_folders, tmp_path, command, preset, stage, field, token
):
    run = tmp_path / "run"
    _craft(runs[preset], run, stage, field, token)
    args = command.split()
    if command == "predict":
        args += [next(stage_folders[0][1].rglob("*.png")), "--device", "cpu"]
    result = drl(*args, "--run", run)
    if command == "info --json":
        assert result.exit_code == errors.IntegrityError.exit_code, result.output
        error = json.loads(result.stdout)["error"]
        assert error["kind"] == "integrity" and f"stage {stage} " in error["message"]
        return
    top = field.split(".")[0]
    line = one_line_error(result, errors.IntegrityError.exit_code, f"stage {stage} ")
    assert top in line or "switch" in line


def test_the_untouched_runs_read(runs):
    for run in runs.values():
        assert drl("info", "--run", run).exit_code == 0
        assert drl("verify", "--run", run).exit_code == 0
