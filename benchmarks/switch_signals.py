"""Which head should a long switched run answer from? Three signals read from the stages' own training images,
beside the gap between the heads' recorded eval top-1, stage by stage (docs/performance.md, "A long run that
trains"). A research script: it recomputes the signals on a run ``drl benchmark`` left, without changing it.

    python benchmarks/switch_signals.py OUT/runs/default OUT/data --ptm-weights $W

The run must be a switched run (the default recipe) whose adapter set trained at stage 1 only (the long run of
drops of two classes: every later stage defers), so that its final network is the network every later stage
began with. Per stage after the first, the images of the stage's training folder (OUT/data/stage_KK/train) are
answered by the adapted network and the frozen PTM, and each signal counts the images only the adapted side
answers right (better) and only the frozen side does (worse), for the stage and summed over the run so far:

- ``own``: leave-one-out nearest class mean (cosine, on f_0) among the stage's own classes: the run's forward
  transfer (``metrics.measure``), which the script checks against the counts the stage recorded;
- ``all``: the same over every class seen so far (earlier classes' means from their own stages' images);
- ``ridge``: each head's ridge part, refitted on real features of every image seen so far at the λ its stage
  chose, leave-one-out (exact for a ridge: s_i - h_ii y_i over 1 - h_ii) over every class seen so far.

One line a stage: the recorded gap (adapted minus frozen top-1 on the eval images) and each signal's counts,
with T where the run's counts say adapting transfers (``Transfer.transfers``) and L where they say it loses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from drlcli.data.images import scan_class_folders
from drlcli.heads.ridge.head import head_input
from drlcli.metrics import Transfer
from drlcli.model import embed_images
from drlcli.run.directory import RunDir
from drlcli.run.load import LoadedRun, load_own, load_run
from drlcli.run.track import switched
from drlcli.run.trackdir import frozen_track

SIDES = ("adapted", "frozen")
SIGNALS = ("own", "all", "ridge")


def nearest_mean_right(x: torch.Tensor, labels: torch.Tensor, sums: torch.Tensor, among: list[int]) -> torch.Tensor:
    """(N,) whether the nearest class mean (cosine) among classes ``among`` answers each row right, with
    ``sums`` (C, d) the sums of every class's normalised rows (these rows included, taken out of their own)."""
    x = F.normalize(x.double(), dim=1)
    scores = x @ F.normalize(sums, dim=1).T
    scores[torch.arange(len(labels)), labels] = (x * F.normalize(sums[labels] - x, dim=1)).sum(1)
    kept = torch.full_like(scores, -torch.inf)
    kept[:, among] = 0
    return (scores + kept).argmax(1) == labels


class Side:
    """One head's running sums over the stages: class sums of normalised f_0, and its ridge's Gram and Q."""

    def __init__(self, loaded: LoadedRun, classes: int):
        self.model, self.head = loaded.model, loaded.model.head
        size = self.head.projection.shape[1]
        self.sums = torch.zeros(classes, self.model.network.width, dtype=torch.float64)
        self.gram = torch.zeros(size, size, dtype=torch.float64)
        self.q = torch.zeros(size, classes, dtype=torch.float64)

    def stage(self, images, index: dict[str, int], lam: float, new: list[int]) -> tuple[torch.Tensor, dict]:  # noqa: ANN001
        with torch.inference_mode():
            feats, local = embed_images(
                self.model.network,
                images,
                self.model.data_config,
                batch_size=64,
                stages=0,
                layout=self.head.layout_grid,
            )
        labels = torch.tensor([index[images.class_names[i]] for i in local.tolist()])
        f0 = feats[:, 0]
        self.sums.index_add_(0, labels, F.normalize(f0.double(), dim=1))
        seen = list(range(int(labels.max()) + 1))
        right = {
            "own": nearest_mean_right(f0, labels, self.sums, new),
            "all": nearest_mean_right(f0, labels, self.sums, seen),
            "ridge": self._ridge_right(feats, labels, lam, len(seen)),
        }
        return labels, right

    def _ridge_right(self, feats: torch.Tensor, labels: torch.Tensor, lam: float, seen: int) -> torch.Tensor:
        cells = self.head.layout_grid**2
        phi = torch.relu(head_input(feats, self.head.projection.shape[0], cells) @ self.head.projection).double()
        targets = F.one_hot(labels, self.q.shape[1]).double()
        self.gram += phi.T @ phi
        self.q += phi.T @ targets
        factor = torch.linalg.cholesky(self.gram + lam * torch.eye(len(self.gram), dtype=torch.float64))
        solved = torch.cholesky_solve(torch.cat([self.q[:, :seen], phi.T], 1), factor)
        scores = phi @ solved[:, :seen]
        leverage = (phi * solved[:, seen:].T).sum(1)
        left_out = (scores - leverage[:, None] * targets[:, :seen]) / (1 - leverage)[:, None]
        return left_out.argmax(1) == labels


def counts(adapted: torch.Tensor, frozen: torch.Tensor) -> Transfer:
    return Transfer(int((adapted & ~frozen).sum()), int((frozen & ~adapted).sum()), len(adapted))


def verdict(total: Transfer) -> str:
    return "T" if total.transfers else ("L" if total.loses else "-")


def run_signals(run_dir: Path, data: Path, weights: Path | None) -> None:
    run = RunDir(run_dir)
    if not switched(run, run.manifest()):
        raise SystemExit(f"{run_dir}: not a switched run (the default recipe's): it has one head")
    adapted = run.read_generation(lambda m: load_own(run, m, device="cpu", ptm_weights=weights, scoring=True))
    frozen = load_run(frozen_track(adapted.run, adapted.manifest), device="cpu", ptm_weights=weights)
    names = adapted.model.class_names
    index = {name: i for i, name in enumerate(names)}
    sides = {"adapted": Side(adapted, len(names)), "frozen": Side(frozen, len(names))}
    total = dict.fromkeys(SIGNALS, Transfer(0, 0, 0))
    for meta, frozen_meta in zip(adapted.stage_metas, frozen.stage_metas, strict=True):
        k = meta["stage"]
        if k > 1 and (meta.get("metrics", {}).get("passes", {}).get("training") or 0) > 0:
            raise SystemExit(f"{run_dir}: stage {k} trained the set: the final network is not the one it began with")
        images = scan_class_folders(data / f"stage_{k:02d}" / "train")
        new = sorted(index[name] for name in images.class_names)
        lams = {"adapted": meta["ridge"]["lambda"], "frozen": frozen_meta["ridge"]["lambda"]}
        right = {side: sides[side].stage(images, index, lams[side], new)[1] for side in SIDES}
        if k == 1:
            continue
        line = {"stage": k, "gap": round(meta["switch"]["top1"]["carried"] - meta["switch"]["top1"]["frozen"], 2)}
        for signal in SIGNALS:
            now = counts(right["adapted"][signal], right["frozen"][signal])
            total[signal] = total[signal] + now
            line[signal] = (
                f"{now.better}/{now.worse}, run {total[signal].better}/{total[signal].worse} {verdict(total[signal])}"
            )
        recorded = meta["carry"]["transfer"]
        if line["own"].split(",")[0] != f"{recorded['better']}/{recorded['worse']}":
            raise SystemExit(f"stage {k}: own counts {line['own']} differ from the recorded {recorded}")
        print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a switched run drl benchmark left (OUT/runs/default)")
    parser.add_argument("data", type=Path, help="its stages' folders (OUT/data)")
    parser.add_argument("--ptm-weights", type=Path, help="the PTM's weights file")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run_signals(args.run, args.data, args.ptm_weights)


if __name__ == "__main__":
    main()
