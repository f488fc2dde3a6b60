"""The ``drl`` command line: a thin Typer layer over the library (``drlcli.api``: the modules that
own each command, ``commands/``, ``stage/``, ``benchmark/``).

    app.py       the Typer app, its top-level options (--version), the entry point
    commands.py  the commands on a run: parse options, make one library call, hand the result to render
    bench.py     benchmark and demo
    check.py     check-data (its command and renderer)
    boundary.py  the one error boundary: every failure -> one ``error:`` line and its exit code
    output.py    stdout/stderr plumbing: logging, progress (rich bar or plain lines), JSON emitters
    render.py    the text of each command's result (what ``--json`` prints as one object)
    stage_lines.py  a stage's decisions as lines (first session, carry, transfer, switch), for render
    options.py   options shared by several commands, choices, the exit-code epilog

Results go to stdout (text, or one JSON object with ``--json``); logs and progress to stderr.
"""

import time  # noqa: F401  (drlcli.cli.time: tests pin the progress clock through it)

from . import bench, check  # noqa: F401  (they and commands.py, which they import first, register the commands)
from .app import app, main
from .output import Reporter, setup_logging

_setup_logging = setup_logging  # the pre-package name
__all__ = ["Reporter", "app", "main", "setup_logging"]
