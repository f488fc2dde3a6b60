"""Scoring: how a run turns features into answers.

- ``prototypes.py``: the prototype bank (real class means, synthesis for old classes, the paper's
  reweighted cosine; SPEC §2.3).
- ``ridge/``: the analytic ridge head (RanPAC's, with the PTM's layout and class covariances).
- ``openset/``: the "unknown" answer (calibration, known-ness score, open-set metrics).
- ``base.py``: what a head is (``Head``, ``AnalyticHead``, ``PerClass``).

This module is the registry of analytic heads (``score.head`` picks one; ``prototypes`` is the
bank) and of every per-class tensor a stage's files may hold, so that ``drl forget`` asks here what
a class owns. Like ``methods/``, it imports no torch: the maths loads on first use.
"""

from __future__ import annotations

from . import openset, ridge
from .base import FILES, TOTALS_MARK, AnalyticHead, EarlierStages, Head, HeadFit, PerClass, since_totals

HEADS: dict[str, Head] = {head.name: head for head in (ridge.HEAD,)}
PROTOTYPES = "prototypes"  # (n, S, d) each class's real prototypes, in its stage's weights
PROTOTYPE_ROWS = PerClass("weights", PROTOTYPES, 0)


def per_class() -> tuple[PerClass, ...]:
    """Every tensor of a stage's files with one slice per class: the prototype rows, the "unknown"
    answer's rows, and each analytic head's."""
    return (PROTOTYPE_ROWS, *openset.PER_CLASS, *(spec for head in HEADS.values() for spec in head.per_class))


def running() -> frozenset[str]:
    """The tensors only the newest stage holds (in its totals file): the running totals of the run's
    sums and what is solved from them (the ridge's W), the "unknown" answer's pooled scatter."""
    return frozenset(
        {
            TOTALS_MARK,
            *openset.RUNNING,
            openset.RMD_MEAN_CARRIED,
            *(name for head in HEADS.values() for name in head.running),
        }
    )


def sections() -> dict[str, type]:
    """Each analytic head's option section of a run config."""
    return {head.section: head.options for head in HEADS.values()}


__all__ = [
    "FILES",
    "HEADS",
    "TOTALS_MARK",
    "PROTOTYPES",
    "AnalyticHead",
    "EarlierStages",
    "Head",
    "HeadFit",
    "PerClass",
    "per_class",
    "running",
    "sections",
    "since_totals",
]
