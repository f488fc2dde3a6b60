"""CSV that spreadsheets open safely (``eval --report``'s tables, ``predict --format csv``).

A cell that starts with ``=``, ``+``, ``-`` or ``@`` (or a tab or carriage return, which some
spreadsheets skip before reading a formula) is a formula to Excel, LibreOffice and Google Sheets:
a class name such as ``=cmd|' /C calc'!A0`` could run a command when the file is opened (CSV
injection). ``cell`` prefixes such text with ``'``, which spreadsheets show as text; numbers stay
numbers. Quotes, commas and newlines are the ``csv`` module's to quote. Imports no torch.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from typing import Any

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def cell(value: Any) -> str:
    """One cell's text: '' for None, numbers as written, text guarded against formula injection."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value) if isinstance(value, float) else str(value)
    text = str(value)
    return "'" + text if text.startswith(FORMULA_STARTS) else text


def csv_text(rows: Iterable[Iterable[Any]], *, lineterminator: str = "\r\n") -> str:
    """``rows`` as CSV text (every cell through ``cell``; RFC 4180 line ends unless asked)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator=lineterminator)
    for row in rows:
        writer.writerow([cell(v) for v in row])
    return out.getvalue()


def prediction_header(top_k: int) -> list[str]:
    """``drl predict --format csv``'s header: path, class_1, score_1, ..., class_k, score_k, unknown, error."""
    return ["path", *(f"{what}_{i}" for i in range(1, top_k + 1) for what in ("class", "score")), "unknown", "error"]


def prediction_rows(p: dict[str, Any], *, top_k: int, header: bool = False) -> list[list[Any]]:
    """One image's row of ``drl predict --format csv`` from its JSON object (``Prediction.to_dict``):
    fewer classes than ``top_k`` (or an error) leave their cells empty; the header first when asked."""
    top = p.get("top") or []
    pairs = [(t["class"], t["score"]) for t in top[:top_k]] + [(None, None)] * (top_k - len(top[:top_k]))
    row = [p["path"], *(v for pair in pairs for v in pair), p.get("unknown"), p.get("error")]
    return [prediction_header(top_k), row] if header else [row]
