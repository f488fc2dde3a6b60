"""Issue 32, gate 3 of the carried preset: does the "unknown" answer suffer from class statistics
that stay as each class's own stage took them while later stages move the network?

    python unknown_drift.py RUN UNKNOWN_DIR TRAIN_DIR [TRAIN_DIR ...]

RUN is a run learned by `drl benchmark` (its stages registered their validation folders),
UNKNOWN_DIR class folders of classes it has not learned, each TRAIN_DIR a stage's training
folder in stage order. It scores the known validation images and the unknown ones twice: with the
rmd moments as stored, and with the moments taken again from every stage's training images
through the network as it is now (what moving them exactly would give: the bound). The
thresholds stay as stored. For a frozen-PTM run both agree, which checks the script.
"""

import json
import sys
from pathlib import Path

import torch

from drlcli.commands.evaluate import _open_set
from drlcli.data import scan_class_folders
from drlcli.evaluation import EvalSet, predict_sets, registered_eval_sets
from drlcli.heads.openset.rmd import Moments
from drlcli.run.load import load_run
from rmd_carry import joined, rows  # the same directory: the script's own


def main() -> None:
    run, unknown_dir, trains = Path(sys.argv[1]), Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]]
    loaded = load_run(run, device="cpu")
    model = loaded.model
    sets = registered_eval_sets(loaded)
    unknown = scan_class_folders(unknown_dir, what="unknown")
    every = [*sets, EvalSet(unknown, [-1] * len(unknown.class_names))]
    out = {}
    stored_moments, rmd_bias = model.unknown_rmd
    for name in ("stored", "recomputed"):
        if name == "recomputed":
            parts = []
            for train in trains:
                images = scan_class_folders(train)
                _, rmd, labels = rows(model, images)
                parts.append(Moments.of(rmd, labels, len(images.class_names)))
            moments = joined(parts)
            if moments.means.shape != stored_moments.means.shape:
                raise SystemExit(
                    f"recomputed {tuple(moments.means.shape)} != stored {tuple(stored_moments.means.shape)}"
                )
            move = float((moments.means - stored_moments.means).norm() / stored_moments.means.norm())
            out["relative_move_of_the_means"] = round(move, 5)
            model.calibrated(model.unknown_bias, (moments, rmd_bias))
        ranked, targets, known = predict_sets(model, every)
        report = _open_set(model, ranked, targets, known).to_dict()
        keep = (
            "auroc",
            "unknown_accepted",
            "known_rejected",
            "top1_accepted",
            "top1_closed",
            "num_known",
            "num_unknown",
        )
        out[name] = {k: report[k] for k in keep}
        print(name, json.dumps(out[name]), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
