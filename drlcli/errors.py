"""The DrlError hierarchy: every failure a user can cause, each with its exit code.

The CLI maps these to one-line messages and exit codes in one place (``cli/boundary.py``); the library
raises them and never prints. Exit codes are part of the public contract (README and docs/exit-codes.md).
"""

from __future__ import annotations

import reprlib
from typing import Any

SHOWN_CHARS = 80  # of a value quoted in a message: enough to recognise it, never the whole of a crafted one


class _Bounded(reprlib.Repr):
    """``reprlib``'s bounded repr: it walks at most a few items a level and a few levels, so a value
    that is huge, or a shared structure that expands to 10^9 nodes, costs the same as a small one."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, SHOWN_CHARS, SHOWN_CHARS, SHOWN_CHARS
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 6

    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int past Python's 4,300-digit limit raises; such an int is shown by its size alone
        if x.bit_length() > 4 * SHOWN_CHARS:
            return f"<an integer of about {int(x.bit_length() * 0.30103) + 1} digits>"
        return super().repr_int(x, level)


def shown(value: Any) -> str:
    """``repr(value)`` for a message, cut to about ``SHOWN_CHARS`` characters with "...": a value a
    user or a crafted file gave is quoted, never pasted whole into a one-line error."""
    text = _Bounded().repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


class DrlError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with; ``kind`` names it in JSON output."""

    exit_code = 1
    kind = "error"


class UsageError(DrlError):
    """Options that contradict each other or the run (same code as a CLI parsing error)."""

    exit_code = 2
    kind = "usage"


class DependencyError(UsageError):
    """An optional extra the command needs is not installed; the message names the pip command."""

    kind = "missing_dependency"


def require(module: str, *, extra: str, purpose: str):
    """Import an optional dependency, or raise ``DependencyError`` naming the extra that brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise DependencyError(
            f"{purpose} needs the Python package {module.split('.')[0]!r}, which is not installed; "
            f"pip install 'drlcli[{extra}]'"
        ) from exc


class DataError(DrlError):
    """Bad training or evaluation data: empty, corrupt, unknown or duplicate classes."""

    exit_code = 3
    kind = "bad_data"


class DivergedError(DataError):
    """Training produced a non-finite loss or weights (usually a learning rate too high for the
    data); the stage is not committed and no checkpoint of it is kept."""

    kind = "diverged"


class RunBusyError(DrlError):
    """Another process holds the run directory's writer lock."""

    exit_code = 4
    kind = "busy"


class IntegrityError(DrlError):
    """The run directory or an exported file is damaged, of an unknown version, or mismatched."""

    exit_code = 5
    kind = "integrity"


class PTMError(DrlError):
    """The pre-trained model cannot be built or its weights cannot be found or loaded."""

    exit_code = 6
    kind = "ptm"


class RunStateError(DrlError):
    """The run directory is not in a state that allows the command (missing, not initialised)."""

    exit_code = 7
    kind = "run_state"


class StorageError(DrlError):
    """Writing failed (disk full, permissions); the previous committed state is intact."""

    exit_code = 8
    kind = "storage"


EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "unexpected internal error (a bug: please report it)",
    2: "usage error: bad or contradictory options, or a missing optional extra (the message names the pip command)",
    3: "bad data: empty/corrupt/unknown/duplicate classes or images",
    4: "run busy: another process is writing to the run directory",
    5: "integrity failure: damaged run or export, unknown format version, different PTM",
    6: "PTM error: weights missing, not downloadable, or not loadable",
    7: "run state: not a run directory, already initialised, or nothing learned yet",
    8: "storage error: a write failed (e.g. disk full); the previous state is kept",
    130: "interrupted (Ctrl-C); the previous committed state is kept, re-run to resume",
}
