"""The one JSON encoder for everything drl writes (``--json`` output, run files, exports, results),
and the one parser of the JSON and YAML it reads back.

Python's ``json`` writes ``NaN`` and ``Infinity`` by default, which no strict parser (``jq``,
JavaScript, Go) accepts. ``dumps`` writes strict JSON only: a non-finite float becomes ``null``
(an unknown value), and anything else that JSON cannot hold is an error, never a silent token.

``loads`` and ``load_yaml`` read files that may be crafted: whatever goes wrong while parsing one
(bad syntax, a document nested 200,000 deep that exhausts Python's recursion, a document too big
for memory) is a ``ValueError`` the caller turns into its own clear error, never a crash.
"""

from __future__ import annotations

import json
import math
from typing import Any


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
        return json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except MemoryError:
        raise ValueError("too large to parse") from None


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")  # NaN, Infinity: Python's json reads them, no strict parser does


def load_yaml(data: bytes | str) -> Any:
    """Parse YAML with ``yaml.safe_load`` (plain data only, no tags that build objects);
    ``ValueError`` for anything that is not a YAML document drl can hold."""
    import yaml

    try:
        return yaml.safe_load(data)
    except yaml.YAMLError as exc:
        raise ValueError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except MemoryError:
        raise ValueError("too large to parse") from None


def dumps(obj: Any, *, indent: int | None = None, sort_keys: bool = False) -> str:
    """Strict JSON text of ``obj`` (non-finite floats written as null)."""
    return json.dumps(finite(obj), indent=indent, sort_keys=sort_keys, allow_nan=False)
