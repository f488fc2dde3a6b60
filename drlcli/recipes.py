"""Every recipe drl offers, as three parts: the features the head reads (``features/``), the schedule
on which the network trains across stages (``schedule/``) and the head that answers (``heads/``), plus
the options that make it. ``drl init --recipe NAME`` and ``drl benchmark --methods NAME`` take these
names; run.yaml records the recipe a run was made from and every option it holds.

A recipe is stored as a method (run.yaml's ``method``, ``methods/``) and options over that method's
defaults; its older names, ``--method M --preset P``, still make it. Recipes marked unlisted exist so
that commands of earlier releases reproduce: they are in no help text.

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError, shown
from .methods import get_method

Sections = Mapping[str, Mapping[str, Any]]


def merged(*layers: Sections) -> dict[str, dict[str, Any]]:
    """Layers of ``{section: {key: value}}``, later keys over earlier ones, section by section."""
    out: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for section, values in layer.items():
            out[section] = {**out.get(section, {}), **values}
    return out


# the ridge head as drl scores with it (chosen on validation splits; docs/methods.md): class covariances
# of rank 16, the PTM's 2 x 2 layout beside f_0, λ searched from the stage before's over at most 128 classes
RIDGE = {
    "covariance_weight": 4.0,
    "covariance_rank": 16,
    "layout_grid": 2,
    "layout_scale": 0.5,
    "lambda_search": "local",
    "lambda_classes": 128,
}
# the frozen PTM read by that head; nothing trained (the frozen recipe, and the default's other head)
FROZEN = {"score": {"head": "ridge"}, "ridge": RIDGE, "train": {"skip_unread": True}}
# the earlier classes' sums rebuilt from their Gaussians, E[φ] in closed form, 25 draws an image, the
# Grams' products from at most 50,000 of them, each class's rows split between the fit and held-out Grams
CARRY_SUMS = {"carry_mean": "exact", "carry_draws": 25, "carry_gram_draws": 50_000, "carry_grams": "split"}
# one adapter set in blocks 0-5, trained at every stage (20 epochs at lr 0.05) and held near each
# stage's start (weight 3, read on a quarter of each batch), the earlier classes carried as Gaussians
_CARRIED_SET = {
    "adapter": {"peft": "adaptformer", "blocks": 0.5},
    "schedule": {"stages": "all", "hold_weight": 3.0, "hold_share": 0.25},
    "train": {"lr": 0.05, "epochs": 20, "batch_size": 48, "scale_init": 16.0},
}
# ... answering from the frozen PTM's head until the forward transfer says adapting pays, trained only
# while it could
_SWITCHED = {"schedule": {"switch": "transfer", "pause": "transfer"}}
# ... tried on half of stage 1's classes first (after a trial that widened the other half's margins, the
# adapted head answers unless the counts say it loses; from that stage itself on a drop of at most 20 images a
# class), not trained by a later stage of fewer than 4 classes (the trial's own least), and trained in bf16
# where the device computes it natively
_TRIED = {
    "schedule": {"trial": "transfer", "trial_answers": True, "trial_answers_small_stage": 20, "train_min_classes": 4},
    "train": {"precision": "auto"},
}
# ... and once the set has trained, a later stage trains 5 epochs in batches of 12: the 20 epochs' steps at
# a quarter of their passes (chosen on the sketches' validation split, VS6: docs/performance.md)
_LATER = {"schedule": {"later_epochs": 5, "later_batch_size": 12}}
_CE = {"train": {"loss": "ce", "kd_weight": 0.0}}  # no distillation: no frozen PTM in the adapted pass


@dataclass(frozen=True)
class Recipe:
    name: str
    method: str  # what run.yaml stores (``methods.METHODS``)
    features: str  # the three parts, for people (``drl init --help``, the model card, docs/architecture.md)
    schedule: str
    head: str
    overrides: Sections = field(default_factory=dict)  # sections over the method's defaults
    presets: tuple[str, ...] = ()  # its names under ``--method`` (``--preset``, benchmark ``preset=``)
    method_default: bool = False  # what ``--method METHOD`` makes when no preset is named
    listed: bool = True  # False: kept so that commands of earlier releases reproduce


RECIPES: tuple[Recipe, ...] = (
    Recipe(
        "default",
        "drl",
        "one AdaptFormer set in the PTM's first 6 blocks",
        "tried on half of a stage's classes first; trained at every stage while adapting can pay (20 epochs, "
        "then 5 in batches of 12); the frozen PTM's head answers until adapting pays (the trial's margins or the "
        "forward transfer)",
        "ridge (random features, PTM layout, class covariances)",
        merged(FROZEN, _CARRIED_SET, _SWITCHED, _TRIED, _LATER, {"ridge": CARRY_SUMS}, _CE),
        presets=("default", "switched"),
        method_default=True,
    ),
    Recipe("frozen", "drl", "the frozen PTM", "nothing trained", "ridge, as the default's", FROZEN, ("frozen",)),
    Recipe(
        "paper",
        "drl",
        "the paper's IPA streams, one per stage, trained with DAS + distillation",
        "a new stream at every stage",
        "prototypes (the paper's reweighted cosine)",
        merged(FROZEN, {"score": {"head": "prototypes"}, "train": {"skip_unread": False}}),
        ("paper",),
    ),
    Recipe("ranpac", "ranpac", "the frozen PTM", "nothing trained", "ridge (RanPAC's)", method_default=True),
    Recipe(
        "ranpac-published",
        "ranpac",
        "one AdaptFormer set in every block",
        "trained in stage 1, frozen afterwards",
        "ridge (RanPAC's)",
        {"adapter": {"peft": "adaptformer"}},
        ("published",),
    ),
    Recipe(
        "ease", "ease", "one AdaptFormer set per stage", "a new set at every stage", "prototypes", method_default=True
    ),
    Recipe("simplecil", "simplecil", "the frozen PTM", "nothing trained", "prototypes (cosine)", method_default=True),
    # the default without its frozen head, and the default's schedule under RanPAC's method with the
    # carry it was first measured with: the commands of earlier docs
    Recipe(
        "carried",
        "drl",
        "as the default",
        "trained at every stage",
        "ridge on the adapted PTM",
        merged(FROZEN, _CARRIED_SET, {"ridge": CARRY_SUMS}, _CE),
        ("carried",),
        listed=False,
    ),
    Recipe(
        "ranpac-carried",
        "ranpac",
        "as the default",
        "trained at every stage",
        "ridge",
        merged(_CARRIED_SET, {"ridge": RIDGE}),
        ("carried",),
        listed=False,
    ),
    Recipe(
        "ranpac-switched",
        "ranpac",
        "as the default",
        "as the default, without the trial",
        "ridge",
        merged(_CARRIED_SET, _SWITCHED, {"ridge": RIDGE}),
        ("switched",),
        listed=False,
    ),
)
BY_NAME: dict[str, Recipe] = {recipe.name: recipe for recipe in RECIPES}
LISTED = tuple(recipe.name for recipe in RECIPES if recipe.listed)
DEFAULT = "default"


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; ``UsageError`` naming the choices for any other name."""
    recipe = BY_NAME.get(name) if isinstance(name, str) else None
    if recipe is None:
        raise UsageError(f"unknown recipe {shown(name)}; choose one of {list(LISTED)}")
    return recipe


def recipe_for(method: str, preset: str | None = None) -> Recipe:
    """The recipe ``--method METHOD [--preset PRESET]`` names (the method's own when no preset is named)."""
    get_method(method)  # UsageError naming the methods for any other name
    of_method = [recipe for recipe in RECIPES if recipe.method == method]
    found = [r for r in of_method if (r.method_default if preset is None else preset in r.presets)]
    if found:
        return found[0]
    if preset is None:  # a method no recipe names yet: its defaults alone
        return Recipe(method, method, "", "", "", listed=False)
    known = [p for recipe in of_method if recipe.listed for p in recipe.presets[:1]] or "none"
    raise UsageError(f"method {method} has no preset {shown(preset)}; its presets: {known}")


def presets_of(method: str) -> list[str]:
    """The listed presets of ``method`` (``--preset``'s help), its default's first."""
    of_method = sorted((r for r in RECIPES if r.method == method and r.listed), key=lambda r: not r.method_default)
    return [recipe.presets[0] for recipe in of_method if recipe.presets]


__all__ = ["DEFAULT", "LISTED", "RECIPES", "Recipe", "get_recipe", "merged", "presets_of", "recipe_for"]
