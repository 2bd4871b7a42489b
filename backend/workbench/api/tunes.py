"""Tunes: the planner's candidates of limits within a VRAM budget, each run as a short trial
through the ordinary run queue (``backend/workbench/plan/tune.py``). One tune is one group: its trials are
runs with ``group_id`` = the tune's id (the runs list, Compare and the executors handle them as
any run), cancelled together, and a chosen trial's limits are saved as a new preset."""

from __future__ import annotations

import re
import sqlite3
from typing import Any

from fastapi import APIRouter, status

from stagehand.config.memory import AUTO_DEVICE
from stagehand.config.records import WEIGHTS_STEP
from workbench.api.assets import check_run_assets
from workbench.api.deps import AssetsDep, SettingsDep, StoreDep, SupervisorDep
from workbench.api.errors import Conflict, Invalid, NotFound
from workbench.api.models import TuneCreate, TuneId, TunePreset
from workbench.api.openapi import errors
from workbench.contract.preset.merge import merge_overrides
from workbench.contract.status import ACTIVE, RunStatus
from workbench.services.calibration import calibration_for
from workbench.services.presets import run_config, validate_config
from workbench.services.run_files import write_run_config
from workbench.services.torch_side import import_torch_side
from workbench.store import Store

router = APIRouter(prefix="/api/tunes", tags=["tunes"])

_FIELD = re.compile(r"^([A-Za-z_][\w.]*): ")


def _propose(body: TuneCreate, config: dict[str, Any], store: Store) -> dict[str, Any]:
    """The planner's trials; its input errors as 422 naming the field."""
    import_torch_side()
    from workbench.plan import PlanInputError, profile  # lazy: the server starts without torch
    from workbench.plan.feedback import family_of  # lazy: the server starts without torch
    from workbench.plan.tune import propose  # lazy: the server starts without torch

    try:
        dev = profile(body.device)
        found = calibration_for(store, body.device, family_of(config))
        ratios = found["ratios"] if found else None
        out = propose(config, dev, body.budget_mb, max_trials=body.max_trials, ratios=ratios)
    except PlanInputError as exc:
        match = _FIELD.match(str(exc))
        field = match.group(1) if match else None
        if field is not None and field not in ("device", "budget_mb"):
            field = f"preset.{field}"
        raise Invalid(str(exc), field=field) from None
    out["calibration_run_ids"] = found["run_ids"] if found else []
    return out


def _trial_figures(store: Store, run: dict[str, Any]) -> dict[str, Any] | None:
    """A trial's measured peak (MB, the training stage's), mean step time past its trace step
    (ms) and blocks loaded in its last step; None until it succeeded."""
    if run["status"] != "succeeded":
        return None
    summary = run["summary"] or {}
    weights = store.last_record(run["id"], *WEIGHTS_STEP) or {}
    return {
        "peak_mb": summary.get("peak_vram_mb"),
        "step_ms": store.mean_step_ms_after(run["id"], 1),
        "blocks_loaded": weights.get("blocks_loaded"),  # in its last step
    }


def tune_public(store: Store, tune: dict[str, Any]) -> dict[str, Any]:
    """The tune with its trials (run, status, limits, predicted and measured figures) and the
    measured Pareto front (step time against peak, both lower is better) marked."""
    from workbench.plan.tune import limits_text, pareto  # lazy: the server starts without torch

    runs = {r["id"]: r for r in store.list_runs(group_id=tune["id"])}
    trials = []
    for t in tune["candidates"]["trials"]:
        run = runs.get(t.get("run_id"))
        measured = _trial_figures(store, run) if run else None
        trials.append(
            {
                **{k: t[k] for k in ("label", "preset", "limits", "memory", "predicted")},
                "limits_text": limits_text(t["limits"]),
                "predicted_pareto": t.get("predicted_pareto", False),
                "run_id": t.get("run_id"),
                "status": run["status"] if run else "deleted",
                "measured": measured,
                "pareto": False,
                "fits": None,
            }
        )
    done = [
        t
        for t in trials
        if t["measured"] and None not in (t["measured"]["peak_mb"], t["measured"]["step_ms"])
    ]
    marks = pareto([(t["measured"]["step_ms"], t["measured"]["peak_mb"]) for t in done])
    for t, on in zip(done, marks, strict=True):
        t["pareto"] = on
        t["fits"] = t["measured"]["peak_mb"] <= tune["budget_mb"]
    fit = [t for t in done if t["fits"]]
    best = min(fit, key=lambda t: t["measured"]["step_ms"]) if fit else None
    meta = tune["candidates"]
    return {
        "id": tune["id"],
        "preset": tune["preset"],
        "budget_mb": tune["budget_mb"],
        "device": tune["device"],
        "trial_steps": tune["trial_steps"],
        "created_at": tune["created_at"],
        "min_peak_mb": meta["min_peak_mb"],
        "searched": meta["searched"],
        "feasible": meta["feasible"],
        "distinct": meta.get("distinct"),  # None in a tune stored before
        "not_tuned": meta["not_tuned"],
        "calibration_run_ids": _calibration_runs(meta),
        "trials": trials,
        "best_run_id": best["run_id"] if best else None,
        "active": sum(1 for r in runs.values() if r["status"] in (*ACTIVE, RunStatus.QUEUED)),
    }


def _calibration_runs(meta: dict[str, Any]) -> list[int]:
    """The runs whose ratios scaled the tune's predictions (one ``calibration_run_id`` in a
    tune stored before plans took the median of several runs)."""
    if "calibration_run_ids" in meta:
        return meta["calibration_run_ids"]
    return [meta["calibration_run_id"]] if meta.get("calibration_run_id") else []


def _tune(store: Store, tune_id: int) -> dict[str, Any]:
    tune = store.get_tune(tune_id)
    if tune is None:
        raise NotFound(f"no tune with id {tune_id}", field="id")
    return tune


@router.post("", status_code=status.HTTP_201_CREATED, responses=errors(404, 409))
def create_tune(
    body: TuneCreate,
    store: StoreDep,
    supervisor: SupervisorDep,
    settings: SettingsDep,
    assets: AssetsDep,
) -> dict:
    """Plan the candidates and queue one trial run per candidate, all in one group.

    Raises:
        NotFound (404): no such preset (``field: "preset"``).
        Conflict (409): the preset's demo assets are not built yet (``assets_not_ready``).
        Invalid (422): a budget below the smallest feasible plan (``field: "budget_mb"``, the
            message giving that minimum), an unknown device (``device``), a preset the planner
            cannot model (``preset.<path>``).
    """
    from workbench.plan.tune import trial_overrides  # lazy: the server starts without torch

    base = run_config(store, body.preset, body.overrides)
    check_run_assets(assets, base)
    proposal = _propose(body, base, store)
    proposal["base_config"] = base
    # Every trial's config validated before anything is stored: a tune is queued whole or not.
    configs = [
        run_config(
            store,
            body.preset,
            merge_overrides(body.overrides, trial_overrides(base, t["memory"], body.trial_steps)),
        )
        for t in proposal["trials"]
    ]
    tune_id = store.create_tune(
        body.preset, body.budget_mb, proposal["device"], body.trial_steps, proposal
    )
    for trial, config in zip(proposal["trials"], configs, strict=True):
        name = f"tune{tune_id}-{trial['label']}"
        run_id = store.create_run(name, body.preset, config, AUTO_DEVICE, group_id=tune_id)
        write_run_config(settings.runs_dir / str(run_id), config)
        trial["run_id"] = run_id
    store.set_tune_candidates(tune_id, proposal)
    supervisor.wake()
    return tune_public(store, _tune(store, tune_id))


@router.get("")
def list_tunes(store: StoreDep) -> dict:
    data = [tune_public(store, t) for t in store.list_tunes()]
    return {"data": data, "count": len(data)}


@router.get("/{tune_id}", responses=errors(404))
def get_tune(tune_id: TuneId, store: StoreDep) -> dict:
    """The tune, its trials (``run_id``, ``status``, ``limits`` and their one line
    ``limits_text``, ``predicted`` and, once a trial succeeded, ``measured``: peak MB and mean
    step ms past the trace step), which trials are on the measured Pareto front (``pareto``)
    and the fastest within the budget (``best_run_id``)."""
    return tune_public(store, _tune(store, tune_id))


@router.post("/{tune_id}/cancel", responses=errors(404))
def cancel_tune(tune_id: TuneId, store: StoreDep, supervisor: SupervisorDep) -> dict:
    """Cancel every queued or running trial of the tune (the ended ones stay as they are)."""
    _tune(store, tune_id)
    for run in store.list_runs(group_id=tune_id):
        if run["status"] in (*ACTIVE, RunStatus.QUEUED):
            try:
                supervisor.cancel(run["id"])
            except Conflict:
                pass  # ended between the read and the cancel
    return tune_public(store, _tune(store, tune_id))


@router.post("/{tune_id}/preset", status_code=status.HTTP_201_CREATED, responses=errors(404, 409))
def save_preset(tune_id: TuneId, body: TunePreset, store: StoreDep) -> dict:
    """Save the preset the tune started from with a trial's limits (its memory changes only:
    not the trial's step count) as the new preset ``name``; 409 when the name is taken, 422
    (``run_id``) when the run is not a trial of this tune."""
    tune = _tune(store, tune_id)
    trial = next((t for t in tune["candidates"]["trials"] if t.get("run_id") == body.run_id), None)
    if trial is None:
        raise Invalid(f"run {body.run_id} is not a trial of tune {tune_id}", field="run_id")
    base = tune["candidates"]["base_config"]
    config = validate_config(merge_overrides(base, {"memory": trial["memory"]}), "config")
    config["name"] = body.name
    from workbench.plan.tune import limits_text  # lazy: the server starts without torch

    description = (
        f"{tune['preset']} tuned by tune #{tune_id} within {tune['budget_mb']:g} MB on "
        f"{tune['device']} (trial run #{body.run_id}: {limits_text(trial['limits'])})"
    )
    try:
        store.insert_preset(body.name, config, description)
    except sqlite3.IntegrityError:
        raise Conflict(f"a preset named {body.name!r} exists", field="name") from None
    return {"name": body.name, "description": description, "config": config, "run_id": body.run_id}
