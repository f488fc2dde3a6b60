"""The one JSON encoder for everything drl writes: ``--json`` output, run files, exports, results.

Python's ``json`` writes ``NaN`` and ``Infinity`` by default, which no strict parser (``jq``,
JavaScript, Go) accepts. ``dumps`` writes strict JSON only: a non-finite float becomes ``null``
(an unknown value), and anything else that JSON cannot hold is an error, never a silent token.
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


def dumps(obj: Any, *, indent: int | None = None, sort_keys: bool = False) -> str:
    """Strict JSON text of ``obj`` (non-finite floats written as null)."""
    return json.dumps(finite(obj), indent=indent, sort_keys=sort_keys, allow_nan=False)
