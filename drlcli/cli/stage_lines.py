"""A stage's decisions, for people: the first-session decision, a carried stage's carry and
forward transfer, and a switched run's answering track. Lines for ``learn-stage`` and ``info``
(``render``), from the JSON payload's records; each line without its newline."""

from __future__ import annotations

from typing import Any


def first_session_line(d: dict[str, Any]) -> str:
    """Stage 1's first-session decision (``schedule.decide``), for people."""
    scores = f"held-out top-1 {d['adapted_top1']:.2f} adapted, {d['frozen_top1']:.2f} frozen, on {d['held_out']} images"
    if d["kept"] == "adapted":
        return f"first session: the adapted PTM is kept ({scores})"
    return f"first session: the frozen PTM is kept, the adapters are not stored ({scores})"


def transfer_line(d: dict[str, Any]) -> str:
    """A carried stage's forward transfer (``metrics.Transfer``), for people."""
    if d["transfers"]:
        verdict = "adapting transfers to new classes here"
    elif d.get("stalls"):
        verdict = (
            f"adapting does not transfer to new classes here: even its upper bound, {d['ceiling']:+.1f} %, is under "
            f"the {d['floor']:g} % a switch needs (a switched run with schedule.pause transfer trains its carried network "
            "no further while that holds)"
        )
    else:
        verdict = (
            f"adapting does not transfer to new classes here yet (its upper bound is {d['ceiling']:+.1f} %; the "
            "frozen PTM (`drl init --recipe frozen`) may answer as well)"
        )
    so_far = f"run so far {d['gain']:+.1f} % of {d['run']['images']} images: {verdict}"
    if not d["images"]:  # metrics.measure: a stage of one class has nothing to tell apart
        return (
            f"forward transfer: not measured at this stage (it compares the stage's own classes; it has one); {so_far}"
        )
    return (
        f"forward transfer: of this stage's {d['images']} images (classes never trained on), the adapters as the "
        f"stage began got {d['better']} right that the frozen PTM missed and missed {d['worse']} it got; {so_far}"
    )


def switch_line(d: dict[str, Any], transfer: dict[str, Any] | None = None) -> str:
    """Which track a switched run answers from after a stage (``run/track.py``), for people;
    ``transfer``: the stage's forward transfer (``carry.transfer``), if it has one."""
    top1 = {k: "n/a" if v is None else f"{v:.2f}" for k, v in d["top1"].items()}
    if d["answers"] == "carried":
        why = ""
        if not isinstance(transfer, dict):  # a small drop answering by its own trial (``trial_answers_small_stage``)
            why = ": its trial widened the margins of classes the set never trained on, on a drop of few images a class"
        elif not transfer.get("transfers"):
            why = (
                ": a trial widened the margins of classes the set never trained on, and the counts do not say it loses"
            )
        return f"the run answers from the carried network (top-1 {top1['carried']}; its frozen track {top1['frozen']}){why}"
    return (
        f"the run answers from its frozen track, the frozen PTM (`drl init --recipe frozen`; top-1 {top1['frozen']}; the "
        f"carried network {top1['carried']}), until adapting transfers to new classes"
    )


def carry_lines(c: dict[str, Any]) -> list[str]:
    """A carried run's stage after the first (learn-stage's ``carry``): how it carried the earlier
    classes, and its forward transfer; stage 1's trial, where the run tried adapting first."""
    if isinstance(c.get("trial"), dict):
        return [trial_line(c["trial"])]
    if c.get("paused"):
        sums = (
            f"drawn {c['draws']} times per image from their class Gaussians{_sums_how(c)}"
            if c.get("draws")
            else "the sums the stage before kept"
        )
        why = ""
        if isinstance(c.get("transfer"), dict) and c["transfer"]["run"]["images"] and not c["transfer"]["stalls"]:
            why = " (a stage of too few classes to train on: schedule.train_min_classes)"
        lines = [
            f"carried {c['classes']} earlier classes as they stood{why}: the adapters did not move, nor did their "
            f"class Gaussians; the head read {sums} ({c['seconds']:.1f}s)"
        ]
    else:
        lines = [
            f"carried {c['classes']} earlier classes: the adapters moved this stage's images by {c['move']:.2g} "
            f"(relative squared); their class Gaussians moved with them and drawn {c['draws']} times per image"
            f"{_sums_how(c)} ({c['seconds']:.1f}s)"
            + ("; the unknown answer's class means moved with them" if "unknown_move" in c else "")
        ]
    counted = c.get("transfer") and c["transfer"]["run"]["images"]  # an untrained set's stage counts none
    return lines + ([transfer_line(c["transfer"])] if counted else [])


def trial_line(t: dict[str, Any]) -> str:
    """A stage's trial (``schedule.trial``), for people."""
    if t.get("deferred"):
        return (
            f"did not try adapting: {t['classes_measured']} classes are too few to try on (a trial trains on two "
            "and measures two others); the adapters stay untrained (the frozen PTM), at the frozen head's cost, "
            "and the next stage is tried"
        )
    m = t["margins"]
    then = (
        "adapting changes little here: the stage kept the adapters untrained (the frozen PTM), at about the "
        "frozen head's cost"
        if not t["trains"]
        else "adapting moves these features: the stage trained the adapters on all its classes"
    )
    return (
        f"tried adapting first ({t['seconds']:.1f}s): {t['epochs']} epochs on {t['images_trained']} images of "
        f"{t['classes_trained']} classes moved the margins of {m['images']} images of the other "
        f"{t['classes_measured']} by {m['percent']:+.2f} % (z {m['z']:.1f}; it trains from {m['floor']:g} % either "
        f"way, |z| 1.6); {then}"
    )


def cost_line(p: dict[str, Any]) -> str:
    """What a stage's learning cost (stage.json ``metrics.passes``), for people."""
    parts = [f"training {p['training']:g}"] if p.get("training") else []
    parts.append(f"feature passes {p['features']:g}")
    if p.get("trial"):
        parts.append(f"the trial {p['trial']:g}")
    return f"cost: {p['per_image']:g} forward pass{'' if p['per_image'] == 1 else 'es'} an image ({', '.join(parts)})"


def _sums_how(carry: dict) -> str:
    """How a carried stage rebuilt the earlier classes' sums (the ridge head's ``carry_mean exact``), for its line."""
    if carry.get("mean") != "exact":
        return ""
    cap = carry.get("gram_draws")
    split = ", split between the fit and held-out parts" if carry.get("grams") == "split" else ""
    return " (their means in closed form" + (f", the Grams from at most {cap:,} draws" if cap else "") + split + ")"
