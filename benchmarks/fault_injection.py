"""Fault injection: SIGKILL `drl learn-stage` at random moments and check the run survives.

    python benchmarks/fault_injection.py --kills 20 --work /tmp/drl-faults

Each round launches `python -m drlcli learn-stage` (tiny random ViT, generated images) for the
next stage and kills it with SIGKILL after a random delay spread over a whole uninterrupted run
(import, validation, training epochs, checkpoints, prototypes, evaluation, commit). After every
kill it checks that `drl verify` passes and that `drl eval` works on the last committed state;
the next round re-runs the same stage, which resumes from the last epoch checkpoint if one was
written. At the end one more run completes every interrupted stage. Prints a JSON report:
kills, corrupted runs (must be 0), resumes, and where the kills landed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from drlcli import api
from drlcli.config import RunConfig
from drlcli.errors import DrlError
from drlcli.run.directory import RunDir
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_class_folders

EPOCHS = 8


def _command(run: Path, train: Path, test: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "drlcli",
        "learn-stage",
        "--run",
        str(run),
        "--data",
        str(train),
        "--eval-data",
        str(test),
        "--epochs",
        str(EPOCHS),
        "--batch-size",
        "8",
        "--device",
        "cpu",
        "--json",
        "--quiet",
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _stage_data(work: Path, stage: int) -> tuple[Path, Path]:
    ids = [2 * (stage - 1), 2 * (stage - 1) + 1]
    root = work / "data" / f"stage{stage:02d}"
    if not root.exists():
        make_class_folders(root / "train", ids, images_per_class=16)
        make_class_folders(root / "test", ids, images_per_class=4, offset=16)
    return root / "train", root / "test"


def _check(run: Path) -> str | None:
    """None if the run is intact and usable, else what is wrong."""
    try:
        api.verify(run)
        if RunDir(run).stage_indices():
            api.evaluate(run, all_seen=True, device="cpu")
    except DrlError as exc:
        return str(exc)
    return None


def _where(run: Path, committed_before: int) -> str:
    """Which phase the kill interrupted, judged from what it left behind."""
    committed = len(RunDir(run).stage_indices())
    if committed > committed_before:
        return "after the commit"
    checkpoint = RunDir(run).checkpoint()
    if checkpoint is None:
        return "before the first epoch checkpoint"
    epoch = checkpoint[0]["epoch"]
    return "during training" if epoch < EPOCHS else "after training (prototypes, evaluation, commit)"


def run_fault_injection(work: Path, *, kills: int, seed: int = 0, log: Any = print) -> dict[str, Any]:
    rng = random.Random(seed)
    work = Path(work)
    run = work / "run"
    # the stages trained (train.skip_unread false), so that kills land in epochs and checkpoints too
    config = RunConfig.for_method("drl", {"train": {"skip_unread": False}}, preset="frozen")
    api.init_run(run, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS, config=config)
    # one uninterrupted stage measures how long a whole learn-stage takes here
    train, test = _stage_data(work, 1)
    start = time.monotonic()
    subprocess.run(_command(run, train, test), env=_env(), check=True, capture_output=True)
    duration = time.monotonic() - start
    report: dict[str, Any] = {
        "kills": 0,
        "corrupted": 0,
        "resumes": 0,
        "completed_runs": 1,
        "seconds_per_run": round(duration, 2),
        "landed": {},
        "problems": [],
    }
    rounds = 0
    while report["kills"] < kills:
        rounds += 1
        if rounds > 5 * kills:
            report["problems"].append(f"gave up after {rounds - 1} rounds: runs keep ending before the kill")
            break
        committed = len(RunDir(run).stage_indices())
        train, test = _stage_data(work, committed + 1)
        proc = subprocess.Popen(_command(run, train, test), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        delay = rng.uniform(0.3, 1.05) * duration
        try:
            out, _ = proc.communicate(timeout=delay)
            _count_completion(report, proc.returncode, out)
            continue
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
        report["kills"] += 1
        where = _where(run, committed)
        report["landed"][where] = report["landed"].get(where, 0) + 1
        problem = _check(run)
        if problem:
            report["corrupted"] += 1
            report["problems"].append(problem)
        log(
            f"kill {report['kills']}/{kills} after {delay:.1f}s: {where}; {'CORRUPTED: ' + problem if problem else 'intact'}"
        )
    # a final clean run finishes whatever the last kill interrupted
    committed = len(RunDir(run).stage_indices())
    train, test = _stage_data(work, committed + 1)
    done = subprocess.run(_command(run, train, test), env=_env(), capture_output=True)
    _count_completion(report, done.returncode, done.stdout)
    report["final_rerun_ok"] = done.returncode == 0
    report["stages_committed"] = len(RunDir(run).stage_indices())
    report["final_check"] = _check(run) or "intact"
    return report


def _count_completion(report: dict[str, Any], code: int, out: bytes) -> None:
    if code != 0:
        report["problems"].append(f"a run exited {code}: {out.decode(errors='replace')[-300:]}")
        return
    result = json.loads(out)
    report["completed_runs"] += 1
    if result.get("resumed_from_epoch"):
        report["resumes"] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--work", type=Path, required=True, help="empty folder for data and the run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.work.exists() and any(args.work.iterdir()):
        parser.error(f"--work {args.work} is not empty; pass a new folder")
    report = run_fault_injection(args.work, kills=args.kills, seed=args.seed, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(report, indent=2))
    sys.exit(0 if report["corrupted"] == 0 and report["final_rerun_ok"] and not report["problems"] else 1)


if __name__ == "__main__":
    main()
