"""What a scoring head is, as the rest of the package sees it.

A run scores with its prototype bank (``prototypes.py``) or with an analytic head fitted from
class-level statistics (``ridge/``). A head is registered as a ``Head``: the ``score.head`` choice
that selects it, its option section, the module that fits and rebuilds it (loaded on first use, so
the registry imports no torch), what it reads of a pass (stage subspaces, the PTM's layout) and
which of its stage tensors hold one slice per class (``PerClass``), so that ``drl forget`` asks
the heads what to take out instead of knowing them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor, nn

FILES = ("weights", "statistics", "totals")  # a stage's tensor files (the run directory names them)

# In the newest stage's totals file: the stage through which its sums run (int64, (1,)). A run's
# sums (the ridge's Grams, the pooled scatters) are carried there as running totals; a stage of an
# earlier release holds its own increments instead, which ``since_totals`` keeps apart.
TOTALS_MARK = "totals"


def since_totals(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stages whose sums are still to be added, in stage order: from the last one holding
    running totals (``TOTALS_MARK``) on; every stage when none does (a run of an earlier release)."""
    start = max((i for i, part in enumerate(parts) if TOTALS_MARK in part), default=0)
    return parts[start:]


@dataclass(frozen=True)
class PerClass:
    """A stage tensor holding one slice per class along ``axis``: per class of its stage, or
    (``seen``) per class seen up to its stage, in class order. ``carried``: a carried run's state of
    the class in the newest totals (its Gaussian, its sums), which a later stage changes only by
    moving the network (a paused stage keeps it as it was)."""

    file: str  # "weights" or "statistics" (``FILES``)
    name: str
    axis: int
    seen: bool = False
    carried: bool = False
    images: bool = False  # each slice counts its class's images: at most what its stage's record says


@dataclass(frozen=True)
class EarlierStages:
    """What an analytic head's fit reads of the stages before the one it fits (none for stage 1)."""

    head: nn.Module | None  # the head the run scores with now
    tensors: list[dict[str, Tensor]]  # each earlier stage's weights, as loaded (its active classes)
    statistics: Callable[
        [], Iterable[dict[str, Tensor]]
    ]  # each earlier stage's statistics, read one at a time when asked
    # a carried run's earlier classes (``ridge.carry.stage.Carried``): read instead of their stored statistics
    carried: Any | None = None


class HeadFit(Protocol):
    """One stage's fit of an analytic head (``ridge.fit.StageFit``)."""

    head: nn.Module
    tensors: dict[str, Tensor]  # into the stage's weights file
    statistics: dict[str, Tensor]  # the stage's statistics file
    meta: dict[str, Any]  # into stage.json; has "seconds"
    num_params: int
    solution: Any  # offered to a second fit of the same sums (``fit_stage(offer=True)``; else None)


class AnalyticHead(Protocol):
    """A head fitted from statistics instead of scored against prototypes: ``head(features (B, S, d))
    -> scores (B, C)``. The head module also says what it reads (``stages_read(width)``,
    ``layout_grid``) and checks it against the network (``check_width``)."""

    def fit_stage(self, earlier: EarlierStages, features: Tensor, labels: Tensor, **kwargs: Any) -> HeadFit:
        """learn-stage: add a stage's features (N, S, d) to the run's statistics and solve."""
        ...

    def from_stages(self, stage_tensors: list[dict[str, Tensor]], *, scoring: bool = True) -> nn.Module:
        """load a run: the head from every committed stage's tensors (``scoring`` False: only what a
        learn-stage reads of the head before it fits a new one)."""
        ...

    def from_state(self, state: dict[str, Tensor]) -> nn.Module:
        """load an export: the head from its own state dict."""
        ...

    def restored_slice(
        self, name: str, *, meta: dict[str, Any], statistics: list[dict[str, Tensor]], kept: dict[str, Tensor]
    ) -> Tensor:
        """forget --restore: a restored class's slice of a ``seen`` per-class tensor in a stage learned
        after it was forgotten, solved again (ValueError when it cannot be)."""
        ...

    def check_carried(self, totals: dict[str, Tensor]) -> None:
        """forget --restore: a carried run's classes in the newest totals about to be committed,
        checked as the next learn-stage reads them (ValueError when they do not fit)."""
        ...

    def check_stages(self, stage_tensors: list[dict[str, Tensor]]) -> None:
        """load and verify: the head's tensors of every committed stage (weights and totals merged)
        in the shapes they have together (ValueError naming the first that is off)."""
        ...

    def carry_stage(self, config: Any, features: Tensor, labels: Tensor, **kwargs: Any) -> Any:
        """learn-stage in a run whose method carries its network (``Schedule.carries``; the
        ridge head's ``carry.carry_stage``): the earlier classes moved with the network, for
        ``fit_stage`` (``EarlierStages.carried``), and every class's carried state for the totals."""
        ...


@dataclass(frozen=True)
class Head:
    """The facts of one analytic head; ``heads/__init__.py`` holds the registry."""

    name: str  # score.head's choice that selects it
    section: str  # its option section in a run config
    options: type  # the section's dataclass
    load: Callable[[], AnalyticHead]  # imports the module that fits and rebuilds it
    per_class: tuple[PerClass, ...]  # its stage tensors with one slice per class
    stages_read: Callable[[Any], int]  # config -> stage subspaces after f_0 its input reads
    layout_grid: Callable[[Any], int]  # config -> g of the PTM layout rows its input reads (0: none)
    rules: Callable[[Any, Any], None]  # (config, method) -> UsageError if the config breaks one
    # tensors carried by the newest stage only (its totals file), superseded by the next stage's
    running: tuple[str, ...] = ()
    # the dtype drl writes each of its stage tensors in: "float" (float32 or float64) or one dtype's
    # name ("float64", "int64"); a crafted file's other dtype is damage (``run.forgotten.check_tensors``)
    dtypes: dict[str, str] = field(default_factory=dict)
