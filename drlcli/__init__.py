"""drl: class-incremental learning on a frozen pre-trained ViT (IPA network + DAS).

The public API: each function backs one CLI command.

    import drlcli
    drlcli.init_run("runs/shop", ptm="deit_tiny_patch16_224", ptm_weights=Path("deit.safetensors"))
    drlcli.learn_stage("runs/shop", data_dir=Path("drops/day1"), eval_data_dir=Path("drops/day1-test"))
    drlcli.learn_stage("runs/shop", data=train_set, class_names=train_set.classes)  # a torch Dataset
    drlcli.evaluate("runs/shop", all_seen=True).report.top1
    drlcli.export_run("runs/shop", Path("model.onnx"), fmt="onnx")   # drl | torchscript | pt2 | onnx
    drlcli.forget_class("runs/shop", "cat", reason="wrong label")     # restore_class brings it back
"""

__version__ = "0.1.0"

import importlib
from typing import TYPE_CHECKING, Any

from .config import IPAConfig, RunConfig, ScoreConfig, TrainConfig
from .errors import DrlError

if TYPE_CHECKING:
    from .api import evaluate, info, init_run, learn_stage, load_run
    from .export import export_run, load_export, load_model
    from .forget import forget_class, restore_class

# imported on first use, so `drl --help` and `drl --version`'s parsing do not wait for torch
_LAZY = {
    **dict.fromkeys(("evaluate", "info", "init_run", "learn_stage", "load_run"), ".api"),
    **dict.fromkeys(("export_run", "load_export", "load_model"), ".export"),
    **dict.fromkeys(("forget_class", "restore_class"), ".forget"),
}


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
