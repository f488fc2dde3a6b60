"""The ``drl`` Typer application: its top-level options (``--version``), the entry point, and the
app every command registers on (``commands.py``, ``bench.py``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from .. import jsonio
from ..errors import UsageError
from .boundary import ClickUsageError, OneLineErrors, fail
from .options import (
    EPILOG,
)

app = typer.Typer(
    cls=OneLineErrors,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, powershell)
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts are plain: brackets such as [/key=value] are not markup
    help="Add classes to a pre-trained ViT classifier stage by stage, without old data and without forgetting: an analytic head on the PTM and an adapter set it trains where adapting pays (the default recipe); drl init --recipe paper is the DRL paper's IPA network + DAS.",
    epilog=EPILOG,
)


def _installed(distribution: str) -> str | None:
    """A distribution's version from its metadata (no import: torch alone takes seconds); None if absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _torch_version() -> str | None:
    """torch's own ``__version__``, build tag included (``+cu130``, ``+cpu``: the metadata may lack it),
    read from ``torch/version.py`` without importing torch; the metadata's version if that fails."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return _installed("torch")
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    return _installed("torch")


def _versions(*, cuda: bool) -> dict[str, Any]:
    """drlcli's, torch's and timm's versions; whether CUDA is available only if asked (``cuda``):
    only torch can tell, and importing it is what makes ``drl --version`` slow."""
    from ..version import __version__

    versions: dict[str, Any] = {"drlcli": __version__, "torch": _torch_version(), "timm": _installed("timm")}
    if cuda:
        import torch

        versions["cuda_available"] = torch.cuda.is_available()
    return versions


@app.callback(invoke_without_command=True)
def _top_level(
    ctx: typer.Context,
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the versions of drlcli, torch and timm (without loading torch: instant); with --verbose also "
        "whether CUDA is available (loads torch: seconds).",
    ),
    as_json: bool = typer.Option(False, "--json", help="With --version: one JSON object on stdout."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="With --version: also whether CUDA is available."),
) -> None:
    if version:
        versions = _versions(cuda=verbose)
        if as_json:
            print(jsonio.dumps({"ok": True, **versions}))
        else:
            print(
                "\n".join(f"{name} {'not installed' if value is None else value}" for name, value in versions.items())
            )
        raise typer.Exit(0)
    if as_json:  # `drl --json eval` would silently drop --json: it belongs to the command
        fail(UsageError("--json goes after the command (e.g. drl eval --json) or with --version"), as_json=True)
    if verbose:  # the same for --verbose; a click error: OneLineErrors answers a later --json too
        raise ClickUsageError("--verbose goes after the command (e.g. drl eval --verbose) or with --version", ctx=ctx)
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())


def main() -> None:
    """Entry point (``drl``, ``python -m drlcli``); under torchrun each command joins the process
    group once its options are parsed (``boundary.command``), and leaves it here."""
    clean = False
    try:
        app()
        clean = True
    except SystemExit as exc:  # typer ends every command with one
        clean = exc.code in (0, None)
        raise
    finally:
        if "drlcli.distributed" in sys.modules:  # a command ran (or torchrun set up the group)
            sys.modules["drlcli.distributed"].teardown(clean=clean)
