"""What each command prints on stdout without ``--json``: the text of its result, built from the
result's JSON payload (so text and ``--json`` show the same facts). Pure functions: a payload in,
the text out (with its trailing newline); ``output.emit`` prints it.

Every string of the payload a renderer gets is already ``printable`` (``output.emit`` escapes the
payload first: a class name, path or reason cannot drive the terminal or fake a line), so a
renderer quotes names with ``_quoted``, never ``!r`` (which would escape the escapes again)."""

from __future__ import annotations

import shlex
from typing import Any

from .. import jsonio
from ..csvsafe import csv_text, prediction_rows
from .output import printable_data
from .stage_lines import carry_lines, cost_line, first_session_line, switch_line, transfer_line, trial_line


def _text(lines: list[str]) -> str:
    return "\n".join(lines) + "\n"


def _quoted(name: str) -> str:
    """A (printable) name in quotes, as ``repr`` would quote it."""
    return f'"{name}"' if "'" in name and '"' not in name else f"'{name}'"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def history_lines(history: dict[str, Any]) -> list[str]:
    acc = history["accuracy"]
    lines = ["A_t by stage: " + "  ".join(f"A_{i + 1} {_pct(a)}" for i, a in enumerate(acc))]
    lines.append(f"average A (Ā): {_pct(history['average'])}   last A_T: {_pct(history['last'])}")
    if history["forgetting"]:
        lines.append(
            "forgetting by stage group: " + "  ".join(f"{g}: {v:.2f}" for g, v in history["forgetting"].items())
        )
    return lines


def matrix_lines(matrix: list[list[float | None]]) -> list[str]:
    """The accuracy matrix as a table: row t after stage t, column g the classes of stage g."""
    if not any(v is not None for row in matrix for v in row):
        return []
    lines = ["accuracy matrix (row: after stage t; column: classes of stage g)"]
    lines.append("     " + "".join(f"{f'g{g}':>7}" for g in range(1, len(matrix) + 1)))
    for t, row in enumerate(matrix, 1):
        lines.append(f"{f't{t}':<5}" + "".join(f"{_pct(v):>7}" for v in row))
    return lines


def growth_lines(stages: list[dict[str, Any]]) -> list[str]:
    """Per stage: what it added and the model's size so far (parameters trained, bytes on disk)."""
    head = (
        f"{'stage':>5} {'classes':>8} {'images':>7} {'params':>10} {'cum.params':>11} {'MiB':>7} {'cum.MiB':>8} "
        f"{'A_t':>6} {'passes':>7}"
    )
    lines = [head]
    for s in stages:
        params = f"{s['num_params']:,}" + ("*" if s.get("untrained") else "")
        size = f"{s['bytes'] / 2**20:.2f}" + ("+" if s.get("holds_totals") else "")
        lines.append(
            f"{s['stage']:>5} {s['num_classes']:>8} {s['num_images']:>7} {params:>10} "
            f"{s['cumulative_params']:>11,} {size:>7} {s['cumulative_bytes'] / 2**20:>8.2f} "
            f"{_pct(s['accuracy']):>6} {_passes(s.get('passes')):>7}"
        )
    lines += _cost_total(stages)
    lines_of = (("trial", trial_line), ("first_session", first_session_line), ("transfer", transfer_line))
    for key, line in lines_of:
        lines += [f"stage {s['stage']}: " + line(s[key]) for s in stages if s.get(key) and _counted(key, s[key])]
    lines += [f"stage {s['stage']}: " + switch_line(s["switch"], s.get("transfer")) for s in stages if s.get("switch")]
    return lines + _growth_notes(stages)


def _counted(key: str, record: dict[str, Any]) -> bool:
    """A record worth a line: a forward transfer only once the run has counted images (an untrained
    set's stages, kept by their trials, count none)."""
    return key != "transfer" or bool(record["run"]["images"])


def _passes(p: dict[str, Any] | None) -> str:
    return "-" if p is None else f"{p['per_image']:g}"


def _cost_total(stages: list[dict[str, Any]]) -> list[str]:
    """The run's learning cost so far: every stage's forward passes, per image of the run."""
    known = [s for s in stages if s.get("passes")]
    if not known:
        return []
    passes = sum(s["passes"]["per_image"] * s["num_images"] for s in known)
    images = sum(s["num_images"] for s in known)
    return [
        f"passes: forward passes per image a stage's learning cost (a training step 3); the run's so far "
        f"{passes:,.0f}, {passes / max(1, images):.1f} an image"
    ]


def _growth_notes(stages: list[dict[str, Any]]) -> list[str]:
    """The notes under the growth table: a stage's held-out eval set, a paused stage, the marks (+, *)."""
    lines = [
        f"stage {s['stage']}: evaluated on {e['num_images']} images held out of its drop (--eval-fraction "
        f"{e['held_out']:g}, seed {e['seed']}); eval --all-seen does not evaluate them again"
        for s in stages
        if isinstance(e := s.get("eval_data"), dict) and "held_out" in e
    ]
    lines += [
        f"stage {s['stage']}: the carried network was not trained ({_paused_why(s.get('trial'), s.get('transfer'))})"
        for s in stages
        if s.get("paused")
    ]
    if any(s.get("holds_totals") for s in stages):
        lines.append(
            "+ with the run's totals (what the next stage reads: W and the sums so far, or a carried run's "
            "adapter set and class Gaussians), kept by the newest stage"
        )
    if any(s.get("untrained") for s in stages):
        lines.append(
            "* no stage network: nothing was trained (the run's method and options train no adapters for "
            "this stage; see its learn-stage output); its parameters are the head's it solved"
        )
    return lines


def accuracy_lines(acc: dict[str, Any]) -> list[str]:
    lines = [f"top-1: {acc['top1']:.2f}% on {acc['num_images']} images"]
    if acc.get("top5") is not None:
        lines.append(f"top-5: {acc['top5']:.2f}%")
    lines.append("by stage group: " + "  ".join(f"stage {g}: {v:.2f}" for g, v in acc["groups"].items()))
    lines.append(f"old classes: {_pct(acc['old'])}   new classes: {_pct(acc['new'])}")
    return lines


# ------------------------------------------------------------------------------ commands


def init(r: dict[str, Any]) -> str:
    return _text(
        [
            f"initialised {r['run_dir']}: recipe {r.get('recipe') or '-'} (method {r['method']}), PTM {r['ptm']} ({_ptm_source(r['ptm_source'], r.get('ptm_hub'))}, "
            f"sha256 {r['ptm_sha256'][:12]}...)"
        ]
    )


def _ptm_source(source: str, hub: dict[str, Any] | None) -> str:
    """Where the PTM's weights came from; an hf-hub repo with its commit."""
    return f"hf-hub:{hub['repo']} at {hub['revision'][:12]}" if hub else source


def learn_stage(r: dict[str, Any]) -> str:
    if r["status"] == "unchanged":
        return _text([f"stage {r['stage']} already learned exactly these images; nothing to do"])
    lines = [f"resumed from the checkpoint after epoch {r['resumed_from_epoch']}"] if r["resumed_from_epoch"] else []
    lines.append(_learned_line(r))
    if r.get("passes"):
        lines.append(cost_line(r["passes"]))
    if r.get("first_session"):
        lines.append(first_session_line(r["first_session"]))
    if r.get("carry"):  # a carried run's stage after the first
        lines += carry_lines(r["carry"])
    if r.get("switch"):
        lines.append(switch_line(r["switch"], (r.get("carry") or {}).get("transfer")))
    if r["eval"]:
        lines += accuracy_lines(r["eval"]) + history_lines(r["history"])
    if r["tensorboard_dir"]:
        lines.append(f"tensorboard: {r['tensorboard_dir']}")
    return _text(lines)


def _learned_line(r: dict[str, Any]) -> str:
    """learn-stage's line of what the stage learned, in how long, and what it trained."""
    head = f"{len(r['classes'])} classes from {r['num_images']} images in {r['total_seconds']:.1f}s"
    if r["training_skipped"]:  # nothing was trained: the feature pass and the head's solve
        return (
            f"stage {r['stage']}: learned {head} (feature pass and head fit {r['train_seconds']:.1f}s, "
            f"{r['num_params']:,} head parameters solved); no stage adapters: "
            + (r.get("skipped_because") or "nothing trained")
        )
    carry = r.get("carry") or {}
    if carry.get("paused"):  # a switched run's carried network, kept as it stood
        why = "its trial (below)" if carry.get("trial") else _paused_why(None, carry.get("transfer"))
        return (
            f"stage {r['stage']}: learned {head} (feature pass and head fit {r['train_seconds']:.1f}s); the carried "
            f"network was not trained: {why}"
        )
    resumed = " over every call that trained it" if r["resumed_from_epoch"] else ""  # more than this call's total
    return (
        f"stage {r['stage']}: learned {head} (training {r['train_seconds']:.1f}s{resumed}{_dtype(r)}, {r['num_params']:,} "
        + ("head parameters solved" if (r.get("first_session") or {}).get("kept") == "frozen" else "parameters")
        + ")"
    )


def _paused_why(trial: dict[str, Any] | None, transfer: dict[str, Any] | None) -> str:
    """Why a switched run's carried network was not trained at a stage, for people: its own trial, the
    run's earlier trials (the set never trained: it counted no image), or its forward transfer."""
    if trial:
        return (
            "too few classes to try adapting on" if trial.get("deferred") else "its trial said adapting changes little"
        )
    run = transfer.get("run") if isinstance(transfer, dict) else None
    if isinstance(run, dict) and run.get("images") == 0:
        return "the run's trials said adapting changes little"
    return "the run's forward transfer says adapting stalls"


def _dtype(r: dict[str, Any]) -> str:
    """ " in bf16" where the training steps ran in a dtype other than the call's (``train.precision``)."""
    own = r.get("train_precision")
    return f" in {own}" if own and own != r.get("precision") else ""


def _answering(r: dict[str, Any]) -> str:
    """ ", answering from ..." for a switched run (its ``answers``), else nothing."""
    names = {"frozen": "the frozen PTM's head", "carried": "the adapted network's head"}
    return f", answering from {names[r['answers']]}" if r.get("answers") in names else ""


def evaluate(r: dict[str, Any]) -> str:
    lines = [f"{r['num_classes']} classes over {r['num_stages']} stages{_answering(r)}"]
    lines += accuracy_lines(r["accuracy"]) + history_lines(r["history"])
    lines.append("\n".join(matrix_lines(r["history"]["matrix"])))  # an empty line when nothing was evaluated
    if r["confused"]:
        lines.append(
            "most confused (true -> predicted): "
            + ", ".join(f"{c['true']} -> {c['predicted']} ({c['count']})" for c in r["confused"])
        )
    if r.get("open_set"):
        o = r["open_set"]
        rule = (
            o["rule"]
            if o.get("probe_block") is None
            else f"{o['rule']} (f_0 and block {o['probe_block']}'s class token)"
        )
        lines.append(
            f"unknown images ({o['num_unknown']}) against known ({o['num_known']}), rule {rule}: AUROC {o['auroc']:.4f}; "
            f"at the calibrated threshold {o['unknown_accepted']:.2f}% of unknown images accepted, "
            f"{o['known_rejected']:.2f}% of known images rejected; top-1 counting rejections as errors "
            f"{o['top1_accepted']:.2f}% (closed-set {o['top1_closed']:.2f}%)"
        )
    if r["plot"]:
        lines.append(f"plot: {r['plot']}")
    if r.get("report"):
        lines.append(f"report: {r['report']} (per_class.csv, confusion.csv, confusion.png, stages.csv)")
    return _text(lines)


def export(r: dict[str, Any]) -> str:
    check = "" if r["check_max_abs_diff"] is None else f", max |Δscore| {r['check_max_abs_diff']:.1e} vs the run"
    return _text(
        [
            f"exported {r['num_classes']} classes, {r['num_stages']} stages{_answering(r)} to {r['path']} "
            f"({r['format']}, {r['bytes'] / 2**20:.1f} MiB{check})"
        ]
        + ([f"model card: {r['card']}"] if r.get("card") else [])
    )


def prediction(p: dict[str, Any], *, style: str, top_k: int = 5, first: bool = False) -> str:
    """One image's line: its JSON object (``style`` jsonl, exact), its CSV row (csv, after the header
    when ``first``: ``csvsafe.prediction_rows``), else ``path: class score, ...`` with the path, classes
    and error text escaped (``printable``): one line per image, whatever the names."""
    if style == "jsonl":
        return jsonio.dumps(p)
    if style == "csv":
        return csv_text(prediction_rows(p, top_k=top_k, header=first), lineterminator="\n")[:-1]
    p = printable_data(p)
    if "error" in p:
        return f"{p['path']}: error: {p['error']}"
    mark = "unknown; closest " if p.get("unknown") else ""
    return f"{p['path']}: {mark}" + ", ".join(f"{t['class']} {t['score']:.3f}" for t in p["top"])


def verify(r: dict[str, Any]) -> str:
    lines = [
        f"run {r['run_dir']} is intact: generation {r['generation']}, "
        f"{r['num_stages']} stages, {r['files_checked']} files ({r['bytes_checked'] / 2**20:.2f} MiB) verified"
    ]
    if r["interrupted_stage"]:
        w = r["interrupted_stage"]
        lines.append(
            f"stage {w['stage']} was interrupted after epoch {w['epoch']}/{w['epochs']}: re-run the same "
            "learn-stage to resume it, or add --restart"
        )
    return _text(lines)


def card(r: dict[str, Any]) -> str:
    """``info --card``: the model card's lines as ``commands/card.py`` wrote them (already inert: escaped there)."""
    return "\n".join(r["lines"])  # the card ends with its newline


def info(r: dict[str, Any]) -> str:
    ptm = r["ptm"]
    lines = [
        f"run {r['run_dir']} (generation {r['generation']}), "
        + (f"recipe {r['recipe']} (method {r['method']})" if r.get("recipe") else f"method {r['method']}"),
        f"PTM {ptm['name']} ({_ptm_source(ptm['source'], ptm.get('hub'))}, sha256 {ptm['sha256'][:12]}...), "
        f"input {ptm['data_config']['input_size']}",
        f"{r['num_stages']} stages, {r['num_classes']} classes, {r['total_bytes'] / 2**20:.2f} MiB "
        f"({r['base_bytes'] / 2**20:.2f} MiB before any stage)",
    ]
    track = r.get("frozen_track")
    if track:  # a switched run
        lines.append(
            # format 5: its files beside the run's (stages/NNN/frozen-*); format 4: under frozen/
            f"frozen track{'' if track['run_dir'] == r['run_dir'] else ' ' + track['run_dir']}: the frozen PTM "
            f"(`drl init --recipe frozen`), {track['num_stages']} stages, "
            f"{track['total_bytes'] / 2**20:.2f} MiB more"
            + {"frozen": "; the run answers from it", "carried": "; the run answers from the carried network"}.get(
                track.get("answers"), ""
            )
        )
    if r["stages"]:
        lines += growth_lines(r["stages"]) + history_lines(r["history"])
    return _text(lines + forgotten_lines(r["forgotten"]) + forget_history_lines(r.get("forget_history") or []))


def forget(r: dict[str, Any]) -> str:
    what = {"forget": "forgot", "purge": "purged what was kept of forgotten", "restore": "restored"}[r["action"]]
    lines = [
        f"{what} class {_quoted(r['class'])} (stage {r['stage']}) at {r['at']}"
        + (f" ({r['reason']})" if r["reason"] else "")
        + f"; run {r['run_dir']} is at generation {r['generation']}, answering with {r['num_classes']} classes"
    ]
    if r["action"] == "forget" and r["kept"]:
        restore = f"drl forget --restore {shlex.quote(r['class'])}"
        lines.append(f"its slices are kept: `{restore}` brings it back, --purge deletes them")
    elif r["action"] == "forget":
        lines.append("nothing of it was kept (--purge): it cannot be restored")
    if r["forgotten"]:
        lines.append("forgotten now: " + ", ".join(r["forgotten"]))
    return _text(lines)


def forgotten_lines(entries: list[dict[str, Any]]) -> list[str]:
    """``info``: the classes out of the answers, with when, why and whether they can come back."""
    return [
        f"forgotten: {_quoted(e['class'])} of stage {e['stage']} at {e['at']}"
        + (f" ({e['reason']})" if e["reason"] else "")
        + ("; restorable" if e["kept"] else "; purged")
        for e in entries
    ]


def forget_history_lines(events: list[dict[str, Any]]) -> list[str]:
    """``info``: every forget, purge and restore of the run's forget log, oldest first, with its reason."""
    if not events:
        return []
    return ["forget log:"] + [
        f"  {e['at']} {e['action']} {_quoted(e['class'])} of stage {e['stage']}"
        + (f" ({e['reason']})" if e.get("reason") else "")
        + f"; generation {e['generation']}"
        for e in events
    ]


def benchmark(r: dict[str, Any]) -> str:
    from ..benchmark import markdown_table

    lines = [
        f"{name}: {path if path else 'skipped (pip install drlcli[plot] for the plot)'}"
        for name, path in r["artifacts"].items()
    ]
    return markdown_table(r) + (_text(lines) if lines else "")


def demo(r: dict[str, Any]) -> str:
    lines = [
        f"stage {s['stage']}: +{s['classes']} classes, accuracy on all seen {s['accuracy']:.2f}% ({s['seconds']:.1f}s)"
        for s in r["stages"]
    ]
    lines += accuracy_lines(r["accuracy"]) + history_lines(r["history"])
    lines.append(f"data: {r['data_dir']}\nrun directory: {r['run_dir']}\nexported model: {r['export']['path']}")
    return _text(lines)
