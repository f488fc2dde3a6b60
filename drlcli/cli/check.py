"""``drl check-data``: a drop checked before ``learn-stage``, every problem in one report. Its own
module (command and renderer) because ``commands.py`` and ``render.py`` are near the 400-line limit.
Clean: the summary on stdout, exit 0. Problems: the report on stdout all the same (with ``--json``
one object, ``ok`` false and the ``error`` object every failure has), one ``error:`` line on stderr,
and the exit code learn-stage would give for the most severe problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from .. import jsonio
from . import commands  # noqa: F401  (registered first: --help lists the commands on a run before this one)
from .app import app
from .boundary import command
from .options import JsonOpt, QuietOpt, RunOpt, VerboseOpt
from .output import emit, print_error, printable_data, printable_lines

SHOWN = 20  # problems (and notes) listed in the text; --json has every one


@app.command(
    "check-data",
    short_help="Check a drop before learn-stage: every problem named in one run, and the stage's cost; writes nothing.",
)
def check_data(
    data: Path = typer.Option(..., "--data", help="The drop: one sub-folder of images per new class."),
    eval_data: Path | None = typer.Option(None, "--eval-data", help="The test folder learn-stage would get."),
    run: Path = RunOpt,
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Check a drop before learn-stage: classes and images, images that do not decode, images shared
    between classes or with --eval-data, classes the run already learned, split folders, and what
    the stage would cost. Every problem is named in one run; the exit code is learn-stage's for the
    most severe (3: bad data), 0 when clean. Reads the run, writes nothing."""
    with command(name="check-data", as_json=as_json, quiet=quiet, verbose=verbose) as reporter:
        reporter.phase(f"checking {data}")
        from .. import api

        result = api.check_data(run, data, eval_data_dir=eval_data, progress=reporter)
    if not result.problems:
        emit(result, render, as_json=as_json)
        return
    payload = result.to_dict()
    message = error_message(payload)
    if as_json:  # the report and the error object every failure has, in one line
        error = {"kind": "bad_data", "message": message, "exit_code": result.exit_code}
        print(jsonio.dumps({"ok": False, **payload, "error": error}))
    else:
        print(printable_lines(render(printable_data(payload))), end="")
    print_error("bad_data", message, result.exit_code, as_json=False)
    raise typer.Exit(result.exit_code)


def error_message(r: dict[str, Any]) -> str:
    problems = r["problems"]
    kinds = sorted({p["kind"] for p in problems})
    return (
        f"{len(problems)} problem(s) in --data {r['data_dir']}"
        + (f" or --eval-data {r['eval_data_dir']}" if r["eval_data_dir"] else "")
        + f" ({', '.join(kinds)}); learn-stage would exit {r['exit_code']}: fix them (listed above) and check again"
    )


def render(r: dict[str, Any]) -> str:
    """The report for people: the drop's classes, each problem and note, and the stage's cost."""
    counts = ", ".join(f"{name} {n}" for name, n in r["classes"].items())
    lines = [f"--data {r['data_dir']}: {len(r['classes'])} classes, {r['num_images']} images ({counts})"]
    if r["eval_classes"] is not None:
        lines.append(
            f"--eval-data {r['eval_data_dir']}: {len(r['eval_classes'])} classes, {r['num_eval_images']} images"
        )
    for title, items in (("problems", r["problems"]), ("notes", r["notes"])):
        if items:
            lines.append(f"{title} ({len(items)}):")
            lines += [f"  [{p['kind']}] {p['message']}" for p in items[:SHOWN]]
            if len(items) > SHOWN:
                lines.append(f"  ... and {len(items) - SHOWN} more (--json lists every one)")
    if r["cost"]:
        lines += cost_lines(r["cost"])
    if not r["problems"] and r["learned_as"] is None:
        also = f" --eval-data {r['eval_data_dir']}" if r["eval_data_dir"] else ""
        lines.append(f"no problems: `drl learn-stage --run {r['run_dir']} --data {r['data_dir']}{also}` can learn it")
    elif not r["problems"]:
        lines.append(f"no problems: the run has learned this drop as stage {r['learned_as']} already")
    return "\n".join(lines) + "\n"


def cost_lines(c: dict[str, Any]) -> list[str]:
    trained = (
        f"trains {c['epochs']} epoch(s) (train.epochs, at most schedule.later_epochs once the set has trained; "
        f"--epochs changes it): {c['train']:,} passes"
        if c["trained"]
        else "trains nothing at this stage (the run's recipe)"
    )
    lines = [
        f"as stage {c['stage']}: about {c['passes']:,} forward-pass equivalents (an estimate; one image through the "
        f"PTM once): {c['num_images']} images; {trained}; feature pass {c['features']:,}; evaluation {c['evaluation']:,}"
    ]
    return lines + [f"  {note}" for note in c["notes"]]
