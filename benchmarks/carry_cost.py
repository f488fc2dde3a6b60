"""What a carried stage's rebuild of the earlier classes' sums costs as they grow (issue 32, scale).

    python benchmarks/carry_cost.py                  # 25, 100 and 400 classes of 20 images: drawn-100, centred-25-g50000
    python benchmarks/carry_cost.py --classes 50 200 --images 40 --modes drawn-100 centred-100-g100000

A carried stage (the default ``drl`` where its set trains: ``drl --preset carried`` and the switched
default once its network answers) draws every earlier class's Gaussian again and rebuilds the ridge
head's sums from the draws (``heads/ridge/sums.expected_sums``). This times that rebuild, the real
function, on synthetic class Gaussians of the default's shape on DeiT-Tiny (five tokens of d 192, rank
16, moved by one map; M 3000), each mode one after the other at each size: ``drawn-K`` (E[φ] and the
Grams from K draws an image: ``ranpac.carry_mean drawn``, ``carry_draws`` K), ``centred-K`` (E[φ] in
closed form, the Grams centred on it, K draws an image: ``carry_mean exact``) and ``centred-K-gB``
(the same, the Grams from about B draws over all the classes: ``carry_gram_draws`` B); ``split-K-gB``
the same with each class's rows split between the fit and held-out Grams, many classes in one
product (``expected_sums(split_rows=True)``). Prints each
mode's seconds per size, its ratio to the first mode's, and its milliseconds per earlier image: a
cost that grows with the images seen keeps that rate; one that stays flat sees it fall.

    python benchmarks/carry_cost.py --draw-rounds 5 --classes 100 --draw-count 438

``--draw-rounds N`` instead times the draws the Grams do not read (``ClassGaussians.draw`` whole
against ``first_only``, the first token alone), ``--draw-count`` of them for every class, the two
turn about N times, and prints the median ratio first-only / whole.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch

from drlcli.heads.ridge.carry.gaussians import ClassGaussians, TokenMaps
from drlcli.heads.ridge.carry.sums import expected_sums

S, D, RANK, M = 5, 192, 16, 3000
MODE = re.compile(r"(drawn|centred|split)-(\d+)(?:-g(\d+))?$")


def gaussians(classes: int, images: int, seed: int) -> ClassGaussians:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(images, S, D, generator=g) * 0.3 + torch.randn(1, S, D, generator=g) for _ in range(classes)]
    before = torch.randn(400, S, D, generator=g)
    after = before + 0.05 * torch.randn(400, S, D, generator=g)
    return ClassGaussians.of(rows, RANK).moved(TokenMaps.fit(before, after, 1000.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", nargs="+", type=int, default=[25, 100, 400])
    parser.add_argument("--images", type=int, default=20, help="images a class")
    parser.add_argument("--modes", nargs="+", default=["drawn-100", "centred-25-g50000"])
    parser.add_argument("--draw-rounds", type=int, default=0, help="time whole against first-token draws instead")
    parser.add_argument("--draw-count", type=int, default=438, help="draws a class with --draw-rounds")
    args = parser.parse_args()
    if args.draw_rounds:
        draw_ratio(args.classes[0], args.images, args.draw_count, args.draw_rounds)
        return
    modes = {}
    for name in args.modes:
        match = MODE.match(name)
        if match is None:
            parser.error(f"unknown mode {name}: drawn-K, centred-K, centred-K-gB or split-K-gB")
        modes[name] = (
            match.group(1),
            int(match.group(2)),
            int(match.group(3)) if match.group(3) else None,
        )
    projection = torch.randn(S * D, M, generator=torch.Generator().manual_seed(0), dtype=torch.float64) / D**0.5
    rows = []
    for classes in args.classes:
        carried = gaussians(classes, args.images, seed=classes)
        parts = torch.tensor([[args.images - args.images // 5, args.images // 5]] * classes)
        images = classes * args.images
        row = {"classes": classes, "earlier_images": images}
        first = None  # the first mode's seconds, unrounded: each ratio is to it
        for name, (kind, draws, budget) in modes.items():
            tick = time.perf_counter()
            expected_sums(
                carried,
                parts,
                projection=projection,
                layout_cells=S - 1,
                draws=draws,
                generator=torch.Generator().manual_seed(1),
                exact_mean=kind != "drawn",
                gram_draws=budget,
                split_rows=kind == "split",
            )
            seconds = time.perf_counter() - tick
            first = seconds if first is None else first
            row.update(
                {
                    f"{name}_s": round(seconds, 2),
                    f"{name}_ratio": round(seconds / first, 3),
                    f"{name}_ms_per_image": round(1000 * seconds / images, 2),
                }
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"modes": args.modes, "M": M, "images_a_class": args.images, "rows": rows}))


def draw_ratio(classes: int, images: int, count: int, rounds: int) -> None:
    """Whole draws against first-token draws of every class, turn about ``rounds`` times."""
    carried = gaussians(classes, images, seed=classes)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for first_only in (False, True):
            generator = torch.Generator().manual_seed(1)
            tick = time.perf_counter()
            for c in range(classes):
                carried.draw(c, count, generator, first_only=first_only)
            seconds[first_only].append(time.perf_counter() - tick)
    ratios = sorted(b / a for a, b in zip(seconds[False], seconds[True], strict=True))
    print(
        json.dumps(
            {
                "classes": classes,
                "draws_a_class": count,
                "whole_s": [round(s, 6) for s in seconds[False]],
                "first_only_s": [round(s, 6) for s in seconds[True]],
                "median_ratio": round(ratios[len(ratios) // 2], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
