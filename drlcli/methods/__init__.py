"""The methods a run stores (run.yaml's ``method``; SPEC §3 ``--method``): which feature network it
builds, whether it trains, its PTM subspace, its stage tensors' prefix, its rules and its schedule.
People choose recipes (``recipes.py``), each a method with options over it.

- ``drl``: the IPA streams (``features/ipa``), or with ``adapter.peft`` the one adapter set inside
  the PTM (``features/adapter``, the default recipe); scored by ``score.head``.
- ``ranpac``: the ridge head on the frozen PTM, or on the PTM adapted in stage 1 (``adapter.peft``).
- ``ease``: independent adapters per stage (``features/ease``), no PTM subspace.
- ``simplecil``: the frozen PTM's subspace alone, class-mean prototypes, nothing trained.

To add a method: a ``Method(...)`` here (``base.py`` says what each field means) and its name in the
``METHODS`` line; a recipe naming it (``recipes.py``) makes it a choice. Nothing else names methods:
the CLI, the config's sections and validation, learn-stage, loading, export and forget read this
registry. It imports no torch: networks are imported when first built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import UsageError, shown
from ..features import StageNetwork, adapter, ease, ipa
from ..heads import HEADS, Head
from ..options import TrainConfig
from ..schedule import EVERY_STAGE, NO_STAGE, Schedule, ScheduleConfig, adapter_schedule
from ..schedule import rules as schedule_rules
from .base import Method

if TYPE_CHECKING:
    from torch import nn

    from ..config import RunConfig

ADAPTER_SECTIONS = {adapter.SECTION: adapter.AdapterConfig, "schedule": ScheduleConfig}


def _adapted_or_ipa(ptm: nn.Module, config: RunConfig) -> StageNetwork:
    # without adaptation: the IPA network (the bare PTM pass for a method that never gives it a stage)
    return adapter.build(ptm, config) if adapter.adapts(config) else ipa.build(ptm, config)


def _all_tokens(config: RunConfig, method: str) -> None:
    """Only an adapter set's training reads a share of the tokens (``train.keep_tokens``)."""
    if config.train.keep_tokens < 1:
        raise UsageError(
            f"train.keep_tokens must be 1 for method {method} without an adapter set in the PTM (only its "
            "training reads a share of the tokens); set train.keep_tokens 1, or adapter.peft adaptformer"
        )


def _adapting_rules(config: RunConfig, method: str) -> None:
    """The schedule's rules, and those of adapting a PTM that the ridge head reads alone."""
    schedule_rules(config)
    if not adapter.adapts(config):
        _all_tokens(config, method)
        return
    if config.ridge.subspaces != 1:
        raise UsageError(
            f"ridge.subspaces must be 1 for method {method} adapting the PTM (its head reads the adapted PTM's "
            "subspace); set adapter.peft none to read stage subspaces"
        )
    if config.train.kd_weight:
        raise UsageError(
            f"train.kd_weight must be 0 for method {method} adapting the PTM (there is no frozen PTM to distil to)"
        )


def _drl_rules(config: RunConfig) -> None:
    _adapting_rules(config, "drl")
    if adapter.adapts(config) and config.score.head != "ridge":
        raise UsageError(
            "score.head must be ridge for method drl adapting the PTM (adapter.peft); "
            "the prototype bank reads stage subspaces: use --recipe paper"
        )


def _ranpac_rules(config: RunConfig) -> None:
    if config.ridge.subspaces != 1:
        raise UsageError("ridge.subspaces must be 1 for method ranpac (its head reads the PTM's subspace)")
    _adapting_rules(config, "ranpac")


def _ease_rules(config: RunConfig) -> None:
    _all_tokens(config, "ease")
    if config.train.kd_weight:
        raise UsageError("train.kd_weight must be 0 for method ease (it has no PTM stream to distil from)")


def _drl_schedule(config: RunConfig) -> Schedule:
    return adapter_schedule(config) if adapter.adapts(config) else EVERY_STAGE


def _ranpac_schedule(config: RunConfig) -> Schedule:
    return adapter_schedule(config) if adapter.adapts(config) else NO_STAGE


DRL = Method(
    name="drl",
    build=_adapted_or_ipa,
    trains=True,
    offset=1,
    tensor_prefix="ipa.",
    sections={"ipa": ipa.IPAConfig, **ADAPTER_SECTIONS},
    rules=_drl_rules,
    schedule=_drl_schedule,
)
SIMPLECIL = Method(
    name="simplecil",
    build=ipa.build,
    trains=False,
    offset=1,
    tensor_prefix="",
    rules=lambda config: _all_tokens(config, "simplecil"),
)
EASE = Method(
    name="ease",
    build=ease.build,
    trains=True,
    offset=0,  # EASE's default use_init_ptm = false
    tensor_prefix="ease.",
    sections={"ease": ease.EaseConfig},
    # the EASE paper / LAMDA-PILOT ease.json: CE through a cosine head whose scale starts at 1, no distillation
    train_defaults=TrainConfig(loss="ce", kd_weight=0.0, scale_init=1.0, lr=0.025, epochs=20, batch_size=48),
    rules=_ease_rules,
)
RANPAC = Method(
    name="ranpac",
    build=_adapted_or_ipa,
    trains=True,  # stage 1 only, and only with an adapter (its schedule)
    offset=1,
    tensor_prefix="adapt.",
    sections=ADAPTER_SECTIONS,
    # RanPAC's first session (its public code, after LAMDA-PILOT): CE through a cosine head whose
    # scale starts at 1, SGD lr 0.01, momentum 0.9, weight decay 5e-4, cosine schedule, 20 epochs, batch 48
    train_defaults=TrainConfig(loss="ce", kd_weight=0.0, scale_init=1.0, lr=0.01, epochs=20, batch_size=48),
    rules=_ranpac_rules,
    head="ridge",
    schedule=_ranpac_schedule,
)

# the order is the CLI's (--help, shell completion)
METHODS: dict[str, Method] = {m.name: m for m in (DRL, SIMPLECIL, EASE, RANPAC)}


def get_method(name: str) -> Method:
    """The method called ``name``; ``UsageError`` naming the choices for any other name."""
    method = METHODS.get(name) if isinstance(name, str) else None
    if method is None:
        raise UsageError(f"unknown method {shown(name)}; choose one of {list(METHODS)}")
    return method


def method_of(config: RunConfig) -> Method:
    return METHODS[config.method]


def schedule_of(config: RunConfig) -> Schedule:
    """The run's schedule (``schedule/``): when its network trains and which head answers."""
    return method_of(config).schedule(config)


def sections() -> dict[str, type]:
    """Every method's own option sections, in registry order (every run config holds them all)."""
    return {name: cls for method in METHODS.values() for name, cls in method.sections.items()}


def head_of(config: RunConfig) -> Head | None:
    """The analytic head that scores this run, or None (the prototype bank scores): the method's own
    (an analytic method's), or the one ``score.head`` asks for (drl's default: ridge)."""
    name = method_of(config).head or (config.score.head if config.score.head != "prototypes" else None)
    return HEADS[name] if name is not None else None


def stages_read(config: RunConfig) -> int | None:
    """How many leading stage subspaces the run's answers read: None (all) under the prototype bank;
    under an analytic head its own count (none for drl's default head, whose answers and "unknown"
    answer read the PTM alone)."""
    head = head_of(config)
    return None if head is None else head.stages_read(config)


def stage_is_read(config: RunConfig, index: int) -> bool:
    """Whether anything the run answers reads stage ``index``'s subspace (``stages_read``)."""
    read = stages_read(config)
    return read is None or index <= read


def trains_stage(config: RunConfig, index: int) -> bool:
    """Whether stage ``index`` gets a stage network: the method trains, and its schedule trains that
    stage (every stage of a carried network; the leading ``trained_stages``) or, with no limit, the
    run's answers read its subspace (``train.skip_unread``). A pause or a declined trial is decided
    when the stage begins (``stage/begin.py``)."""
    if not method_of(config).trains:
        return False
    schedule = schedule_of(config)
    if schedule.carries:
        return True
    if schedule.trained_stages is not None:
        return index <= schedule.trained_stages
    return not config.train.skip_unread or stage_is_read(config, index)


__all__ = [
    "METHODS",
    "Method",
    "StageNetwork",
    "get_method",
    "head_of",
    "method_of",
    "schedule_of",
    "sections",
    "stage_is_read",
    "stages_read",
    "trains_stage",
]
