"""How far the "unknown" answer's moments should move with a carried run's network (issue 32).

    python rmd_carry.py SNAP_1 ... SNAP_K --trains TRAIN_1 ... TRAIN_K --unknown UNKNOWN_DIR

SNAP_k is a copy of a carried run (``ranpac --preset carried``) taken after its stage k, TRAIN_k
that stage's training folder, UNKNOWN_DIR class folders the run never learns. The script replays
the run's moves of the rmd moments (``openset.rmd.carried_moments``) with λ scaled from the tool's,
from every stage's images through the network as it began (SNAP_{k-1}) and as it ended (SNAP_k),
and scores the newest snapshot's known validation images (its registered evaluation sets) against
the unknown ones with each: AUROC, and the share of known images rejected at the run's stored
thresholds. Two references: the moments as each stage took them (no move), and recomputed from every
stage's training images on the newest network (a bound: a run keeps no image to do this).
Prints one JSON line per variant, then a summary. The tool's own variant must equal the newest
snapshot's stored moments (checked: the replay is the tool's arithmetic).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from drlcli.data import scan_class_folders
from drlcli.evaluation import EVAL_BATCH_SIZE, registered_eval_sets
from drlcli.heads.openset.report import auroc
from drlcli.heads.openset.rmd import Moments, RmdKnown, carried_moments, open_set_bias
from drlcli.model import embed_images
from drlcli.run.load import load_run

SCALES = (0.01, 0.1, 1.0, 10.0, 100.0, 1e6)  # times the tool's λ (1.0)


def rows(model, images):
    """(f_0 (N, d), rmd inputs (N, w), labels (N,)) of ``images`` on ``model``'s network."""
    feats, labels = embed_images(
        model.network,
        images,
        model.data_config,
        batch_size=EVAL_BATCH_SIZE,
        probes=model.probes_read,
        layout=model.layout_scored,
    )
    head_rows, rmd = model.split(feats)
    return head_rows[:, 0], rmd, labels


def joined(parts):
    out = parts[0]
    for part in parts[1:]:
        out = out.joined(part)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("snapshots", nargs="+", type=Path)
    parser.add_argument("--trains", nargs="+", type=Path, required=True)
    parser.add_argument("--unknown", type=Path, required=True)
    args = parser.parse_args()
    if len(args.trains) != len(args.snapshots):
        raise SystemExit("one training folder per snapshot")
    models = [load_run(s, device="cpu") for s in args.snapshots]
    newest = models[-1]
    lam = float(newest.config.ranpac.carry_lambda)
    images = [scan_class_folders(t) for t in args.trains]
    own, steps = [], []  # each stage's moments as taken; (f_0, x before, x after) of stages 2..K
    for k, (loaded, stage_images) in enumerate(zip(models, images)):
        f0, after, labels = rows(loaded.model, stage_images)
        own.append(Moments.of(after, labels, len(stage_images.class_names)))
        if k:
            f0_before, before, _ = rows(models[k - 1].model, stage_images)
            steps.append((f0_before, before, after))
        print(f"stage {k + 1} embedded", flush=True)
    stored, rmd_bias = newest.model.unknown_rmd
    variants = {"as taken (no move)": joined(own)}
    for scale in SCALES:
        moments = own[0]
        for k, (f0_before, before, after) in enumerate(steps):
            moments = carried_moments(moments, f0_before, before, after, lam * scale)[0].joined(own[k + 1])
        variants[f"moved, λ × {scale:g}"] = moments
    tool = variants["moved, λ × 1"]
    gap = float((tool.means - stored.means).abs().max())
    print(json.dumps({"replay_vs_stored_max_abs_mean": gap}), flush=True)
    bound = []
    for stage_images in images:
        _, rmd, labels = rows(newest.model, stage_images)
        bound.append(Moments.of(rmd, labels, len(stage_images.class_names)))
    variants["recomputed on the newest network (bound)"] = joined(bound)
    known_rows = torch.cat([rows(newest.model, s.images)[1] for s in registered_eval_sets(newest)])
    unknown_rows = rows(newest.model, scan_class_folders(args.unknown, what="unknown"))[1]
    bias = open_set_bias(rmd_bias)
    out = {}
    for name, moments in variants.items():
        scorer = RmdKnown(moments, bias)
        known, unknown = scorer(known_rows), scorer(unknown_rows)
        out[name] = {
            "auroc": round(auroc(known, unknown), 4),
            "known_rejected": round(100 * float((known < 0).double().mean()), 2),
            "unknown_accepted": round(100 * float((unknown >= 0).double().mean()), 2),
            "mean_move_from_bound": round(
                float((moments.means - variants["recomputed on the newest network (bound)"].means).norm())
                / float(variants["recomputed on the newest network (bound)"].means.norm()),
                4,
            ),
        }
        print(name, json.dumps(out[name]), flush=True)
    print(json.dumps({"known": len(known_rows), "unknown": len(unknown_rows), "variants": out}))


if __name__ == "__main__":
    main()
