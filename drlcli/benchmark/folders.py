"""The protocol made concrete on disk: each stage's train and test class folders (links to the
data's images, nothing copied), and the protocol record that lets a later call resume them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import jsonio
from ..errors import UsageError
from .protocol import capped
from .report import atomic_write

if TYPE_CHECKING:
    from .protocol import BenchmarkData
    from .runner import BenchmarkSettings


def materialise(
    stages: list[list[str]],
    data: BenchmarkData,
    out: Path,
    *,
    max_train: int | None,
    max_test: int | None,
    write: bool = True,
) -> list[tuple[Path, Path]]:
    """Symlink each stage's images into OUT/data/stage_NN/{train,test}/<class>/ (idempotent);
    with ``write`` False only the folder names are returned."""
    folders = []
    for k, classes in enumerate(stages, 1):
        pair = []
        for split, source, cap in (("train", data.train, max_train), ("test", data.test, max_test)):
            root = out / f"stage_{k:02d}" / split
            pair.append(root)
            for cls in classes if write else []:
                _link_class(root / cls, capped(source[cls], cap))
        folders.append(tuple(pair))
    return folders


def _link_class(folder: Path, paths: list[Path]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    wanted = {f"{i:05d}_{p.name}": p.resolve() for i, p in enumerate(paths)}
    for name, target in wanted.items():
        link = folder / name
        if link.is_symlink() and Path(link.readlink()) != target:
            link.unlink()
        if not link.is_symlink():
            link.symlink_to(target)
    for stale in folder.iterdir():
        if stale.name not in wanted:
            stale.unlink()


def protocol_record(settings: BenchmarkSettings) -> dict[str, Any]:
    return {
        "data": str(Path(settings.data_dir).resolve()),
        "split": settings.split,
        "seed": settings.seed,
        "shuffle": settings.shuffle,
        "max_train_per_class": settings.max_train_per_class,
        "max_test_per_class": settings.max_test_per_class,
        "val_fraction": settings.val_fraction,
        "skip_classes": sorted(settings.skip_classes),
        "ptm": settings.ptm,
    }


def check_protocol(path: Path, protocol: dict[str, Any], *, write: bool) -> None:
    """An --out folder holds one protocol: continuing it with other data or split would mix them."""
    if path.exists():
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path} is unreadable ({exc}); pass another --out") from exc
        changed = sorted(k for k in protocol if stored.get(k) != protocol[k])
        if changed:
            raise UsageError(
                f"--out {path.parent} holds a benchmark with other {', '.join(changed)}; "
                "pass another --out or the same options"
            )
    elif write:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, jsonio.dumps(protocol, indent=2) + "\n")
