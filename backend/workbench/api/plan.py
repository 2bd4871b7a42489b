"""``POST /api/plan``: predicted VRAM and step time of a preset on a device profile, before a
run starts (``plan``). Reads configs and safetensors headers only; no weights load
(SquareQ's quantization error comes from its cache when there, else "not measured")."""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from workbench.api.deps import CalibratorDep, StoreDep, run_row
from workbench.api.errors import Invalid, NotFound
from workbench.api.models import RunId
from workbench.api.openapi import errors
from workbench.contract.plan_inputs import DEVICE_PROFILES, OVERRIDES
from workbench.services.calibration import calibration_for, recovery_for
from workbench.services.torch_side import import_torch_side

router = APIRouter(prefix="/api", tags=["plan"])

_FIELD = re.compile(r"^([A-Za-z_][\w.]*): ")


def _override(name: str) -> Any:
    """The field of the profile override ``name``, bounded as ``workbench.contract.plan_inputs.OVERRIDES``
    says (finite: ``NaN``, which Python's JSON reads, is refused)."""
    low, high, why = OVERRIDES[name]
    return Field(default=None, ge=low, le=high, allow_inf_nan=False, description=why)


class PlanRequest(BaseModel):
    """A preset's JSON object (as the New run page composes it) and a device profile."""

    model_config = ConfigDict(extra="forbid")
    preset: dict[str, Any]
    device: str = Field(
        default="cpu", max_length=32, json_schema_extra={"enum": list(DEVICE_PROFILES)}
    )
    """``cpu`` (this machine: its stored profile, ``workbench.plan.profiles.stored_cpu_profile``)
    or a named profile: ``rtx3090``, ``rtx4090``, ``rtx5090``, ``h100`` (SXM5), ``h100-pcie``."""
    vram_gb: float | None = _override("vram_gb")
    """Override of the profile's VRAM (GiB)."""
    h2d_gbps: float | None = _override("h2d_gbps")
    tflops: float | None = _override("tflops")
    disk_gbps: float | None = _override("disk_gbps")
    """The storage rate of file reads (GB/s): blocks without a host-cache image are read from
    disk at it (the plan's ``transfers.source_mode`` says ``disk``), not from the page cache."""


@router.post("/plan")
def plan(body: PlanRequest, store: StoreDep) -> dict:
    """The plan (``plan.Plan.to_dict``): ``fits``, ``knob``, ``peak_bytes``,
    ``steady_band_bytes``, ``host``, ``step_ms``, ``transfers`` (H2D bytes and block loads per
    steady step, resident and streamed blocks, where the loads come from), ``bound_ms``, the
    VRAM ``curve`` of one steady step and ``quant_error`` (with SquareQ on: the error table
    read from SquareQ's cache, or ``measured`` false and a ``reason``; never quantized inside
    a request, ``workbench.plan.quant_error``).
    With calibrations of the device and the preset's family (finished runs' measured figures),
    the median of their ratios within bounds is applied and ``calibration`` says from which
    runs and which ratios were refused (``workbench.services.calibration.calibration_for``,
    ``workbench.plan.feedback.apply``; ``calibration.uncalibrated`` keeps the raw figures).
    When runs of the device and family ran out of memory and went on with lower limits, the
    preset's limits are capped at the lowest they went on with before it is planned, and
    ``recovery`` says which runs, what was capped and a ``note`` (``workbench.plan.recovery``, NOTE
    [ Limits a recovery taught ]).

    Raises:
        Invalid (422): a bad preset or device; ``field`` is the JSON path at fault
            (``preset.memory.stagehand.vram_high_watermark_mb``, ``device``).
    """
    import_torch_side()
    from workbench.plan import (  # lazy: the server starts without torch
        PlanInputError,
        plan_preset,
        profile,
    )
    from workbench.plan.feedback import apply, family_of  # lazy: the server starts without torch
    from workbench.plan.recovery import cap_limits, recovery_of  # lazy: as workbench.plan.feedback

    family = family_of(body.preset)
    learnt = recovery_for(store, body.device, family)
    preset, capped = cap_limits(body.preset, learnt) if learnt else (body.preset, {})
    try:
        vram = int(body.vram_gb * 2**30) if body.vram_gb else None
        dev = profile(
            body.device,
            vram_bytes=vram,
            h2d_gbps=body.h2d_gbps,
            tflops=body.tflops,
            disk_gbps=body.disk_gbps,
        )
        name = str(body.preset.get("name") or "(new run)")
        out = plan_preset(preset, dev, name=name).to_dict()
    except PlanInputError as exc:
        message = str(exc)
        match = _FIELD.match(message)
        field = match.group(1) if match else None
        if field is not None and field not in (
            "device",
            "h2d_gbps",
            "tflops",
            "vram_bytes",
            "disk_gbps",
        ):
            field = f"preset.{field}"
        raise Invalid(message, field=field) from None
    except (ValueError, TypeError, KeyError) as exc:
        # A preset that validates yet names what cannot be built (a factory size, a folder's
        # config): still the input's fault, never a server error.
        raise Invalid(f"preset: cannot plan it: {exc}", field="preset") from None
    if learnt:
        out["recovery"] = recovery_of(learnt, capped)
    calibration = calibration_for(store, body.device, family)
    return apply(out, calibration) if calibration else out


@router.get("/plan/cpu-profile")
def cpu_profile() -> dict:
    """Whether the next plan on ``cpu`` measures this machine first (``workbench.plan.profiles.
    cpu_profile_status``): ``will_measure``, ``measuring`` (a plan is measuring now),
    ``measurements`` stored of ``wanted`` and ``measure_s`` (seconds the last stored
    measurement took, null before the first). The New run page says so while such a plan runs.
    """
    from workbench.plan.profiles import cpu_profile_status  # lazy: the server starts without torch

    return cpu_profile_status()


@router.get("/runs/{run_id}/calibration", responses=errors(404))
def run_calibration(run_id: RunId, store: StoreDep, calibrator: CalibratorDep) -> dict:
    """A finished run's calibration: ``predicted`` and ``measured`` figures (MB, ms),
    ``ratios`` (measured / predicted), ``plan`` (its peaks, band, step times and VRAM curve of
    one steady step) and ``measured.curve`` (the weight runtime's allocated MB at each block
    record of the run's last step, ms from the first). A run without one is a 404 whose code
    says whether to ask again: ``calibration_pending`` while it is being computed,
    ``not_calibrated`` when there will be none, the message saying why (not succeeded, no plan
    profile for its device, limits changed while it ran, its plan failed, calibration off)."""
    run_row(store, run_id)
    found = store.get_calibration(run_id)
    if found is not None:
        return found
    code, message = calibrator.why_not(run_id) or ("not_found", f"no run with id {run_id}")
    raise NotFound(message, field="id", code=code)
