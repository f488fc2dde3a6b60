"""The B-m Inc-n protocol (SPEC §4) as pure functions: the data on disk, the class order, the
stages' classes, the validation split and the per-class caps. No training, no files written.

Data: class folders (``train/`` and ``test/`` under one folder) or one class-folder tree plus
``train.txt``/``test.txt`` list files (Caltech-101's layout; ``--skip-class`` lines are dropped).
Class order: the sorted class names permuted with ``numpy.random.RandomState(seed)`` (what
LAMDA-PILOT does), so a seed gives the same order as there.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data import scan_class_folders
from ..errors import DataError, UsageError
from ..options import MAX_SEED

DEFAULT_SEED = 1993  # PILOT's class-order seed


def parse_split(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"B(\d+)Inc(\d+)", text.strip(), flags=re.IGNORECASE)
    if not match or int(match.group(2)) == 0:
        raise UsageError(f"--split {text!r} is not B<m>Inc<n> with n > 0; use e.g. B0Inc10 or B50Inc10")
    return int(match.group(1)), int(match.group(2))


def parse_seeds(text: str) -> tuple[int, ...]:
    """``1993,1994,1995`` -> (1993, 1994, 1995)."""
    try:
        seeds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(
            f"--seeds {text!r} is not a comma-separated list of integers; use e.g. 1993,1994,1995"
        ) from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds {text!r} must list distinct integers, e.g. 1993,1994,1995")
    if not all(0 <= s <= MAX_SEED for s in seeds):
        raise UsageError(f"--seeds {text!r}: every seed must be in [0, {MAX_SEED}] (like --seed)")
    return seeds


# ----------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class BenchmarkData:
    """Image paths per class for train and test (list order kept)."""

    train: dict[str, list[Path]]
    test: dict[str, list[Path]]
    source: str


def _check_list_line(list_file: Path, images_root: Path, line: str) -> None:
    if line.startswith("/") or ".." in Path(line).parts:
        raise DataError(
            f"{list_file}: line {line!r} points outside {images_root}; list paths relative to it as <class>/<file>"
        )
    if "/" not in line:
        raise DataError(f"{list_file}: line {line!r} is not <class>/<file>; fix the list file")


def _read_list(list_file: Path, images_root: Path, skip: set[str]) -> dict[str, list[Path]]:
    by_class: dict[str, list[Path]] = {}
    try:
        lines = list_file.read_text().split()
    except OSError as exc:
        raise DataError(f"cannot read list file {list_file}: {exc.strerror}; check the path") from exc
    except UnicodeDecodeError as exc:
        raise DataError(f"list file {list_file} is not UTF-8 text ({exc.reason}); fix the list file") from exc
    for line in lines:
        cls = line.split("/")[0]
        if cls in skip:
            continue
        _check_list_line(list_file, images_root, line)
        by_class.setdefault(cls, []).append(images_root / line)
    missing = [p for paths in by_class.values() for p in paths if not p.is_file()]
    if missing:
        raise DataError(
            f"{len(missing)} image(s) listed in {list_file} are missing, e.g. {missing[0]}; "
            "fix the list or the image folder"
        )
    return by_class


def _read_folders(root: Path) -> dict[str, list[Path]]:
    images = scan_class_folders(root, what="benchmark data")
    out: dict[str, list[Path]] = {}
    for path, label in zip(images.paths, images.labels):
        out.setdefault(images.class_names[label], []).append(path)
    return out


def _read_lists(data_dir: Path, skip_classes: set[str]) -> BenchmarkData:
    trees = [p for p in sorted(data_dir.iterdir()) if p.is_dir() and not p.name.startswith(".")]
    if len(trees) != 1:
        raise DataError(
            f"{data_dir} has train.txt/test.txt but {len(trees)} image folders; keep exactly one class-folder tree"
        )
    train = _read_list(data_dir / "train.txt", trees[0], skip_classes)
    test = _read_list(data_dir / "test.txt", trees[0], skip_classes)
    return BenchmarkData(train, test, f"lists train.txt/test.txt over {trees[0].name}/")


def load_data(data_dir: Path, *, skip_classes: set[str]) -> BenchmarkData:
    """``data_dir`` holds train/ and test/ class folders, or train.txt, test.txt and one image tree."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"benchmark data {data_dir} is not a folder; pass --data DIR")
    if (data_dir / "train").is_dir() and (data_dir / "test").is_dir():
        data = BenchmarkData(_read_folders(data_dir / "train"), _read_folders(data_dir / "test"), "class folders")
    elif (data_dir / "train.txt").is_file() and (data_dir / "test.txt").is_file():
        data = _read_lists(data_dir, skip_classes)
    else:
        raise DataError(
            f"{data_dir} has neither train/ and test/ class folders nor train.txt and test.txt; "
            "see `drl benchmark --help` for the layouts"
        )
    train = {c: v for c, v in data.train.items() if c not in skip_classes}
    test = {c: v for c, v in data.test.items() if c not in skip_classes}
    if set(train) != set(test):
        odd = sorted(set(train) ^ set(test))
        raise DataError(f"train and test have different classes, e.g. {odd[:5]}; every class needs both")
    return BenchmarkData(train, test, data.source)


# ------------------------------------------------------------------------- order and stages


def class_order(classes: list[str], *, seed: int, shuffle: bool) -> list[str]:
    ordered = sorted(classes)
    if not shuffle:
        return ordered
    perm = np.random.RandomState(seed).permutation(len(ordered))
    return [ordered[i] for i in perm]


def stage_classes(order: list[str], base: int, inc: int) -> list[list[str]]:
    if base >= len(order):
        raise UsageError(f"B{base} needs more than {len(order)} classes; lower the base")
    first = base if base > 0 else inc
    stages = [order[:first]]
    for start in range(first, len(order), inc):
        stages.append(order[start : start + inc])
    return stages


def split_validation(data: BenchmarkData, fraction: float, seed: int) -> BenchmarkData:
    """Hold out ``fraction`` of each class's training images as the evaluation set (test unused)."""
    rng = np.random.RandomState(seed)
    train, val = {}, {}
    for cls, paths in data.train.items():
        idx = rng.permutation(len(paths))
        n_val = max(1, int(math.ceil(fraction * len(paths))))
        if n_val >= len(paths):
            raise DataError(f"class {cls} has {len(paths)} training images, too few for --val-fraction {fraction}")
        val[cls] = [paths[i] for i in sorted(idx[:n_val])]
        train[cls] = [paths[i] for i in sorted(idx[n_val:])]
    return BenchmarkData(train, val, data.source + f", validation split {fraction:g} of train")


def check_val_fraction(fraction: float) -> None:
    if not 0.0 < fraction < 1.0:
        raise UsageError(f"--val-fraction must be in (0, 1), got {fraction}")


def capped(paths: list[Path], cap: int | None) -> list[Path]:
    """A class's first ``cap`` images (all of them without a cap)."""
    return paths[:cap]


def num_images(by_class: dict[str, list[Path]], stages: list[list[str]], cap: int | None) -> int:
    """Images the stages use from ``by_class``, each class capped."""
    return sum(len(capped(by_class[c], cap)) for classes in stages for c in classes)


@dataclass(frozen=True)
class StagePlan:
    """The protocol made concrete: the data, the class order and each stage's classes."""

    data: BenchmarkData
    order: list[str]
    stages: list[list[str]]


def plan_stages(
    data: BenchmarkData,
    *,
    base: int,
    inc: int,
    seed: int,
    shuffle: bool,
    val_fraction: float | None = None,
    max_stages: int | None = None,
) -> StagePlan:
    """B``base``Inc``inc`` over the class order of ``seed``; ``val_fraction`` evaluates on held-out
    train images; ``max_stages`` keeps the first stages only."""
    if val_fraction is not None:
        check_val_fraction(val_fraction)
        data = split_validation(data, val_fraction, seed)
    order = class_order(list(data.train), seed=seed, shuffle=shuffle)
    return StagePlan(data, order, stage_classes(order, base, inc)[:max_stages])
