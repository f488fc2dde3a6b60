"""SIGKILL at random moments, 20 times: the run is never corrupted and always finishes (issue 5).

Minutes long, so marked slow: CI runs it (`pytest -m slow`); the default run checks every crash
point of a commit deterministically instead (tests/test_crash_points.py)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fault_injection.py"


@pytest.mark.slow
def test_sigkill_never_corrupts_the_run(tmp_path):
    spec = importlib.util.spec_from_file_location("fault_injection", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.run_fault_injection(tmp_path, kills=20, seed=1, log=lambda _: None)
    assert report["kills"] == 20
    assert report["corrupted"] == 0, report["problems"]
    assert report["problems"] == []
    assert report["final_rerun_ok"] and report["final_check"] == "intact"
    assert report["stages_committed"] >= 2
