"""drl: class-incremental learning on a frozen pre-trained ViT (IPA network + DAS).

The public API: each function backs one CLI command.

    import drlcli
    drlcli.init_run("runs/shop", ptm="deit_tiny_patch16_224", ptm_weights=Path("deit.safetensors"))
    drlcli.learn_stage("runs/shop", data_dir=Path("drops/day1"), eval_data_dir=Path("drops/day1-test"))
    drlcli.evaluate("runs/shop", all_seen=True).report.top1
    drlcli.export_run("runs/shop", Path("model.onnx"), fmt="onnx")   # drl | torchscript | onnx
"""

__version__ = "0.1.0"

from .api import evaluate, info, init_run, learn_stage, load_run  # noqa: E402
from .config import IPAConfig, RunConfig, ScoreConfig, TrainConfig  # noqa: E402
from .errors import DrlError  # noqa: E402
from .export import export_run, load_export, load_model  # noqa: E402

__all__ = [
    "DrlError",
    "IPAConfig",
    "RunConfig",
    "ScoreConfig",
    "TrainConfig",
    "evaluate",
    "export_run",
    "info",
    "init_run",
    "learn_stage",
    "load_export",
    "load_model",
    "load_run",
]
