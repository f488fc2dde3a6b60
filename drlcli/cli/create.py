"""``drl init``: a new run from a recipe (``recipes.py``), or from a method, its preset and a config file."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

import typer

from ..errors import UsageError
from ..options import MAX_SEED
from ..recipes import BY_NAME, DEFAULT, LISTED
from . import render
from .app import app
from .boundary import execute
from .options import (
    CONFIG_SECTIONS,
    PRESETS,
    JsonOpt,
    MethodName,
    PtmArgOpt,
    QuietOpt,
    RandomInitOpt,
    RunOpt,
    VerboseOpt,
    WeightsOpt,
    parse_ptm_args,
)
from .output import Reporter

RecipeName = Enum("RecipeName", {name: name for name in LISTED}, type=str)
# each recipe's three parts, for --recipe's help
RECIPES_HELP = "; ".join(
    f"{name} = {BY_NAME[name].features} / {BY_NAME[name].schedule} / {BY_NAME[name].head}" for name in LISTED
)


@app.command(short_help="Create a run directory for a PTM and a recipe (records its name, sha256 and config).")
def init(
    ptm: str = typer.Option(
        ...,
        "--ptm",
        help="timm ViT name, e.g. deit_tiny_patch16_224, or hf-hub:timm/REPO[@REVISION] from the Hugging Face cache.",
    ),
    ptm_weights: Path | None = WeightsOpt,
    random_init: bool = RandomInitOpt,
    ptm_arg: list[str] = PtmArgOpt,
    recipe: RecipeName | None = typer.Option(
        None,
        "--recipe",
        help=f"What the run learns with (default: {DEFAULT}, or the --config file's): {RECIPES_HELP}. "
        "docs/methods.md says why the default is what it is.",
    ),
    method: MethodName | None = typer.Option(
        None, "--method", help="The method the recipe is stored as (older spelling of --recipe, with --preset)."
    ),
    config: Path | None = typer.Option(
        None,
        "--config",
        help=f"YAML run config: recipe (or method and preset), and any of the sections {', '.join(CONFIG_SECTIONS)} "
        "(each a mapping of that section's keys; what is left out keeps the recipe's).",
    ),
    preset: str | None = typer.Option(
        None, "--preset", help=f"With --method, the recipe under its name there ({PRESETS})."
    ),
    seed: int = typer.Option(0, "--seed", min=0, max=MAX_SEED, help="Seed for --random-init."),
    allow_nonempty: bool = typer.Option(
        False,
        "--allow-nonempty",
        help="Create the run in a folder that holds other files (never changed). Without it init needs an "
        "empty folder; a file under one of the run's own names (ptm.safetensors, stages, ...) is refused either way.",
    ),
    run: Path = RunOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Create a run directory for a PTM and a recipe (records its name, sha256 and config)."""

    def action(reporter: Reporter) -> Any:
        from .. import api
        from ..config import RunConfig, closest_recipe
        from ..recipes import recipe_for

        named = recipe.value if recipe else None
        if named and (method or preset):
            raise UsageError("--recipe names the method and its options: drop --method and --preset")
        name = method.value if method else None
        if config:
            cfg = RunConfig.from_yaml(config, method=name, preset=preset, recipe=named)
        elif named:
            cfg = RunConfig.for_recipe(named)
        else:
            cfg = RunConfig.for_method(name or "drl", preset=preset)
        return api.init_run(
            run,
            ptm=ptm,
            ptm_weights=ptm_weights,
            random_init=random_init,
            ptm_kwargs=parse_ptm_args(ptm_arg),
            config=cfg,
            recipe=named or (closest_recipe(cfg)[0].name if config else recipe_for(name or "drl", preset).name),
            seed=seed,
            allow_nonempty=allow_nonempty,
            progress=reporter,
        )

    execute(action, render.init, name="init", phase=f"creating {run}", as_json=as_json, quiet=quiet, verbose=verbose)
