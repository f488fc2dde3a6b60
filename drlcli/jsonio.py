"""The one JSON encoder for everything drl writes (``--json`` output, run files, exports, results),
and the one parser of the JSON and YAML it reads back.

Python's ``json`` writes ``NaN`` and ``Infinity`` by default, which no strict parser (``jq``,
JavaScript, Go) accepts. ``dumps`` writes strict JSON only: a non-finite float becomes ``null``
(an unknown value), and anything else that JSON cannot hold is an error, never a silent token.

``loads`` and ``load_yaml`` read files that may be crafted: whatever goes wrong while parsing one
(bad syntax, a document nested 200,000 deep that exhausts Python's recursion, a document too big
for memory) is a ``ValueError`` the caller turns into its own clear error, never a crash. Two
things parse cheaply but explode later, and are refused while parsing: YAML aliases that repeat a
node which repeats another (a 500-byte "billion laughs" document is a shared structure of 10^9
nodes that any ``repr`` or ``dumps`` of it walks), and integers too long for Python's ``int`` from
text (its 4,300-digit limit raises a ``ValueError`` whose advice, to raise the limit, is wrong here).
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

MAX_ALIAS_NODES = 10_000  # nodes a YAML document's aliases may repeat: a shared section, never a bomb
MAX_INT_DIGITS = 1_000  # an integer drl reads (sizes, counts, options) has far fewer; Python's own limit is 4,300


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, ±inf) inside dicts, lists and tuples replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: finite(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(value) for value in obj]
    return obj


def loads(data: bytes | str) -> Any:
    """Parse strict JSON (no NaN or Infinity); ``ValueError`` for anything that is not a JSON document drl can hold."""
    try:
        return json.loads(data, parse_constant=_no_constant, parse_int=_bounded_int)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except MemoryError:
        raise ValueError("too large to parse") from None


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")  # NaN, Infinity: Python's json reads them, no strict parser does


def _bounded_int(text: str) -> int:
    if len(text.lstrip("+-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits is too long (at most {MAX_INT_DIGITS})")
    return int(text)


def load_yaml(data: bytes | str) -> Any:
    """Parse YAML as ``yaml.safe_load`` does (plain data only, no tags that build objects), aliases
    and integers bounded (see above); ``ValueError`` for anything that is not a YAML document drl can hold."""
    import yaml

    try:
        return yaml.load(data, Loader=_bounded_loader())  # noqa: S506 (a SafeLoader, bounded)
    except yaml.YAMLError as exc:
        raise ValueError(_yaml_problem(exc)) from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except MemoryError:
        raise ValueError("too large to parse") from None


def _yaml_problem(exc: Exception) -> str:
    """One line saying what is wrong and where: ``expected ',' or ']', but got '<stream end>' (line 1,
    column 3)``, not the first of PyYAML's lines (``while parsing a flow sequence``)."""
    problem = getattr(exc, "problem", None)
    if not problem:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    mark = getattr(exc, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{problem}{where}"


@functools.cache
def _bounded_loader() -> type:
    """``yaml.SafeLoader`` that counts the nodes aliases repeat and refuses long integers (built once,
    on first use: yaml is imported only by the commands that read YAML)."""
    import yaml
    from yaml.composer import ComposerError
    from yaml.constructor import ConstructorError

    class BoundedLoader(yaml.SafeLoader):
        """A node composed counts 1; an alias counts the nodes of what it repeats (its anchor's
        count, aliases inside included): the document's size as ``repr`` or ``dumps`` would walk it."""

        def __init__(self, stream: Any) -> None:
            super().__init__(stream)
            self.repeated = 0
            self.sizes: dict[str, int] = {}  # each finished anchor's nodes, aliases inside expanded
            self.composed = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            anchor = self.peek_event().anchor
            if self.check_event(yaml.AliasEvent):
                if anchor in self.anchors and anchor not in self.sizes:  # inside itself: an endless structure
                    raise ComposerError(None, None, f"alias *{anchor} refers to a node that holds it", None)
                self.repeated += self.sizes.get(anchor, 0)
                if self.repeated > MAX_ALIAS_NODES:
                    raise ComposerError(
                        None, None, f"its aliases repeat more than {MAX_ALIAS_NODES} nodes (an alias bomb?)", None
                    )
                return super().compose_node(parent, index)
            before = self.composed + self.repeated
            self.composed += 1
            node = super().compose_node(parent, index)
            if anchor is not None:
                self.sizes[anchor] = self.composed + self.repeated - before
            return node

        def construct_object(self, node: Any, deep: bool = False) -> Any:
            """PyYAML's constructors raise IndexError, KeyError, AttributeError or ValueError for a
            tagged scalar they cannot build (``!!int ''``, ``!!bool x``, ``!!timestamp x``): a YAMLError here."""
            try:
                return super().construct_object(node, deep)
            except (LookupError, AttributeError, TypeError, ArithmeticError, ValueError) as exc:
                value = repr(node.value[:40]) if isinstance(node.value, str) else "node"
                problem = f"{node.tag} {value} does not build ({type(exc).__name__}: {str(exc)[:80]})"
                raise ConstructorError(None, None, problem, node.start_mark) from None

        def construct_yaml_int(self, node: Any) -> int:
            text = str(node.value).replace("_", "")
            if len(text.lstrip("+-")) > MAX_INT_DIGITS:
                raise ConstructorError(
                    None,
                    None,
                    f"an integer of {len(text)} digits is too long (at most {MAX_INT_DIGITS})",
                    node.start_mark,
                )
            return super().construct_yaml_int(node)

    BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)
    return BoundedLoader


def dumps(obj: Any, *, indent: int | None = None, sort_keys: bool = False) -> str:
    """Strict JSON text of ``obj`` (non-finite floats written as null)."""
    return json.dumps(finite(obj), indent=indent, sort_keys=sort_keys, allow_nan=False)
