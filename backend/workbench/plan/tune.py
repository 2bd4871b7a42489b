"""``tune``: candidates of limits the plan predicts fit a VRAM budget, to be run as trials.

``propose`` builds the preset's transformer on ``meta`` once (``inventory``) and simulates a
grid of the knobs a user turns (``simulate``, about a millisecond each): the weight runtime's
high watermark at fractions of the budget, its low one one or two of the largest blocks below,
the prefetch window, the in-flight transfer cap (a GPU's; on a CPU device copies are synchronous
and the cap changes nothing), and, where the preset spills activations, the spill watermarks
at fractions of the weight watermark. The candidates whose predicted peak fits the budget form a
predicted Pareto front (step time against peak); the trials are the fastest on it, spread along
it, and the preset's own limits when they fit (the reference a tune has to beat), first and
again last (the load of a shared machine drifts while the trials run one after another).

A layer-offload preset (``memory.strategy: "layer_offload"``) is tuned within its strategy: the
candidates are every resident count from none to all of the N blocks (``layer_offload_fraction``
= (N - k) / N, which ``resident_count`` maps back to k), with and without activation offloading;
the async setting is the preset's. Its watermarks are not live limits (the fraction decides what
stays), so the two grids do not mix: a stagehand preset gets watermark candidates, a layer-offload
one fractions, and switching strategy is left to the user, who sees both plans.

Not tuned: the Conductor (not modelled: its caps are raised to stay above a candidate's
watermarks, never lowered).

``pareto`` marks the non-dominated points of (step time, peak) pairs, measured or predicted.
"""

from __future__ import annotations

import copy
from typing import Any

from stagehand.config.memory import MAX_MB, MB
from stagehand.layer_offload.schedule import resident_count
from workbench.contract.preset import PresetError
from workbench.contract.preset.merge import merge_overrides
from workbench.plan.inventory import Inventory, PlanInputError, inventory
from workbench.plan.plan import EFFICIENCY, check_memory, preset_inputs, preset_model, simulate
from workbench.plan.profiles import DeviceProfile
from workbench.plan.simulate import weight_section
from workbench.worker.preset import validate_preset

HIGH_FRACTIONS = (0.4, 0.55, 0.7, 0.85, 1.0)
"""High watermarks tried, as fractions of the budget."""
LOW_BLOCKS = (1, 2)
"""Low watermark: this many of the largest blocks below the high one (0 at least)."""
WINDOWS = (1, 2, 3)
INFLIGHT = (1, 2, 4)
SPILL_FRACTIONS = (0.65, 0.8, 1.0)
"""Activation spill high watermark as a fraction of the weight one; its low one is 3/4 of it."""
SPILL_LOW = 0.75


def pareto(points: list[tuple[float, float]]) -> list[bool]:
    """For each ``(step_ms, peak_mb)``: True when no other point is at most as slow and at most
    as large and better in one of them (equal points are all on the front)."""
    out = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (a <= x and b <= y) and (a < x or b < y) for j, (a, b) in enumerate(points) if j != i
        )
        out.append(not dominated)
    return out


def _changes(memory: dict[str, Any], limits: dict[str, float], largest_mb: float) -> dict[str, Any]:
    """The memory section's changes (a partial ``memory``) for flat ``limits``."""
    sh: dict[str, Any] = {
        "vram_high_watermark_mb": limits["high_mb"],
        "vram_low_watermark_mb": limits["low_mb"],
        "prefetch_window_blocks": limits["window"],
        "max_inflight_transfers": limits["inflight"],
    }
    if limits.get("spill_high_mb") is not None:
        sh["activation_stagehand"] = {
            "enabled": True,
            "vram_high_watermark_mb": limits["spill_high_mb"],
            "vram_low_watermark_mb": limits["spill_low_mb"],
        }
    conductor = (memory.get("stagehand") or {}).get("conductor_config") or {}
    if conductor.get("enabled") and conductor.get("vram_soft_cap_mb") != "auto":
        need = round(limits["high_mb"] + largest_mb, 3)
        soft = max(float(conductor.get("vram_soft_cap_mb", 22000)), need)
        hard = max(float(conductor.get("vram_hard_cap_mb", 23500)), soft)
        sh["conductor_config"] = {"vram_soft_cap_mb": soft, "vram_hard_cap_mb": hard}
    return {"strategy": "stagehand", "stagehand": sh}


def limits_text(limits: dict[str, Any]) -> str:
    """One line for a trial's flat limits (the saved preset's description, the CLI)."""
    if "fraction" in limits:
        return (
            f"layer offload {limits['fraction']:.4g} ({limits['resident_blocks']} blocks "
            f"resident), activation offloading {'on' if limits['activation_offloading'] else 'off'}"
        )
    text = (
        f"high {limits['high_mb']} / low {limits['low_mb']} MB, prefetch window "
        f"{limits['window']}, in-flight {limits['inflight']}"
    )
    if limits.get("spill_high_mb") is not None:
        text += f", spill {limits['spill_high_mb']} / {limits['spill_low_mb']} MB"
    return text


def _offload_limits(n_blocks: int, resident: int, offload: bool) -> dict[str, Any]:
    # (N - k) / N exactly: ``resident_count`` floors fraction x N (plus 1e-9), so a fraction
    # rounded for display could land on the next count.
    fraction = (n_blocks - resident) / n_blocks if n_blocks else 0.0
    if resident_count(fraction, n_blocks) != resident:
        raise AssertionError(f"fraction {fraction!r} keeps not {resident} of {n_blocks} blocks")
    return {"fraction": fraction, "resident_blocks": resident, "activation_offloading": offload}


def _offload_changes(limits: dict[str, Any]) -> dict[str, Any]:
    return {
        "strategy": "layer_offload",
        "layer_offload_fraction": limits["fraction"],
        "enable_activation_offloading": limits["activation_offloading"],
    }


def _offload_grid(n_blocks: int):
    for resident in range(n_blocks + 1):
        for offload in (True, False):
            yield _offload_limits(n_blocks, resident, offload)


def _limits_of(
    memory: dict[str, Any],
    n_blocks: int = 0,
    inv: Inventory | None = None,
    profile: DeviceProfile | None = None,
) -> dict[str, Any]:
    """The flat limits of a (validated) memory section; with ``inv`` and ``profile`` the
    pipeline settings it leaves out are those the runtime derives (``weight_section``)."""

    config = check_memory(memory)
    if config.strategy == "layer_offload":
        resident = resident_count(config.layer_offload_fraction, n_blocks)
        own = _offload_limits(n_blocks, resident, config.enable_activation_offloading)
        return {**own, "fraction": config.layer_offload_fraction}
    sh = config.stagehand if inv is None else weight_section(inv, config, profile)
    act = sh.activation_stagehand if sh is not None else None
    on = act is not None and act.enabled
    return {
        "high_mb": sh.vram_high_watermark_mb,
        "low_mb": sh.vram_low_watermark_mb,
        "window": sh.prefetch_window_blocks,
        "inflight": sh.max_inflight_transfers,
        "spill_high_mb": act.vram_high_watermark_mb if on else None,
        "spill_low_mb": act.vram_low_watermark_mb if on else None,
    }


def _grid(budget_mb: float, largest_mb: float, spill: bool, gpu: bool):
    for f in HIGH_FRACTIONS:
        high = round(f * budget_mb, 3)
        for k in LOW_BLOCKS:
            low = round(max(0.0, high - k * largest_mb), 3)
            for window in WINDOWS:
                for inflight in INFLIGHT if gpu else (2,):
                    for s in SPILL_FRACTIONS if spill else (None,):
                        act = None if s is None else round(high * s, 3)
                        yield {
                            "high_mb": high,
                            "low_mb": low,
                            "window": window,
                            "inflight": inflight,
                            "spill_high_mb": act,
                            "spill_low_mb": None if act is None else round(act * SPILL_LOW, 3),
                        }


def propose(
    data: dict[str, Any],
    profile: DeviceProfile,
    budget_mb: float,
    *,
    max_trials: int = 5,
    ratios: dict[str, float] | None = None,
    efficiency: float | None = None,
) -> dict[str, Any]:
    """Trials for a preset's JSON object within ``budget_mb`` (MB of 2**20 bytes) on
    ``profile``: ``{budget_mb, device, min_peak_mb, searched, feasible, distinct, trials:
    [{label, preset, limits, memory, predicted: {peak_mb, step_ms, trace_step_ms,
    blocks_loaded}, predicted_pareto}], not_tuned}``: the preset's own limits first and last
    when they fit, candidates in between, ``max_trials`` in all (at least one candidate).
    ``searched``: candidates simulated; ``feasible``: those predicted to fit the budget;
    ``distinct``: their distinct predictions (peak, step time), the floor's included. ``ratios`` (a
    calibration's, ``workbench.plan.feedback``) scale the predicted peaks and step times.

    Raises:
        PlanInputError: ``budget_mb`` below the smallest peak any candidate reaches (naming
            that minimum), or a bad preset (naming the field).
    """

    if not 0 < budget_mb <= MAX_MB:  # NaN and infinity too
        raise PlanInputError(
            f"budget_mb: expected a number of MB > 0 and at most {MAX_MB} (1 PiB), "
            f"got {budget_mb!r}"
        )
    try:
        preset = validate_preset(copy.deepcopy(data))
    except PresetError as exc:
        problems = "; ".join(f"{p['path']}: {p['message']}" for p in exc.problems)
        raise PlanInputError(problems) from None
    memory = data.get("memory") or {"strategy": "none"}
    base = check_memory(memory)
    layer_offload = base.strategy == "layer_offload"
    sh = base.stagehand
    model = preset_model(preset)
    inv = inventory(
        model,
        preset_inputs(model, preset, None),
        block_pattern=sh.block_pattern if sh is not None else None,
        resident_trainable_max_fraction=sh.resident_trainable_max_fraction if sh else 0.1,
    )
    eff = efficiency or EFFICIENCY["cpu" if profile.tracked else "gpu"]
    r_peak = (ratios or {}).get("peak_vram_mb") or 1.0
    r_step = (ratios or {}).get("step_ms") or 1.0
    largest_mb = max((b.nbytes for b in inv.blocks), default=0) / MB
    act = sh.activation_stagehand if sh is not None else None
    spill = act is not None and act.enabled

    def predict(limits: dict[str, Any], section: dict[str, Any]) -> dict[str, Any]:
        steps = simulate(inv, check_memory(section), profile, eff)
        return {
            "peak_mb": round(max(s.peak_bytes for s in steps) / MB * r_peak, 4),
            "step_ms": round(steps[-1].step_ms * r_step, 3),
            "trace_step_ms": round(steps[0].step_ms * r_step, 3),
            "blocks_loaded": steps[-1].blocks_loaded,  # per steady step: no timing noise
        }

    n_blocks = len(inv.blocks)
    if layer_offload:
        # The smallest peak of the strategy: every block offloaded, activations offloaded.
        floor = _offload_limits(n_blocks, 0, True)
        floor_changes = _offload_changes(floor)
        floor_what = "every block offloaded, activation offloading on"
        grid = list(_offload_grid(n_blocks))
    else:
        # The smallest peak there is: everything evicted after use, no prefetch, every
        # activation spilled (the floor under the grid, which scales with the budget).
        floor = {"high_mb": 0.0, "low_mb": 0.0, "window": 0, "inflight": 1}
        floor.update(spill_high_mb=0.0, spill_low_mb=0.0)
        floor_changes = _changes(memory, floor, largest_mb)
        floor_what = "watermarks 0, no prefetch, every activation spilled"
        grid = list(_grid(budget_mb, largest_mb, spill, not profile.synchronous_copies))
    floor_predicted = predict(floor, merge_overrides(memory, floor_changes))
    floor_mb = floor_predicted["peak_mb"]
    if budget_mb < floor_mb:
        raise PlanInputError(
            f"budget_mb: {budget_mb:g} MB is below the smallest feasible plan of this preset on "
            f"{profile.name}: {floor_mb:.2f} MB peak ({floor_what}); give at least that"
        )
    seen: dict[tuple, dict[str, Any]] = {}
    searched = fits = 0
    for limits in grid:
        if layer_offload:
            changes = _offload_changes(limits)
        else:
            changes = _changes(memory, limits, largest_mb)
        predicted = predict(limits, merge_overrides(memory, changes))
        searched += 1
        if predicted["peak_mb"] > budget_mb:
            continue
        fits += 1
        key = (predicted["peak_mb"], predicted["step_ms"])
        seen.setdefault(key, {"limits": limits, "memory": changes, "predicted": predicted})
    # The floor fits whenever anything does: a budget just above it still gets a trial.
    key = (floor_predicted["peak_mb"], floor_predicted["step_ms"])
    seen.setdefault(key, {"limits": floor, "memory": floor_changes, "predicted": floor_predicted})
    feasible = list(seen.values())
    trials: list[dict[str, Any]] = []
    if layer_offload or sh is not None and base.strategy == "stagehand" and sh.weight_streaming:
        own = _limits_of(memory, n_blocks, inv, profile)
        predicted = predict(own, memory)
        if predicted["peak_mb"] <= budget_mb:
            trials.append(
                {
                    "label": "preset",
                    "preset": True,
                    "limits": own,
                    "memory": {},
                    "predicted": predicted,
                }
            )
    front = [c for c, on in zip(feasible, _front(feasible), strict=True) if on]
    front.sort(key=lambda c: c["predicted"]["step_ms"])
    rest = sorted((c for c in feasible if c not in front), key=lambda c: c["predicted"]["step_ms"])
    # The preset's own limits run first and again last: trials run one after another, and on a
    # shared machine the load drifts in between (as the bench runs its baseline first and last).
    room = max(1, max_trials - 2 * len(trials))
    picks = _spread(front, room) + rest[: max(0, room - len(front))]
    for i, c in enumerate(picks, 1):
        trials.append({"label": f"t{i}", "preset": False, **c})
    if trials and trials[0]["preset"]:
        trials.append({**copy.deepcopy(trials[0]), "label": "preset-last"})
    for t, on in zip(trials, _front(trials), strict=True):
        t["predicted_pareto"] = on
    return {
        "budget_mb": budget_mb,
        "device": profile.name,
        "min_peak_mb": floor_mb,
        "searched": searched,
        "feasible": fits,
        "distinct": len(feasible),
        "trials": trials,
        "not_tuned": _not_tuned(layer_offload),
    }


def _not_tuned(layer_offload: bool) -> dict[str, str]:
    if layer_offload:
        return {
            "watermarks": "layer offload keeps layers by layer_offload_fraction, not watermarks",
            "enable_async_offloading": "the preset's (a GPU's prefetch of the next layer)",
            "strategy": "not switched: plan the preset as stagehand to compare",
        }
    return {
        "layer_offload_fraction": "a stagehand preset: tune a layer_offload preset for fractions",
        "conductor": "not modelled: its caps are raised above a candidate's watermarks",
    }


def _front(cands: list[dict[str, Any]]) -> list[bool]:
    return pareto([(c["predicted"]["step_ms"], c["predicted"]["peak_mb"]) for c in cands])


def _spread(front: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """``n`` of ``front`` (sorted fastest first): the fastest, then evenly along it."""
    if n <= 0 or not front:
        return []
    if len(front) <= n:
        return list(front)
    if n == 1:
        return [front[0]]
    idx = sorted({round(i * (len(front) - 1) / (n - 1)) for i in range(n)})
    return [front[i] for i in idx]


def trial_overrides(config: dict[str, Any], memory: dict[str, Any], steps: int) -> dict[str, Any]:
    """Overrides of a trial run: ``memory`` (a candidate's changes), the trace step and
    ``steps`` more, no checkpoints nor samples, and only as many samples of data as the steps
    draw (stage 1 encodes fewer captions; every step has the preset's shape)."""
    max_steps = 1 + steps
    out: dict[str, Any] = {
        "max_steps": max_steps,
        "checkpoint_every": None,
        "samples": {"prompts": []},
        "memory": memory,
    }
    data = config.get("data") or {}
    need = int(config.get("batch_size", 1)) * max_steps
    if data.get("factory") or data.get("limit"):
        out["data"] = {"limit": min(int(data.get("limit") or need), max(need, 16))}
    return out
