"""The model card of a run: Markdown in the Hugging Face model-card convention (a YAML front matter
with ``library_name``, ``tags``, ``pipeline_tag`` and ``model-index``, then sections), built from the
run's records alone (run.yaml, the stages' stage.json, the forget log, the manifest). ``drl export``
writes it beside every file it writes (``FILE.md``, with that file's format and sha256); ``drl info
--card`` gives it for the run itself.

Every value that comes from data (class names, folder names, a forget's reason, the run's name) is
escaped: control, bidi and separator characters as their Python escapes (what ``cli/output.printable``
does for the terminal), then, in the body, ``&``, ``<``, ``>`` as HTML entities and every other ASCII
punctuation character backslash-escaped (CommonMark), so a name can neither inject markup, HTML or a
table cell, nor end a line; the front matter is written by a YAML dumper, one line per value."""

from __future__ import annotations

import re
import string
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from ..config import RunConfig, closest_recipe, differing
from ..errors import StorageError
from ..methods import schedule_of
from ..recipes import BY_NAME, DEFAULT
from ..run.directory import RunDir
from ..run.forgotten import ForgetLog, read_log
from ..run.records import checked_metas, history_of, read_record, recorded_recipe, switch_record
from ..storage import write_atomic
from ..version import __version__

CARD_SUFFIX = ".md"  # the card of an export: the file's name + ".md" (model.drl -> model.drl.md)

# as cli/output.py's _UNSAFE: C0/C1 controls, DEL, bidi controls, line/paragraph separators, lone surrogates
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
_MARKUP = {c: _ENTITIES.get(c, "\\" + c) for c in string.punctuation}
_TIME = re.compile(r"[0-9][0-9T:.+-]{0,40}Z?")
HEADS = {"frozen": "the frozen PTM's head", "carried": "the adapted network's head"}


@dataclass(frozen=True)
class ExportFacts:
    """The exported file a card describes: its name (not its path: a card travels with the file)."""

    name: str
    format: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class CardFacts:
    """What a card says, as one generation of the run records it."""

    name: str  # the run's folder name
    generation: int
    committed: str | None  # the manifest's commit time (the newest commit)
    record: dict[str, Any]  # run.yaml
    config: RunConfig
    indices: list[int]
    metas: list[dict[str, Any]]
    forgotten: ForgetLog


@dataclass(frozen=True)
class CardResult:
    """``drl info --card``: the card's text (``card``) and its lines (what the text renderer prints)."""

    run_dir: str
    generation: int
    card: str

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "lines": self.card.split("\n")}


def plain(text: object) -> str:
    """``text`` on one line, every control, bidi or separator character written as its Python escape."""
    return _UNSAFE.sub(lambda m: _NAMED.get(m.group()) or _code(m.group()), str(text))


def _code(char: str) -> str:
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def md(text: object) -> str:
    """``text`` as inert Markdown: ``plain``, then ``&<>`` as entities and other ASCII punctuation escaped."""
    return "".join(_MARKUP.get(c, c) for c in plain(text))


def read_facts(run_dir: Path | str | RunDir) -> CardFacts:
    """The records a card is built from, all of one generation (``RunDir.read_generation``)."""
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    return run.read_generation(lambda manifest: _facts(run, manifest))


def _facts(run: RunDir, manifest: dict[str, Any]) -> CardFacts:
    record, config = read_record(run, manifest)
    metas = checked_metas(run, manifest)
    indices = list(run.stage_indices(manifest))
    forgotten = read_log(run, manifest, dict(zip(indices, metas)))
    committed = manifest.get("committed")
    return CardFacts(
        name=Path(run.path).resolve().name or "run",
        generation=manifest["generation"],
        committed=committed if isinstance(committed, str) else None,
        record=record,
        config=config,
        indices=indices,
        metas=metas,
        forgotten=forgotten,
    )


def model_card(run_dir: Path | str | RunDir) -> CardResult:
    """``drl info --card``: the run's card (no export section's file)."""
    facts = read_facts(run := run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir))
    return CardResult(str(run.path), facts.generation, card_text(facts))


def write_card(out_path: Path, text: str) -> Path:
    """Write the card of the export at ``out_path`` beside it, ``FILE.md`` (atomically; an existing card
    is replaced, as the export itself is); returns its path."""
    path = Path(str(out_path) + CARD_SUFFIX)
    try:
        write_atomic(path, text.encode())
    except OSError as exc:
        raise StorageError(
            f"cannot write the model card {path}: {exc.strerror or exc}; free space or pick another --out"
        ) from exc
    return path


def card_text(facts: CardFacts, export: ExportFacts | None = None) -> str:
    """The whole card: front matter, then the sections, the export's last."""
    sections = [
        [f"# {md(facts.name)}", "", _summary(facts)],
        _ptm_section(facts.record["ptm"]),
        _recipe_section(facts),
        _stages_section(facts),
        _classes_section(facts),
        _forgotten_section(facts.forgotten),
        _export_section(export),
    ]
    body = "\n\n".join("\n".join(lines) for lines in sections)
    return f"---\n{front_matter(facts)}---\n\n{body}\n"


def front_matter(facts: CardFacts) -> str:
    """The YAML between the card's ``---`` lines: every value on one line (``plain``), quoted as YAML needs."""
    data: dict[str, Any] = {
        "library_name": "drlcli",
        "tags": ["image-classification", "class-incremental"],
        "pipeline_tag": "image-classification",
    }
    hub = facts.record["ptm"].get("hub")
    if facts.record["ptm"]["source"] == "hf-hub" and isinstance(hub, dict):
        data["base_model"] = hub["repo"]
    data["model-index"] = [{"name": plain(facts.name), "results": _results(facts)}]
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=False, width=2**30, default_flow_style=False)
    if any(line.rstrip() in ("---", "...") for line in text.splitlines()):  # cannot happen: values are one line
        raise AssertionError("the card's front matter would end early")
    return text


def _results(facts: CardFacts) -> list[dict[str, Any]]:
    """model-index results: one per evaluated stage, its top-1 as stage.json recorded it."""
    results = []
    for index, meta in zip(facts.indices, facts.metas):
        evaluation = meta["metrics"].get("eval")
        if not evaluation:
            continue
        results.append(
            {
                "task": {"type": "image-classification", "name": "Image Classification"},
                "dataset": {"type": "imagefolder", "name": plain(_eval_name(index, meta))},
                "metrics": [
                    {
                        "type": "accuracy",
                        "name": f"top-1 accuracy (%) after stage {index}, on every class seen so far",
                        "value": float(evaluation["top1"]),
                    }
                ],
            }
        )
    return results


def _eval_name(index: int, meta: dict[str, Any]) -> str:
    """The stage's registered evaluation folder's name (``learn-stage --eval-data``), else "stage N evaluation"."""
    entry = meta.get("eval_data")
    if isinstance(entry, dict) and "held_out" in entry:  # learn-stage --eval-fraction: no folder
        return f"stage {index} evaluation (held out of its drop)"
    path = entry.get("path") if isinstance(entry, dict) else None
    name = PurePosixPath(path.replace("\\", "/")).name if isinstance(path, str) else ""
    return name if name and name not in (".", "..") else f"stage {index} evaluation"


def _summary(facts: CardFacts) -> str:
    answered = sum(len(facts.forgotten.active(meta)) for meta in facts.metas)
    return (
        f"A class-incremental image classifier written by drl (`drlcli`): a frozen pre-trained Vision "
        f"Transformer (the PTM) and what {len(facts.metas)} stages of new classes taught it; it answers "
        f"{answered} classes in one pass of the PTM. This card is built from the run's records alone "
        f"(generation {facts.generation}) by drl {__version__}."
    )


def _ptm_section(ptm: dict[str, Any]) -> list[str]:
    hub = ptm.get("hub") if isinstance(ptm.get("hub"), dict) else None
    sources = {
        "random": ("randomly initialised (`drl init --random-init`): no pre-trained weights", "none: random weights"),
        "file": ("a local weights file (`drl init --ptm-weights`), checked by its sha256", None),
        "hub": ("timm's pretrained weights for this name, downloaded by timm", None),
    }
    source, licence = sources.get(ptm["source"], (md(ptm["source"]), None))
    licence = licence or "see the PTM's model card; drl does not record it"
    if hub is not None:
        link = f"[{md(hub['repo'])}](https://huggingface.co/{hub['repo']})"
        source = f"the Hugging Face Hub repo {link} at commit {md(hub['revision'])}"
        licence = f"see {link}'s model card; drl does not record it"
    return [
        "## Pre-trained model (PTM)",
        "",
        f"- Name: {md(ptm['name'])}",
        f"- Weights sha256: {md(ptm['sha256'])}",
        f"- Source: {source}",
        f"- Licence of the weights: {licence}",
    ]


def _recipe_section(facts: CardFacts) -> list[str]:
    config = facts.config
    recorded = recorded_recipe(facts.record)
    if recorded is not None and BY_NAME[recorded].method == config.method:
        recipe, differ = BY_NAME[recorded], differing(config, RunConfig.for_recipe(recorded))
    else:  # a run of an earlier release, or a record no recipe of its method has
        recipe, differ = closest_recipe(config)
    lines = [
        "## Recipe",
        "",
        f"- Recipe: {_recipe_line(recipe.name, differ)}",
        *(
            [f"- Features: {recipe.features}; schedule: {recipe.schedule}; head: {recipe.head}"]
            if recipe.features
            else []
        ),
        f"- Method (as run.yaml stores it): {md(config.method)}",
    ]
    return lines + _answers_lines(facts, schedule_of(config).switches)


def _answers_lines(facts: CardFacts, switched: bool) -> list[str]:
    """Which head answers (a switched run: as its newest stage recorded, ``run.load.answering_head``)."""
    switches = [switch_record(meta) for meta in facts.metas]
    if not switched:
        return [f"- Answers from one head: {md(_head(facts.config))} (`score.head`)"]
    if not switches or switches[-1] is None:
        return ["- Answers from: no head recorded yet (a switched run records it with each stage)"]
    lines = [
        f"- Answers from {HEADS[switches[-1]['answers']]} (recorded by its newest stage, {facts.indices[-1]}: "
        "a switched run answers from the frozen PTM's head until adapting the PTM pays)"
    ]
    for index, switch in zip(facts.indices, switches):
        if switch is not None:
            top1 = ", ".join(f"{k} {_pct(v)}" for k, v in switch["top1"].items())
            lines.append(f"  - after stage {index}: {HEADS[switch['answers']]}; top-1 (%) {top1}")
    return lines


def _recipe_line(name: str, differ: list[str]) -> str:
    shipped = f"`{name}`" + (
        " (drl's default)" if name == DEFAULT else ""
    )  # a name of the table's, never the run's bytes
    if not differ:
        return f"{shipped}, as shipped (the run records its options, which are this recipe's)"
    more = ", ..." if len(differ) > 12 else ""
    return f"{shipped}, with {len(differ)} options set otherwise: {', '.join(md(k) for k in differ[:12])}{more}"


def _head(config: RunConfig) -> str:
    score = config.to_dict().get("score")
    return str(score.get("head")) if isinstance(score, dict) else "the method's"


def _when(value: object) -> str:
    """A recorded time (ISO 8601) as written; anything else escaped (a crafted record), or "an unrecorded time"."""
    if not isinstance(value, str):
        return "an unrecorded time"
    return value if _TIME.fullmatch(value) else md(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _stages_section(facts: CardFacts) -> list[str]:
    """Per stage: what it learned and the accuracy it measured (stage.json ``metrics.eval``)."""
    lines = [
        "## Stages and accuracy",
        "",
        "Each stage's accuracy was measured when it was learned, on the evaluation images of every class "
        "seen so far (its own `--eval-data` and every earlier stage's registered one).",
        "",
        "| stage | new classes | training images | evaluation data | evaluation images | top-1 (%) | top-5 (%) |",
        "|---:|---:|---:|---|---:|---:|---:|",
    ]
    for index, meta in zip(facts.indices, facts.metas):
        evaluation = meta["metrics"].get("eval") or {}
        data = md(_eval_name(index, meta)) if evaluation else "none"
        lines.append(
            f"| {index} | {len(meta['classes'])} | {sum(meta['images_per_class'].values())} | {data} | "
            f"{evaluation.get('num_images', '-')} | {_pct(evaluation.get('top1'))} | {_pct(evaluation.get('top5'))} |"
        )
    history = history_of(facts.metas)
    lines += [
        "",
        f"Average accuracy over the stages (Ā): {_pct(history.average)}; after the last stage (A\\_T): "
        f"{_pct(history.last)}; mean forgetting: {_pct(history.mean_forgetting)}.",
    ]
    return lines


def _classes_section(facts: CardFacts) -> list[str]:
    created = facts.record.get("created")
    lines = [
        "## Classes",
        "",
        "The run records the order of its stages, not when each was learned: it was created at "
        f"{_when(created)}, and its newest commit (generation {facts.generation}) is of {_when(facts.committed)}.",
        "",
        "| class | stage | answered |",
        "|---|---:|---|",
    ]
    for index, meta in zip(facts.indices, facts.metas):
        gone = set(facts.forgotten.of_stage(index))
        lines += [
            f"| {md(name)} | {index} | {'no: forgotten' if name in gone else 'yes'} |" for name in meta["classes"]
        ]
    return lines


def _forgotten_section(log: ForgetLog) -> list[str]:
    lines = ["## Forgotten classes", ""]
    if not log.forgotten:
        return [*lines, "None: the model answers every class it learned."]
    lines += [
        "Out of every answer (`drl forget`). What their images left in shared statistics and trained "
        "networks stays in the model.",
        "",
        "| class | stage | forgotten at (UTC) | reason | kept for `--restore` |",
        "|---|---:|---|---|---|",
    ]
    for entry in log.forgotten:
        reason = md(entry.reason) if entry.reason else "-"
        lines.append(
            f"| {md(entry.name)} | {entry.stage} | {_when(entry.at)} | {reason} | {'yes' if entry.kept else 'no'} |"
        )
    return lines


def _export_section(export: ExportFacts | None) -> list[str]:
    lines = ["## Export", ""]
    if export is None:
        return [
            *lines,
            "None: this card describes the run (`drl info --card`). `drl export` writes a card beside each "
            "file it writes, with that file's format and sha256.",
        ]
    return [
        *lines,
        f"- File: {md(export.name)} ({export.bytes} bytes), written by drl {__version__}",
        f"- Format: {md(export.format)}",
        f"- sha256: {export.sha256}",
        "",
        "Serving and predicting from it: drl's docs/serving.md.",
    ]
