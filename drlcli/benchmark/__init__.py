"""``drl benchmark``: the B-m Inc-n protocol (SPEC §4) for several methods and variants on the same
data and class order, each in its own run directory, through the same library calls as the CLI.

Three parts: ``protocol`` (pure: data layouts, class order, stages, validation split, caps),
``folders`` (the stages' class folders on disk), ``variants`` + ``runner`` (what runs: variants,
resume), ``scoring`` (timing, rescoring) and ``report`` (result
rows, mean ± std over class orders, tables, plot, files). ``benchmark`` is the command's one call.
"""

from .folders import materialise
from .protocol import (
    DEFAULT_SEED,
    BenchmarkData,
    class_order,
    load_data,
    parse_seeds,
    parse_split,
    split_validation,
    stage_classes,
)
from .report import aggregate, markdown_table, mean_std, seeds_markdown, write_reports
from .runner import BenchmarkSettings, benchmark, run_benchmark, run_seeds
from .scoring import rescore
from .variants import Variant, parse_methods, parse_score, parse_variant

__all__ = [
    "DEFAULT_SEED",
    "BenchmarkData",
    "BenchmarkSettings",
    "Variant",
    "aggregate",
    "benchmark",
    "class_order",
    "load_data",
    "markdown_table",
    "materialise",
    "mean_std",
    "parse_methods",
    "parse_score",
    "parse_seeds",
    "parse_split",
    "parse_variant",
    "rescore",
    "run_benchmark",
    "run_seeds",
    "seeds_markdown",
    "split_validation",
    "stage_classes",
    "write_reports",
]
