"""The distribution's metadata: its name, one version source, and a declared dependency for every import."""

import ast
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path

import pytest

import drlcli

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
# distribution name -> the top-level module it installs, where they differ
MODULE_OF = {"pillow": "PIL", "pyyaml": "yaml"}


def _imported_modules() -> set[str]:
    """Top-level modules imported by drlcli, including optional ones loaded through ``errors.require``."""
    found: set[str] = set()
    for path in (ROOT / "drlcli").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "require"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.add(node.args[0].value.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"drlcli"}


def _declared_modules() -> set[str]:
    project = PYPROJECT["project"]
    specs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        specs += extra
    names = {re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower() for spec in specs}
    return {MODULE_OF.get(name, name) for name in names}


def test_every_third_party_import_is_declared():
    imported = _imported_modules()
    # the scan sees them (torchvision is declared for its pairing with torch; timm's transforms import it)
    assert {"torch", "timm", "numpy", "PIL", "yaml", "huggingface_hub"} <= imported
    assert imported - _declared_modules() == set()


def test_distribution_name_version_and_license():
    project = PYPROJECT["project"]
    assert project["name"] == "drlcli"  # `drl` on the public index is an unrelated package
    assert PYPROJECT["project"]["scripts"] == {"drl": "drlcli.cli:main"}
    assert "version" not in project and project["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "drlcli.version.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", drlcli.__version__)
    assert project["license"] == "Apache-2.0"  # SPDX expression, not the deprecated table


def test_install_hints_name_the_distribution():
    """Every `pip install '...[extra]'` hint in the package and README names drlcli, never `drl`."""
    for path in [*(ROOT / "drlcli").rglob("*.py"), ROOT / "README.md"]:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"pip install ['\"]?drl\[", text), path


def test_public_api_names_stay_functions_after_every_submodule_is_imported():
    """The lazy API names must never be shadowed by a submodule of the same name (`drlcli.evaluate`
    was one: importing the metrics module replaced the function on the package)."""
    for module in pkgutil.iter_modules(drlcli.__path__):
        if module.name not in ("__main__", "cli"):
            importlib.import_module(f"drlcli.{module.name}")
    for name in drlcli.__all__:
        assert callable(getattr(drlcli, name)) and not inspect.ismodule(getattr(drlcli, name)), name
