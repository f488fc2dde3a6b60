"""Build per-stage class folders (symlinks, nothing copied) from Caltech-101's train/test lists.

    python examples/caltech101_stages.py --caltech ../shared/data/caltech101 --out /tmp/caltech-stages \
        --num-classes 30 --per-stage 10

gives /tmp/caltech-stages/stage{1,2,3}/{train,test}/<class>/... for `drl learn-stage --data ...
--eval-data ...`. Classes are taken in sorted order; BACKGROUND_Google lines are skipped.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def read_list(path: Path) -> dict[str, list[str]]:
    by_class: dict[str, list[str]] = {}
    for line in path.read_text().split():
        cls = line.split("/")[0]
        if cls != "BACKGROUND_Google":
            by_class.setdefault(cls, []).append(line)
    return by_class


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--caltech", type=Path, required=True, help="folder with 101_ObjectCategories, train.txt, test.txt"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-classes", type=int, default=30)
    parser.add_argument("--per-stage", type=int, default=10)
    parser.add_argument("--max-train-per-class", type=int, default=None)
    args = parser.parse_args()
    images = (args.caltech / "101_ObjectCategories").resolve()
    splits = {name: read_list(args.caltech / f"{name}.txt") for name in ("train", "test")}
    classes = sorted(splits["train"])[: args.num_classes]
    for k in range(0, len(classes), args.per_stage):
        for split, by_class in splits.items():
            for cls in classes[k : k + args.per_stage]:
                lines = by_class[cls][: args.max_train_per_class] if split == "train" else by_class[cls]
                folder = args.out / f"stage{k // args.per_stage + 1}" / split / cls
                folder.mkdir(parents=True, exist_ok=True)
                for line in lines:
                    link = folder / Path(line).name
                    if not link.exists():
                        link.symlink_to(images / line)
    print(args.out)


if __name__ == "__main__":
    main()
