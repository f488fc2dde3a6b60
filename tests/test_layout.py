"""The package's shape (issue 31): imports run one way, from the command layer down to storage,
never back up and never in a loop (imports inside functions count; ``TYPE_CHECKING`` ones do not),
no module is over 400 lines, no function's cyclomatic complexity (radon's) is over 12, and ``ranpac``
is named only by the ridge head and its method."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "drlcli"

# Layers, bottom to top (docs/architecture.md holds the same table): a module imports only from its
# own layer or below. The first matching prefix names a module's layer.
LAYERS = [
    (
        1,
        (
            "version",
            "errors",
            "jsonio",
            "storage",
            "progress",
            "seeding",
            "options",
            "distributed",
            "device",
            "precision",
        ),
    ),
    (1, ("metrics", "synthetic", "csvsafe")),
    (2, ("ptm", "data")),
    (3, ("features", "schedule", "heads")),  # the three parts of a recipe; none reads another
    (4, ("methods",)),
    (5, ("recipes", "config")),
    (6, ("model",)),
    (7, ("run",)),
    (8, ("evaluation", "serving", "plots", "tracking")),
    (9, ("stage", "commands", "benchmark")),
    (10, ("api",)),
    (11, ("cli", "__main__", "")),  # "": the package itself (its lazy public names)
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    return next(layer for layer, names in LAYERS if top in names)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, relative or absolute, at any depth but TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("drlcli"):
                target = node.module.removeprefix("drlcli").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("drlcli.") for a in node.names if a.name.startswith("drlcli."))
    return {m for m in found if m in modules and m != here}


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports(path, set(paths)) for name, path in paths.items()}


def test_no_import_runs_back_up_the_layers():
    upward = [
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, targets in graph().items()
        for b in targets
        if layer_of(b) > layer_of(a) and not b.startswith(a + ".")  # a package imports its own modules
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycle():
    edges = graph()
    # a package __init__ that hands on names from its own modules is not a cycle with them
    for name in edges:
        edges[name] = {t for t in edges[name] if not (t.startswith(name + ".") if name else True)}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert not cycles, cycles


def test_the_graph_sees_imports_inside_functions():
    """The checks above would pass vacuously if function-level imports were missed."""
    edges = graph()
    assert "api" in edges["cli.commands"]  # cli's _api(): imported inside a function
    assert "features.ipa.network" in edges["features.ipa"]  # the network: imported when first built


def test_no_module_is_over_400_lines():
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long


MAX_COMPLEXITY = 12  # radon's cyclomatic complexity: its branches, boolean operators and comprehension conditions


def _functions(blocks: list) -> list:
    """Every function radon found among ``blocks``: methods of classes (nested ones too) and closures."""
    from radon.visitors import Class

    found = []
    for block in blocks:
        if isinstance(block, Class):
            found += _functions([*block.methods, *block.inner_classes])
        else:
            found += [block, *_functions(block.closures)]
    return found


def test_no_function_is_over_complexity_12():
    from radon.complexity import cc_visit

    over = sorted(
        f"{p.relative_to(PACKAGE)}:{f.lineno} {f.fullname} ({f.complexity})"
        for p in PACKAGE.rglob("*.py")
        for f in _functions(cc_visit(p.read_text()))
        if f.complexity > MAX_COMPLEXITY
    )
    assert not over, f"{len(over)} functions over complexity {MAX_COMPLEXITY}:\n" + "\n".join(over)


def test_ranpac_is_named_only_by_the_ridge_head_its_method_and_its_recipes():
    """RanPAC's facts live with its head, its method and its recipes: nothing else names it but the
    adapter set (RanPAC's first session, which the default shares) and the config's reading of the
    section name earlier releases gave the ridge head."""
    import re

    word = re.compile(r"\branpac\b(?!-)")  # a recipe's name (ranpac-published) is a name
    allowed = ("heads/ridge/", "methods/__init__.py", "features/adapter/", "recipes.py", "config.py")
    found = sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if word.search(p.read_text()) and not str(p.relative_to(PACKAGE)).startswith(allowed)
    )
    assert not found, found


def test_the_product_tree_holds_no_lab_and_its_pages_stay_short():
    """Research lives in git history (the docs cite it at its commit); the pages a user reads first stay short."""
    root = PACKAGE.parent
    assert not (root / "benchmarks" / "research").exists() and not (root / "docs" / "research").exists()
    limits = {"README.md": 200, "docs/benchmarks.md": 300, "CHANGELOG.md": 300}
    long = {name: n for name, limit in limits.items() if (n := len((root / name).read_text().splitlines())) >= limit}
    assert not long, long
    assert "## [0.1.0]" in (root / "CHANGELOG.md").read_text()
