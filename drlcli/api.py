"""The library API in one place: the function behind each CLI command and the types they take and
return, re-exported from the modules that own them (``commands/``, ``stage/``, ``run/``). Nothing
is defined here; ``import drlcli`` gives the same names lazily."""

from .commands.card import CardResult, model_card
from .commands.check_data import DataCheck, check_data
from .commands.evaluate import EvalResult, evaluate
from .commands.export import ExportResult, export_run
from .commands.forget import ForgetResult, forget_class, restore_class
from .commands.info import info
from .commands.init import InitResult, init_run
from .commands.predict import Prediction, PredictStats, predict_sources
from .commands.verify import VerifyResult, verify
from .device import resolve_device
from .evaluation import EVAL_BATCH_SIZE, TOP_K
from .progress import Progress, ProgressFn
from .run.load import LoadedRun, load_run
from .run.records import check_stage_meta, history_of, train_metrics
from .serving.drlfile import load_export
from .serving.formats import load_model
from .stage import learn_stage
from .stage.record import StageResult

__all__ = [
    "EVAL_BATCH_SIZE",
    "TOP_K",
    "CardResult",
    "DataCheck",
    "EvalResult",
    "ExportResult",
    "ForgetResult",
    "InitResult",
    "LoadedRun",
    "PredictStats",
    "Prediction",
    "Progress",
    "ProgressFn",
    "StageResult",
    "VerifyResult",
    "check_data",
    "check_stage_meta",
    "evaluate",
    "export_run",
    "forget_class",
    "history_of",
    "info",
    "init_run",
    "learn_stage",
    "load_export",
    "load_model",
    "load_run",
    "model_card",
    "predict_sources",
    "resolve_device",
    "restore_class",
    "train_metrics",
    "verify",
]
