"""``drl info``: what a run holds (PTM, method, stages, classes, sizes, the forget log, the accuracy
history) and how it grew, from its records alone (the PTM is not loaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..run.directory import RunDir
from ..run.forgotten import read_log
from ..run.layout import TOTALS
from ..run.records import (
    checked_metas,
    first_session_record,
    history_of,
    passes_record,
    read_record,
    recorded_recipe,
    switch_record,
    train_metrics,
    transfer_record,
    trial_record,
)
from ..run.track import frozen_track, switched, tied_track
from ..run.trackdir import TrackDir, owned_bytes


def _threshold(meta: dict[str, Any], key: str = "threshold") -> float | None:
    entry = meta.get("open_set")
    value = entry.get(key) if isinstance(entry, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def info(run_dir: Path | str) -> dict[str, Any]:
    """What the run holds: PTM, method, stages, classes, sizes, accuracy history (no PTM load)."""
    run = RunDir(run_dir)
    return run.read_generation(lambda manifest: _info(run, manifest))


def _info(run: RunDir, manifest: dict[str, Any]) -> dict[str, Any]:
    record, _ = read_record(run, manifest)
    stages, metas = [], checked_metas(run, manifest)
    forgotten = read_log(run, manifest, {meta["stage"]: meta for meta in metas})
    total_bytes = run.size_bytes(manifest) - owned_bytes(manifest)  # the track's files: its own line
    cum_bytes = cum_classes = trained_params = solved_params = 0
    for index, meta in zip(run.stage_indices(manifest), metas):
        evaluation = meta["metrics"].get("eval")
        stage_bytes = run.stage_bytes(index, manifest)
        if meta.get("train") is None:  # no stage network: its parameters are the head's, solved again each stage
            solved_params = meta["num_params"]
        elif "carry" in meta:  # a carried run trained its one stage network again: the same parameters
            trained_params = meta["num_params"]
        else:
            trained_params += meta["num_params"]
        cum_params = trained_params + solved_params
        cum_bytes += stage_bytes
        num_classes = len(forgotten.active(meta))
        cum_classes += num_classes
        stages.append(
            {
                "stage": index,
                "num_classes": num_classes,  # its classes the run answers with (not forgotten)
                "classes": meta["classes"],  # as learned
                "forgotten": forgotten.of_stage(index),  # of those, the ones out of the answers (drl forget)
                "num_images": sum(meta["images_per_class"].values()),
                "num_params": meta["num_params"],  # learned in this stage (the PTM is frozen)
                # no stage network: nothing the run answers would read it (train.skip_unread)
                "untrained": train_metrics(meta).get("skipped") is True,
                # a switched run's carried network, kept as it stood: its forward transfer stalled (schedule.pause)
                "paused": train_metrics(meta).get("paused") is True,
                # stage 1 of a run with schedule.decide: both held-out scores and what was kept
                "first_session": first_session_record(meta),
                # a carried run's stage after the first: does adapting transfer to classes it never trained on
                "transfer": transfer_record(meta),
                # a switched run: the track that answers after this stage, and both tracks' top-1
                "switch": switch_record(meta),
                # stage 1 of a run that tried adapting first: what the trial trained and measured
                "trial": trial_record(meta),
                # what learning the stage cost, in forward passes per image (null: not recorded)
                "passes": passes_record(meta),
                "bytes": stage_bytes,  # on disk: the stage's parameters, its classes' rows, stage.json
                # the newest stage also holds the run's running totals (its totals file: Grams, W)
                "holds_totals": run.stage_file_name(index, TOTALS, manifest) is not None,
                "cumulative_classes": cum_classes,
                # the model's parameters after this stage: every stage network so far and the newest
                # stage's solved head (W for every class seen supersedes the stage before's)
                "cumulative_params": cum_params,
                "cumulative_bytes": cum_bytes,  # every stage so far (base_bytes not included)
                "accuracy": evaluation["top1"] if evaluation else None,
                # its eval set: a folder registered for later evals ({path, ...}), or held out of the drop
                # (--eval-fraction: {held_out, seed, num_images, ...}, evaluated at this stage only); null: none
                "eval_data": meta.get("eval_data"),
                "train_seconds": train_metrics(meta).get("seconds"),
                "unknown_threshold": _threshold(meta),  # the open-set calibration (openset.py); null before it
                "unknown_rmd_threshold": _threshold(meta, "rmd_threshold"),  # the rmd score's; null before it
            }
        )
    return {
        "run_dir": str(run.path),
        "format_version": manifest["format_version"],
        "generation": manifest["generation"],
        "method": record["config"]["method"],
        "recipe": recorded_recipe(record),  # null for a run of an earlier release
        "ptm": {
            **{k: record["ptm"][k] for k in ("name", "kwargs", "sha256", "source", "data_config")},
            "hub": record["ptm"].get("hub"),  # hf-hub: repo, revision, weights_sha256; else null
        },
        "num_stages": len(stages),
        "num_classes": sum(s["num_classes"] for s in stages),
        "total_bytes": total_bytes,
        "base_bytes": total_bytes - cum_bytes,  # run.yaml (+ ptm.safetensors for --random-init)
        "stages": stages,
        "forgotten": [entry.to_dict() for entry in forgotten.forgotten],
        "forget_history": list(forgotten.events),
        "history": history_of(metas).to_dict(),
        "config": record["config"],
        "frozen_track": _frozen_track(run, manifest, metas),
    }


def _frozen_track(run: RunDir, manifest: dict[str, Any], metas: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A switched run's frozen track (``run/track.py``): where it lies (the run's own folder from
    format 5), its stages and bytes (its own files), and the track the run answers from (None: not
    a switched run)."""
    if not switched(run, manifest):
        return None
    if not metas:
        return {"run_dir": str(frozen_track(run, manifest).path), "num_stages": 0, "total_bytes": 0, "answers": None}
    track, held, answers = tied_track(run, manifest, metas)
    return {
        "run_dir": str(track.path),
        "num_stages": len(held["stages"]),
        # a track kept as a run of its own (before format 4): its manifest's files
        "total_bytes": owned_bytes(manifest) if isinstance(track, TrackDir) else track.size_bytes(held),
        "answers": answers,
    }
