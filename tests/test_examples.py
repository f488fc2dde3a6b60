"""The nightly pipeline examples run end to end on the offline default (subprocesses, no terminal).

One generated drop is prepared here (the scripts generate two when WORK_DIR/drops is missing), so
each script does init, one learn-stage, eval, export and predict in a few process start-ups.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from drlcli.synthetic import make_stages

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _run(command: list[str], work: Path, formats: str) -> subprocess.CompletedProcess:
    make_stages(work / "drops", num_stages=1, classes_per_stage=3, train=6, test=2, name="drop{:03d}")
    env = {**os.environ, "EPOCHS": "1", "FORMATS": formats, "DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    env.pop("DRL_RUN", None)
    result = subprocess.run(
        command, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not CONTROL.search(result.stdout + result.stderr)  # plain lines off a terminal
    return result


def test_nightly_sh(tmp_path):
    _run(["bash", str(EXAMPLES / "nightly.sh"), "", str(tmp_path)], tmp_path, "torchscript")
    evaluation = json.loads((tmp_path / "reports" / "eval.json").read_text())
    assert evaluation["ok"] and evaluation["num_classes"] == 3 and len(evaluation["history"]["matrix"]) == 1
    assert (tmp_path / "logs" / "learn-drop001.json").is_file()
    current = tmp_path / "models" / "current.pt"
    assert current.is_symlink() and current.resolve().name == "model-g2.pt"
    smoke = [json.loads(line) for line in (tmp_path / "reports" / "smoke-pt.jsonl").read_text().splitlines()]
    assert len(smoke) == 4 and all(len(p["top"]) == 3 for p in smoke)


def test_nightly_py(tmp_path):
    result = _run([sys.executable, str(EXAMPLES / "nightly.py"), "", str(tmp_path)], tmp_path, "drl")
    assert "drop drop001 -> stage 1: 3 classes learned" in result.stdout
    assert (tmp_path / "models" / "model-g2.drl").is_file()
    predictions = [line for line in result.stdout.splitlines() if line.startswith("drl {")]
    assert len(predictions) == 4
