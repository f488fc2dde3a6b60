"""Both heads of a switched run at once: would answering from the sum of the adapted head's and the frozen
head's scores beat answering from either? An open question (docs/performance.md, "Answering from both
heads"); this script measures it on runs ``drl benchmark`` left, without changing them.

    python benchmarks/both_heads.py RUN_DIR [RUN_DIR ...] --ptm-weights $W [--threads 2]

    python benchmarks/both_heads.py --per-stage FILE.jsonl -- benchmark --data SK --out OUT ... --methods default

RUN_DIR is a switched run (the default recipe) with eval data registered (``drl benchmark`` registers each
stage's test images). Both heads score the same images: the run's own model (the adapted network, its head,
whichever head the run answers from) and its frozen track's (the frozen PTM, its head). Each head's (N, C)
scores are standardised per image (mean 0, std 1 over the classes) and summed. One JSON line per run: the
top-1 (%) of the adapted head, the frozen head and the sum, and the images; with ``--frozen-weights W ...``,
also (``weighted``) that of each sum with the frozen head's scores weighted by W; with ``--scores DIR``, each
line's standardised scores and targets are saved in DIR (a ``.pt`` file a line), for other rules scored later. With ``--per-stage``, the rest
of the command line is a ``drl`` command (``benchmark ...``) run in this process, and after every stage a
switched run learns, its line (with the variant and the stage) is appended to FILE: a run's directory keeps
only its newest stage's head. It costs two more evaluations a stage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from drlcli.evaluation import EVAL_BATCH_SIZE, registered_eval_sets
from drlcli.model import embed_images
from drlcli.run.directory import RunDir
from drlcli.run.load import LoadedRun, load_own, load_run
from drlcli.run.track import switched
from drlcli.run.trackdir import frozen_track


def head_scores(loaded: LoadedRun) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, C) scores and (N,) global targets of the run's registered eval images under its model."""
    model, scores, targets = loaded.model, [], []
    for item in registered_eval_sets(loaded):
        feats, labels = embed_images(
            model.network,
            item.images,
            model.data_config,
            batch_size=EVAL_BATCH_SIZE,
            stages=model.stages_scored,
            layout=model.layout_scored,
            probes=model.probes_read,
        )
        scores.append(model.scores(model.split(feats)[0]))
        targets.append(torch.tensor(item.label_map, dtype=torch.long)[labels])
    return torch.cat(scores), torch.cat(targets)


def standardised(scores: torch.Tensor) -> torch.Tensor:
    return (scores - scores.mean(1, keepdim=True)) / scores.std(1, keepdim=True)


def measure(
    run_dir: Path, weights: Path | None, frozen_weights: tuple[float, ...] = (), scores_to: Path | None = None
) -> dict[str, object]:
    run = RunDir(run_dir)
    if not switched(run, run.manifest()):
        raise SystemExit(f"{run_dir}: not a switched run (the default recipe's): it has one head")
    # the adapted network's model, whichever head the run answers from
    adapted = run.read_generation(lambda m: load_own(run, m, device="cpu", ptm_weights=weights, scoring=True))
    frozen = load_run(frozen_track(adapted.run, adapted.manifest), device="cpu", ptm_weights=weights)
    if frozen.model.class_names != adapted.model.class_names:
        raise SystemExit(f"{run_dir}: the frozen track holds other classes than the run")
    (a, targets), (f, frozen_targets) = head_scores(adapted), head_scores(frozen)
    if not torch.equal(targets, frozen_targets):
        raise SystemExit(f"{run_dir}: the two heads read different eval images")

    def top1(scores: torch.Tensor) -> float:
        return round(100.0 * (scores.argmax(1) == targets).float().mean().item(), 2)

    a, f = standardised(a), standardised(f)
    if scores_to is not None:  # for other rules of summing, scored later
        torch.save({"adapted": a, "frozen": f, "targets": targets}, scores_to)
    row = {"run": str(run_dir), "images": len(targets), "adapted": top1(a), "frozen": top1(f), "both": top1(a + f)}
    if frozen_weights:  # the sum with the frozen head's scores weighted by w (1: "both")
        row["weighted"] = {str(w): top1(a + w * f) for w in frozen_weights}
    return row


def per_stage(
    out: Path, command: list[str], frozen_weights: tuple[float, ...] = (), scores: Path | None = None
) -> None:
    """Run the ``drl`` ``command`` here, measuring every switched run after each stage it learns."""
    from drlcli.benchmark import runner
    from drlcli.cli import app

    learn = runner._Session._learn

    def learn_and_measure(session, v_index, variant, run_dir, k):  # noqa: ANN001, ANN202
        learn(session, v_index, variant, run_dir, k)
        run = RunDir(run_dir)
        if session.main and switched(run, run.manifest()):
            with torch.inference_mode():
                to = scores / f"{variant.label}-{k + 1:03d}.pt" if scores else None
                row = measure(run_dir, session.settings.ptm_weights, frozen_weights, to)
            with out.open("a") as f:
                f.write(json.dumps({"variant": variant.label, "stage": k + 1, **row}) + "\n")

    runner._Session._learn = learn_and_measure
    app(command, standalone_mode=False)


def main() -> None:
    argv = sys.argv[1:]
    command = argv[argv.index("--") + 1 :] if "--" in argv else []  # --per-stage's drl command
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-stage", type=Path, help="append each stage's line here; then: -- benchmark ARGS")
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument(
        "--ptm-weights", type=Path, help="the PTM's weights file (a run made on a tiny random ViT: none)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--frozen-weights",
        type=float,
        nargs="+",
        default=(),
        help="also score the sum with the frozen head's standardised scores weighted by each W",
    )
    parser.add_argument("--scores", type=Path, help="save each line's standardised scores (.pt) in this folder")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if (args.per_stage is None) != (not command) or (command and args.runs):
        parser.error("give RUN_DIRs, or --per-stage FILE -- and a drl command")
    if args.per_stage is not None:
        per_stage(args.per_stage, command, tuple(args.frozen_weights), args.scores)
        return
    with torch.inference_mode():
        for i, run_dir in enumerate(args.runs):
            to = args.scores / f"{i}-{run_dir.name}.pt" if args.scores else None
            print(json.dumps(measure(run_dir, args.ptm_weights, tuple(args.frozen_weights), to)), flush=True)


if __name__ == "__main__":
    main()
