"""benchmarks/scale.py runs the real commands stage after stage and reports how each cost grows."""

import json
import subprocess
import sys
from pathlib import Path

from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py"


def test_scale_benchmark_reports_every_stage_and_the_extrapolation(tmp_path):
    out = tmp_path / "report.json"
    command = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "scratch"), "--stages", "3", "--classes", "2"]
    command += ["--images", "3", "--repeats", "1", "--ptm", TINY_PTM, "--ptm-kwargs", json.dumps(TINY_PTM_KWARGS)]
    command += ["--reference", TINY_PTM, "--json", str(out), "--paired", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    rows = report["stages"]
    assert [r["stage"] for r in rows] == [1, 2, 3]
    assert all(r["feature_pass"] >= 0 and r["head_fit"] > 0 and r["read_mib"] > 0 for r in rows)
    assert rows[2]["stages_mib"] > rows[0]["stages_mib"] > 0  # every stage adds its files
    assert report["export"]["mib"] > report["base_mib"] > 0 and report["predict"]["images"] == 6
    assert report["predict"]["process_peak_rss_mib"] > 0  # predict in a process of its own
    assert report["head_cost"]["ratio"] > 0
    assert set(report["extrapolated_to_365"]) >= {"head_fit", "read_mib", "stages_mib", "export_mib_beyond_ptm"}
    export = report["extrapolated_to_365"]["export_mib_beyond_ptm"]  # a line through two exports: stage 1's and 3's
    assert report["early_export"]["classes"] == 2 and export["per_class_kib"] > 0
    assert 0 < export["two_exports"] <= export["proportional"]  # the fixed part is not scaled
    assert "3 stages of 2 classes" in result.stdout
    pair = report["paired"]  # one more drop on the run after stage 1 and after stage 3, twice each
    assert pair["repeats"] == 2 and pair["stages"] == {"early": 2, "late": 4}
    assert pair["without_features"]["late"] > 0 and pair["without_features"]["median_ratio"] > 0
    assert "learn-stage without the feature pass at stage 4 / stage 2" in result.stdout
