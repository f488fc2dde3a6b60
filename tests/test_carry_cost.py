"""benchmarks/carry_cost.py times a carried stage's rebuild of the earlier classes' sums, each way."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "carry_cost.py"


def report(*args: str) -> dict:
    """The script's last line (its JSON report), after it exits 0."""
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_carry_cost_reports_each_mode_per_size_against_the_first():
    sizes = report("--classes", "2", "3", "--images", "2", "--modes", "drawn-1", "centred-1-g2")
    assert sizes["modes"] == ["drawn-1", "centred-1-g2"] and sizes["M"] == 3000
    rows = sizes["rows"]
    assert [(r["classes"], r["earlier_images"]) for r in rows] == [(2, 4), (3, 6)]
    for row in rows:
        assert row["drawn-1_ratio"] == 1.0 and row["drawn-1_s"] > 0 and row["centred-1-g2_s"] > 0
        assert row["centred-1-g2_ratio"] > 0 and row["centred-1-g2_ms_per_image"] > 0


def test_carry_cost_names_an_unknown_mode():
    result = subprocess.run([sys.executable, str(SCRIPT), "--modes", "sampled-3"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown mode sampled-3" in result.stderr


def test_carry_cost_times_whole_draws_against_first_token_draws():
    drawn = report("--draw-rounds", "3", "--classes", "2", "--images", "2", "--draw-count", "5")
    assert drawn["classes"] == 2 and drawn["draws_a_class"] == 5
    assert len(drawn["whole_s"]) == len(drawn["first_only_s"]) == 3
    assert min(drawn["whole_s"] + drawn["first_only_s"]) > 0 and drawn["median_ratio"] > 0
