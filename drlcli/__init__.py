"""drl: add classes to a pre-trained ViT classifier stage by stage, without old data and without forgetting.

The public API: each function backs one CLI command.

    import drlcli
    drlcli.init_run("runs/shop", ptm="deit_tiny_patch16_224", ptm_weights=Path("deit.safetensors"))
    drlcli.learn_stage("runs/shop", data_dir=Path("drops/day1"), eval_data_dir=Path("drops/day1-test"))
    drlcli.learn_stage("runs/shop", data=train_set, class_names=train_set.classes)  # a torch Dataset
    drlcli.evaluate("runs/shop", all_seen=True).report.top1
    drlcli.export_run("runs/shop", Path("model.onnx"), fmt="onnx")   # drl | torchscript | pt2 | onnx
    drlcli.forget_class("runs/shop", "cat", reason="wrong label")     # restore_class brings it back
"""

import importlib
from typing import TYPE_CHECKING, Any

from .config import RunConfig
from .errors import DrlError
from .features.ipa import IPAConfig
from .options import ScoreConfig, TrainConfig
from .version import __version__ as __version__

if TYPE_CHECKING:
    from .api import (
        evaluate,
        export_run,
        forget_class,
        info,
        init_run,
        learn_stage,
        load_export,
        load_model,
        load_run,
        restore_class,
    )

# imported on first use, so `drl --help` and `drl --version`'s parsing do not wait for torch
_LAZY = dict.fromkeys(
    (
        "evaluate",
        "export_run",
        "forget_class",
        "info",
        "init_run",
        "learn_stage",
        "load_export",
        "load_model",
        "load_run",
        "restore_class",
    ),
    ".api",
)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DrlError",
    "IPAConfig",
    "RunConfig",
    "ScoreConfig",
    "TrainConfig",
    "evaluate",
    "export_run",
    "forget_class",
    "info",
    "init_run",
    "learn_stage",
    "load_export",
    "load_model",
    "load_run",
    "restore_class",
]
