"""benchmarks/cost.py runs end to end (a small architecture, one round) and reports every case."""

import json
import os
import subprocess
import sys
from pathlib import Path

from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cost.py"


def test_cost_benchmark_reports_ratios_for_every_case(tmp_path):
    out = tmp_path / "cost.json"
    command = [sys.executable, str(SCRIPT), "--archs", TINY_PTM, "--ptm-kwargs", json.dumps(TINY_PTM_KWARGS)]
    command += ["--batch", "4", "--repeats", "1"]
    command += ["--stages", "2", "--default-stages", "2", "--ease-stages", "2"]
    command += ["--train-stages", "2", "--ease-train-stages", "2"]
    command += ["--no-memory", "--disk-stages", "2", "--disk-classes", "3", "--json", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    entry = json.loads(out.read_text())["archs"][TINY_PTM]
    report = entry["fp32"]
    assert set(report["ratio"]) == {
        "bare",
        "bare_no_grad",
        "drl_T2",
        "drl_default_T2",
        "ease_T2",
        "train_drl_s2",
        "train_ease_s2",
        "ranpac_T10",
        "ranpac_published_T10",
        "ranpac_carried_T10",
    }
    assert report["ratio"]["bare"] == 1.0 and all(r > 0 for r in report["ratio"].values())
    assert "| drl_T2 |" in result.stdout
    # stage files of a real run directory; the second stage's prototypes span one more subspace
    assert 0 < entry["disk"]["stage_1"] < entry["disk"]["stage_2"]
