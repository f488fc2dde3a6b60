"""When the feature network trains across stages, how the earlier classes are kept, and which head
answers: one of the three parts of a recipe (``recipes.py``: features x schedule x head).

A run's ``Schedule`` (``methods.schedule_of``) is what learn-stage, loading, check-data, the model card
and the benchmark read, rather than each asking the method:

- ``trained_stages``: how many leading stages get a network (None: every stage whose subspace the
  run's answers read; 0: none, a frozen PTM; 1: the first session only, RanPAC's).
- ``carries``: one adapter set trained again at every stage; the ridge head carries the earlier
  classes as Gaussians moved with it (``heads/ridge/carry/``). The default's.
- ``switches``: the frozen PTM's head is kept in the same stages beside the adapted one, and the run
  answers from the one its forward transfer picks (``stage/switch.py``).
- ``pauses``: the set trains at a stage only while the forward transfer could still pay.
- ``tries``: before the set ever trains, a short trial on half of the stage's classes says whether
  adapting moves the other half's margins (``stage/trial.py``); with ``trial_answers``, a trial that
  widened them has the adapted head answer from the next stage on (from that stage itself, where it is a
  drop of few images a class: ``trial_answers_small_stage``), unless the counts say it loses.
- ``decides_first``: stage 1's adapters are kept only where the held-out part scores higher.
- ``later_epochs``: once the set has trained, a later stage trains at most that many epochs (``epochs``).

The ``schedule`` section of a run config holds the options; runs of earlier releases named it and
the adapter's together ``first_session`` (``config.py`` reads them). This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UsageError
from ..options import Range, option

if TYPE_CHECKING:
    from ..config import RunConfig

SECTION = "schedule"


@dataclass(frozen=True)
class ScheduleConfig:
    """How an adapter set (``adapter.peft``) learns across stages; the other networks train every stage."""

    # first: trained in stage 1 and frozen afterwards (RanPAC's first session) | all: the one set
    # trained again at every stage, the earlier classes carried by the head (drl's default)
    stages: str = option("first", choices=("first", "all"))
    # "all", from stage 2 on: the loss adds this times the mean relative squared move of the stage's
    # own images' read tokens (f_0 and the layout cells) from where the set put them when the stage began
    hold_weight: float = option(3.0, within=Range(0, 1e4))
    # the share of each batch's images the hold term reads (the leading ones of a shuffled batch, at
    # least one): only they pass through the stage's starting set, the hold's one extra forward a step
    hold_share: float = option(1.0, within=Range(0, 1, low_open=True))
    # "all" only: a stage trains at most this many epochs once the set trained at an earlier stage (its
    # cosine schedule over them): the set already fits the domain and moves for the new classes alone;
    # 0: every stage trains train.epochs (runs of earlier releases)
    later_epochs: int = option(0, within=Range(0, 1_000_000))
    # "all" only: a stage trains in batches of this many images once the set trained at an earlier stage
    # (with later_epochs, a stage keeps its step count on fewer passes); 0: train.batch_size
    later_batch_size: int = option(0, within=Range(0, 1_000_000))
    # "first" only: train the adapters on the fit part of stage 1's images, fit the head on the fit
    # part's frozen and adapted features, and keep the adapters only when the held-out part (the ridge
    # head's statistics split) scores higher with them
    decide: bool = False
    # "all" only: "transfer" keeps the frozen PTM's head beside the adapted one and answers from the
    # adapted one from the stage on which the run's forward transfer (``metrics.Transfer``) says
    # adapting tells new classes apart better than the frozen PTM; "none" always answers from it
    switch: str = option("none", choices=("none", "transfer"))
    # with switch "transfer" only: "transfer" trains the set at a stage only while the run's forward
    # transfer so far could still reach the switch's floor (``metrics.Transfer.stalls``); a paused stage
    # fits the head on the network as it stands
    pause: str = option("none", choices=("none", "transfer"))
    # with pause "transfer" only: a stage after the first of fewer classes than this does not train the set
    # either (0: any stage may, as runs of earlier releases): its forward transfer counts next to nothing
    # among so few, and its maps, fitted on their few images, move every earlier class's Gaussian
    train_min_classes: int = option(0, within=Range(0, 1_000_000))
    # with pause "transfer" only: "transfer" tries adapting before a stage trains, while no stage has
    # trained the set, up to ``trial_stages`` stages (``stage/trial.py``): a copy of the set trained
    # ``trial_epochs`` on half of the stage's classes (at most ``trial_images`` images each), the other
    # half's margins compared through it and the frozen PTM; the stage trains only where they move
    trial: str = option("none", choices=("none", "transfer"))
    trial_epochs: int = option(10, within=Range(1, 1000))
    trial_images: int = option(32, within=Range(1, 1_000_000))
    trial_stages: int = option(3, within=Range(1, 1_000_000))  # stages tried while the set never trained
    # read only with a trial: after the stage whose trial widened the margins of the classes it did not
    # train on (and trained the set), the adapted head answers unless the forward-transfer counts say
    # adapting loses (``run/track.py``); false: only once the counts say adapting pays
    trial_answers: bool = False
    # read only with ``trial_answers``: a stage of at most this many images a class (on average) answers by
    # its own trial's verdict, from the adapted head, where that trial widened the margins; 0: the verdict
    # is read from the next stage on (runs of earlier releases)
    trial_answers_small_stage: int = option(0, within=Range(0, 1_000_000))


@dataclass(frozen=True)
class Schedule:
    """A run's schedule, as its config sets it (the module's docstring says what each fact means)."""

    trained_stages: int | None = None
    carries: bool = False
    switches: bool = False
    pauses: bool = False
    tries: bool = False
    decides_first: bool = False
    hold: bool = False  # a carried stage after the first adds the hold term (a second, no-grad forward)
    later_epochs: int = 0  # a carried set's epochs at most, once it trained at an earlier stage (0: no bound)
    later_batch_size: int = 0  # a carried set's batch, once it trained at an earlier stage (0: train.batch_size)

    def epochs(self, train_epochs: int, *, trained_before: bool) -> int:
        """The epochs a stage trains: ``train_epochs``, at most ``later_epochs`` once the set trained at
        an earlier stage (``trained_before``)."""
        return min(train_epochs, self.later_epochs) if self.later_epochs and trained_before else train_epochs

    def batch_size(self, train_batch_size: int, *, trained_before: bool, processes: int = 1) -> int:
        """The batch a stage trains in: ``later_batch_size`` once the set trained at an earlier stage
        (``trained_before``), rounded up to a multiple of the ``processes`` that share it (torchrun's),
        else ``train_batch_size``."""
        if not (self.later_batch_size and trained_before):
            return train_batch_size
        return -(-self.later_batch_size // processes) * processes


EVERY_STAGE = Schedule()  # ipa, ease: a new stage network at every stage whose subspace is read
NO_STAGE = Schedule(trained_stages=0)  # a frozen PTM


def adapter_schedule(config: RunConfig) -> Schedule:
    """The schedule of a run that adapts the PTM with one set (``adapter.peft``)."""
    options = config.schedule
    carries = options.stages == "all"
    switches = carries and options.switch == "transfer"
    pauses = switches and options.pause == "transfer"
    return Schedule(
        trained_stages=None if carries else 1,
        carries=carries,
        switches=switches,
        pauses=pauses,
        tries=pauses and options.trial == "transfer",
        decides_first=not carries and options.decide,
        hold=carries and options.hold_weight > 0,
        later_epochs=options.later_epochs if carries else 0,
        later_batch_size=options.later_batch_size if carries else 0,
    )


def rules(config: RunConfig) -> None:
    """The section's own rules: each option only where the schedule it refines is chosen."""
    options = config.schedule
    adapting = config.adapter.peft != "none"
    if options.stages == "all":
        if not adapting:
            raise UsageError("schedule.stages all trains the adapter set: set adapter.peft adaptformer")
        if options.decide:
            raise UsageError("schedule.decide is for stages first: a carried run (stages all) keeps its adapters")
    elif options.later_epochs or options.later_batch_size:
        name = "later_epochs bounds" if options.later_epochs else "later_batch_size sets"
        raise UsageError(f"schedule.{name} the stages after the set first trained: set schedule.stages all")
    elif options.switch != "none":
        raise UsageError("schedule.switch picks between the carried set and the frozen PTM: set schedule.stages all")
    if options.trial != "none" and options.pause != "transfer":
        raise UsageError("schedule.trial decides whether a stage trains: set schedule.pause transfer")
    if options.pause != "none" and options.switch != "transfer":
        raise UsageError(
            "schedule.pause stops training a network the frozen PTM's head answers for: set schedule.switch transfer"
        )


__all__ = ["EVERY_STAGE", "NO_STAGE", "SECTION", "Schedule", "ScheduleConfig", "adapter_schedule", "rules"]
