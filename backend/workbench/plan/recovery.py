"""Limits learnt from out-of-memory recoveries: a run whose card ran out of memory and that went
on with lower limits (its ``trainer/oom_recovery`` records, docs/contracts.md) tells later plans
of its device and family where the limits held.

``learnt_limits`` takes, per live limit, the lowest value the newest ``RECOVERY_RUNS`` such runs
lowered it to; ``cap_limits`` caps a preset's limits there before it is planned; the plan's
``recovery`` (``recovery_of``) says which run taught it and what was capped. The server finds the
runs (``workbench.services.calibration.recovery_for``), as it finds calibrations
(``backend/workbench/plan/feedback.py``): keyed by the device profile the run ran on and its family.

NOTE [ Limits a recovery taught ]
A recovery's ``limits_after`` are limits under which the run went on after the card ran out of
memory at its ``limits_before``: a later plan of the same family on the same card that starts
above them starts where that run failed. So each limit a plan's preset sets above the lowest
``limits_after`` seen, or leaves to the runtime (``"auto"``, null, absent: the failed run's own
were resolved the same way), is capped there; a limit the preset sets lower is kept. A low
watermark left above its capped high one is lowered to it (the watermark rule). The plan says
which run taught it and what was capped (``recovery_note``): the user sees why the limits are
not the preset's, and may raise them again in the config's JSON.
"""

from __future__ import annotations

import copy
from typing import Any

from stagehand.config.limits import ACTIVATION_FIELDS, AS, AUTO, PAIRS, PATHS, SH

RECOVERY_RUNS = 5
"""Newest runs of a device and family with out-of-memory recoveries a plan learns limits from."""
RECOVERY_FIELDS = ("step", "phase", "attempt", "failure_bytes", "card_bytes")
"""What a plan's ``recovery`` keeps of each ``trainer/oom_recovery`` record."""


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def learnt_limits(
    device: str, family: str, runs: list[tuple[int, list[dict[str, Any]]]]
) -> dict[str, Any] | None:
    """What plans of ``device`` and ``family`` learn from runs that ran out of memory and went
    on with lower limits. ``runs``: ``(run_id, [trainer/oom_recovery record, ...])``, newest
    first; the first ``RECOVERY_RUNS`` are used. Per live limit (``stagehand.config.limits.PATHS``; MB
    for watermarks, counts for the others), the lowest number a record's ``limits_after`` gives.

    Returns ``{device, family, run_ids, limits: {field: value}, taught_by: {field: run_id},
    recoveries: [{run_id, step, phase, attempt, failure_bytes, card_bytes}]}`` (``run_ids``
    newest first), or None when no record gives a limit (NOTE [ Limits a recovery taught ]).
    """
    limits: dict[str, float] = {}
    taught_by: dict[str, int] = {}
    recoveries: list[dict[str, Any]] = []
    for run_id, records in runs[:RECOVERY_RUNS]:
        for rec in records:
            after = rec.get("limits_after")
            if not isinstance(after, dict):
                continue
            for field, value in after.items():
                if field in PATHS and _number(value) and value < limits.get(field, float("inf")):
                    limits[field] = value
                    taught_by[field] = run_id
            recoveries.append({"run_id": run_id, **{k: rec.get(k) for k in RECOVERY_FIELDS}})
    if not limits:
        return None
    run_ids = list(dict.fromkeys(r["run_id"] for r in recoveries))
    return {
        "device": device,
        "family": family,
        "run_ids": run_ids,
        "limits": limits,
        "taught_by": taught_by,
        "recoveries": recoveries,
    }


def _limit_sections(preset: dict[str, Any]) -> dict[str, tuple[dict[str, Any], str]]:
    """Live limit -> (the preset's section dict holding it, its key there), for the runtimes the
    preset turns on (``workbench.services.limits.config_limits`` reads the same ones)."""
    memory = preset.get("memory")
    if not isinstance(memory, dict) or memory.get("strategy", "stagehand") != "stagehand":
        return {}
    section = memory.get(SH.split(".")[-1])
    if not isinstance(section, dict):
        return {}
    out: dict[str, tuple[dict[str, Any], str]] = {}
    if section.get("weight_streaming", True) is not False:
        out.update(
            {f: (section, PATHS[f].rsplit(".", 1)[1]) for f in PATHS if f not in ACTIVATION_FIELDS}
        )
    act = section.get(AS.split(".")[-1])
    if isinstance(act, dict) and act.get("enabled", True) is not False:
        out.update({f: (act, key) for f, key in ACTIVATION_FIELDS.items()})
    return out


def cap_limits(
    preset: dict[str, Any], learnt: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """``preset`` (a preset's JSON object, not changed) with its live limits capped at
        ``learnt["limits"]`` (``learnt_limits``): a limit above its cap, ``"auto"``, null or absent
        becomes the cap; a low watermark then above its high one becomes the high one. Only the
        runtimes the preset turns on are touched. Returns the capped copy and ``{field: [before,
        after]}`` of the limits changed (before: the preset's value, None when absent: the runtime's
    default). NOTE [ Limits
        a recovery taught ]."""
    out = copy.deepcopy(preset)
    sections = _limit_sections(out)
    changed: dict[str, list[Any]] = {}
    for field, cap in learnt["limits"].items():
        if field not in sections:
            continue
        section, key = sections[field]
        value = section.get(key)
        if value is None or value == AUTO or (_number(value) and value > cap):
            section[key] = cap
            changed[field] = [value, cap]
    for high, low in PAIRS:
        if high in sections and low in sections:
            (hs, hk), (ls, lk) = sections[high], sections[low]
            top, bottom = hs.get(hk), ls.get(lk)
            if _number(top) and _number(bottom) and bottom > top:
                changed[low] = [changed.get(low, [bottom])[0], top]
                ls[lk] = top
    return out, changed


def _shown(value: object) -> str:
    """A limit as the note prints it: ``default`` for an absent one, a whole float as an int."""
    if value is None:
        return "default"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def recovery_note(learnt: dict[str, Any], capped: dict[str, list[Any]]) -> str:
    """One line: ``a past run (#12) ran out of memory on rtx4090/flux (at step 3, backward);
    limits capped at what it went on with: vram_high_watermark_mb 40000 → 22000``."""
    ids = learnt["run_ids"]
    where = f"{learnt['device']}/{learnt['family']}"
    several = len(ids) > 1
    at = "; ".join(
        (f"#{r['run_id']} " if several else "") + f"at step {r['step']}, {r['phase']}"
        for r in learnt["recoveries"]
    )
    runs = ", ".join(f"#{i}" for i in ids)
    who = f"past runs ({runs})" if several else f"a past run ({runs})"
    line = f"{who} ran out of memory on {where} ({at}); "
    if capped:
        shown = ", ".join(f"{f} {_shown(a)} → {_shown(b)}" for f, (a, b) in capped.items())
        what = "the lowest they" if several else "what it"
        return line + f"limits capped at {what} went on with: {shown}"
    held = ", ".join(f"{f} {_shown(v)}" for f, v in learnt["limits"].items())
    return line + f"this config's limits are at or below what it went on with ({held})"


def recovery_of(learnt: dict[str, Any], capped: dict[str, list[Any]]) -> dict[str, Any]:
    """A plan's ``recovery``: ``learnt`` (``learnt_limits``), the limits ``capped`` ({field:
    [before, after]}) and the ``note`` saying so (``recovery_note``)."""
    return {**learnt, "capped": capped, "note": recovery_note(learnt, capped)}
