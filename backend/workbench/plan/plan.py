"""A plan: will this preset fit on this device, how fast, and which knob makes it fit.

``plan_preset`` reads a preset, builds its transformer on ``meta`` (``inventory``), runs the
simulation (``simulate``), re-runs it with the knobs a user would turn when the peak does not
fit (naming the first that fits), and reads SquareQ's error table (``quant_error``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from stagehand.config.memory import MB, MemoryConfig
from stagehand.strategy.auto import device_budget, has_auto
from stagehand.weights.auto import margin_bytes
from workbench.contract.preset import PresetError
from workbench.plan.baseline import worker_baseline_bytes
from workbench.plan.calls import family_call
from workbench.plan.inventory import (
    Inventory,
    PlanInputError,
    add_lora,
    folder_model,
    inventory,
    meta_model,
)
from workbench.plan.profiles import DeviceProfile
from workbench.plan.quant_error import measure_preset
from workbench.plan.result import StepResult
from workbench.plan.sections import (
    block_sizes,
    plan_trainable_bytes,
    planned_activations,
    weight_section,
)
from workbench.plan.simulate import Simulation
from workbench.plan.sources import host_cache_budget
from workbench.worker.assets import example_inputs
from workbench.worker.assets.models import MODEL_CLASSES, check_spec
from workbench.worker.pipelines import PipelineFolderError
from workbench.worker.preset import validate_preset
from workbench.worker.setup import family_targets, pipeline_family

EFFICIENCY = {"gpu": 0.45, "cpu": 1.0}
"""Share of peak TFLOPs a block reaches. GPU: bf16 transformer training kernels at 40-50% of
peak (flash attention, large GEMMs). CPU: 1, the profile's rate is the GEMM rate measured here,
and the costs per operation and per load come from its calibration step."""

STEPS = 3
"""Simulated steps: step 0 traces (demand loads), steps 1-2 follow it; the last is reported."""


@dataclass
class Plan:
    """What ``plan`` reports (bytes, ms)."""

    preset: str
    profile: DeviceProfile
    inventory: Inventory
    memory: dict[str, Any]
    steps: list[StepResult]
    fits: bool
    knob: dict[str, Any] | None
    """The first change that makes a plan that does not fit fit (``None`` when it fits or
    nothing tried does)."""
    efficiency: float
    inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Shapes the model was measured at (a pipeline family's ``latents``, ``text``, ``pooled``)."""
    auto_watermarks: dict[str, Any] | None = None
    """What ``"auto"`` fields became (``auto_figures``), when the preset has any."""
    quant_error: dict[str, Any] | None = None
    """SquareQ's error table of the weights (``quant_error.measure``); None: SquareQ off."""

    @property
    def steady(self) -> StepResult:
        return self.steps[-1]

    def to_dict(self) -> dict[str, Any]:
        s, first, inv = self.steady, self.steps[0], self.inventory
        pinned = 0
        memory = check_memory(self.memory)
        if memory.strategy in ("stagehand", "layer_offload"):
            # The sections as the runtimes resolve them (pool derived when left out).
            section = weight_section(inv, memory, self.profile)
            pinned = int(section.pinned_pool_mb * MB)
            act = section.activation_stagehand
            if act is not None and act.enabled:
                counts = act.slab_counts()
                pinned += int(
                    sum(c * n for c, n in zip(act.pinned_pool_classes_mb, counts, strict=True)) * MB
                )
        # Host copies of the blocks: none when they stream from the safetensors files (reads land
        # in the pinned pool; the page cache is not the process's), all of them module-backed
        # (layer offload's are).
        sh = memory.stagehand
        streaming = memory.strategy == "layer_offload" or (
            memory.strategy == "stagehand" and sh.weight_streaming
        )
        file_backed = streaming and memory.strategy == "stagehand" and sh.file_backed
        masters = 0 if file_backed or not streaming else inv.block_bytes
        cache = host_cache_budget(inv, memory, self.profile) if streaming else 0
        worker = worker_baseline_bytes()  # the process itself (baseline.py)
        return {
            "preset": self.preset,
            "device": self.profile.to_dict(),
            "vram_source": "tracked" if self.profile.tracked else "allocated",
            "fits": self.fits,
            "knob": self.knob,
            "model": inv.to_dict(),
            "inputs": {k: list(v) for k, v in self.inputs.items()},
            "memory": self.memory,
            "efficiency": self.efficiency,
            "peak_bytes": {"trace_step": first.peak_bytes, "steady": s.peak_bytes},
            "steady_band_bytes": [s.low_bytes, s.peak_bytes],
            "host": {  # stage 2; on a CPU device the device bytes are host bytes too
                # Images of file-backed blocks are host memory of their own; module-backed
                # ones are the masters, moved (counted once).
                "ram_peak_bytes": worker
                + pinned
                + masters
                + (cache if file_backed else 0)
                + (max(s.peak_bytes, first.peak_bytes) if self.profile.tracked else 0),
                "worker_baseline_bytes": worker,
                "block_masters_bytes": masters,
                "host_cache_bytes": cache,
                "pinned_bytes": pinned + cache,
                "lora_and_optimizer_bytes": inv.lora_bytes + inv.optimizer_bytes,
                "spilled_activation_bytes": s.spilled_bytes,
            },
            "step_ms": {
                "total": round(s.step_ms, 3),
                "compute": round(s.compute_ms, 3),
                "h2d": round(s.h2d_ms, 3),
                "exposed_h2d": round(s.exposed_h2d_ms, 3),
                "stall": round(s.stall_ms, 3),
                "spill": round(s.spill_ms, 3),
                "trace_step": round(first.step_ms, 3),
            },
            "blocks_loaded": s.blocks_loaded,
            "h2d_bytes": s.h2d_bytes,
            "transfers": self.transfers(),
            "auto_watermarks": self.auto_watermarks,
            "quant_error": self.quant_error,
            "bound_ms": self.bound_ms(),
            "curve": {
                "t_ms": [t for t, _, _ in s.curve],
                "bytes": [b for _, b, _ in s.curve],
                "event": [e for _, _, e in s.curve],
            },
        }

    def transfers(self) -> dict[str, Any]:
        """What a steady step moves (bytes, counts): H2D bytes, block loads, misses and waits
        (``StepResult``), the blocks on the device through it (resident) and those loaded in it
        (streamed), loads per source and their mode (NOTE [ Where a load's bytes come from ])."""
        s, blocks = self.steady, self.inventory.blocks
        streaming = s.blocks_loaded > 0 or s.streamed_blocks > 0
        resident = len(blocks) - s.streamed_blocks if streaming else len(blocks)
        resident_bytes = s.resident_block_bytes if streaming else self.inventory.block_bytes
        sources = dict(sorted(s.loads_by_source.items()))
        return {
            "h2d_bytes_per_step": s.h2d_bytes,
            "block_loads_per_step": s.blocks_loaded,
            "misses_per_step": s.misses,
            "waits_per_step": s.waits,
            "window_blocks": s.window,
            "trace_step_h2d_bytes": self.steps[0].h2d_bytes,
            "resident_blocks": resident,
            "resident_block_bytes": resident_bytes,
            "streamed_blocks": len(blocks) - resident,
            "streamed_block_bytes": self.inventory.block_bytes - resident_bytes,
            "loads_by_source": sources,
            "read_bytes_per_step": s.read_bytes,
            "source_mode": "+".join(sources) or "none",
        }

    def bound_ms(self) -> dict[str, float]:
        """The step's bound, ``max(compute, H2D bytes / pinned H2D rate)`` (ms), beside the
        plan's step: how far the schedule is from hiding every copy behind compute."""
        s = self.steady
        h2d = s.h2d_bytes / (self.profile.h2d_gbps * 1e9) * 1e3
        bound = max(s.compute_ms, h2d)
        return {
            "compute": round(s.compute_ms, 3),
            "h2d": round(h2d, 3),
            "bound": round(bound, 3),
            "x_bound": round(s.step_ms / bound, 3) if bound else None,
        }


def auto_figures(inv: Inventory, config: MemoryConfig, profile: DeviceProfile) -> dict | None:
    """What the ``"auto"`` fields of ``config`` become on ``profile`` (the strategy's own
    ``stagehand.strategy.auto.resolve_auto``, called by ``weight_section`` with the plan's
    activation estimate) and the figures of the rule (bytes; MB for the limits), or None when
    no field says ``"auto"``.

    Raises:
        PlanInputError: the budget is too small for the window (the rule's message).
    """

    sh = config.stagehand
    if config.strategy != "stagehand" or not has_auto(sh):
        return None
    section = weight_section(inv, config, profile)
    sizes = sorted(block_sizes(inv), reverse=True)
    card = None if profile.tracked else profile.vram_bytes
    budget = device_budget(sh, card)
    act, cond = section.activation_stagehand, section.conductor_config
    return {
        "device_bytes": budget,
        "activation_peak_bytes": planned_activations(inv, config.gradient_checkpointing),
        "trainable_bytes": plan_trainable_bytes(inv),
        "window_bytes": sum(sizes[: section.prefetch_window_blocks]),
        "margin_bytes": margin_bytes(budget, card is not None) if budget else 0,
        "high_mb": round(section.vram_high_watermark_mb, 1),
        "low_mb": round(section.vram_low_watermark_mb, 1),
        "activation_mb": [round(act.vram_high_watermark_mb, 1), round(act.vram_low_watermark_mb, 1)]
        if act is not None
        else None,
        "conductor_caps_mb": [round(cond.vram_soft_cap_mb, 1), round(cond.vram_hard_cap_mb, 1)]
        if cond is not None and cond.enabled
        else None,
    }


def simulate(
    inv: Inventory, memory: MemoryConfig, profile: DeviceProfile, efficiency: float
) -> list[StepResult]:
    """``STEPS`` simulated steps of ``inv`` under ``memory`` on ``profile``."""
    return Simulation(inv, memory, profile, efficiency=efficiency).run(STEPS)


def _knobs(memory: dict[str, Any], inv: Inventory, vram: int) -> list[dict[str, Any]]:
    """Changes to try, in the order a user would: checkpointing, then weight streaming with
    watermarks under the card, then activation spill, then a smaller prefetch window."""
    out: list[dict[str, Any]] = []
    if not memory.get("gradient_checkpointing", True):
        out.append({"gradient_checkpointing": True})
    largest = max((b.nbytes for b in inv.blocks), default=0)
    high = (vram - 0.15 * vram) / MB
    low = max(0.0, high - 2 * largest / MB)
    marks = {"vram_high_watermark_mb": round(high, 1), "vram_low_watermark_mb": round(low, 1)}
    weights = {f"stagehand.{name}": mb for name, mb in marks.items()}
    out.append({"strategy": "stagehand", "gradient_checkpointing": True, **weights})
    out.append({**out[-1], "stagehand.activation_stagehand": {"enabled": True, **marks}})
    out.append({**out[-1], "stagehand.prefetch_window_blocks": 1})
    return out


def _apply(memory: dict[str, Any], knob: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(memory)
    for key, value in knob.items():
        if key.startswith("stagehand."):
            out.setdefault("stagehand", {})
            if not isinstance(out["stagehand"], dict):
                out["stagehand"] = {}
            out["stagehand"][key.split(".", 1)[1]] = value
        else:
            out[key] = value
    return out


def check_memory(memory: Any) -> MemoryConfig:
    """The validated memory section.

    Raises:
        PlanInputError: names the first field at fault (``memory.<path>``).
    """
    if not isinstance(memory, dict):
        raise PlanInputError(f"memory: expected an object, got {type(memory).__name__}")
    try:
        config = MemoryConfig.model_validate(copy.deepcopy(memory))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in ("memory", *err["loc"]))
        raise PlanInputError(f"{where}: {err['msg']}") from None
    return config


def section_inventory(model: torch.nn.Module, inputs: Any, section: Any) -> Inventory:
    """``inventory`` with the blocks and resident adapter share ``memory.stagehand`` names."""
    if section is None:
        return inventory(model, inputs)
    fraction = section.resident_trainable_max_fraction
    return inventory(
        model, inputs, block_pattern=section.block_pattern, resident_trainable_max_fraction=fraction
    )


def plan_model(
    model: torch.nn.Module,
    inputs: dict[str, Any] | Callable[[torch.nn.Module], Any],
    memory: dict[str, Any],
    profile: DeviceProfile,
    *,
    name: str = "(model)",
    efficiency: float | None = None,
) -> Plan:
    """The plan of ``model`` (on ``meta``, adapter added) at ``inputs`` (``inventory``'s:
    keyword arguments or a call) under ``memory``.

    Raises:
        PlanInputError: a bad memory section (naming the field).
    """
    config = check_memory(memory)
    inv = section_inventory(model, inputs, config.stagehand)
    eff = efficiency or EFFICIENCY["cpu" if profile.tracked else "gpu"]
    steps = simulate(inv, config, profile, eff)
    auto = auto_figures(inv, config, profile)
    vram = profile.vram_bytes
    fits = not vram or steps[-1].peak_bytes <= vram and steps[0].peak_bytes <= vram
    knob = None
    if not fits:
        for candidate in _knobs(memory, inv, vram):
            trial = check_memory(_apply(memory, candidate))
            trial_steps = simulate(inv, trial, profile, eff)
            if max(s.peak_bytes for s in trial_steps) <= vram:
                knob = {**candidate, "peak_bytes": trial_steps[-1].peak_bytes}
                break
    shapes = getattr(inputs, "shapes", None)
    if shapes is None and isinstance(inputs, dict):
        shapes = {k: tuple(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    return Plan(name, profile, inv, memory, steps, fits, knob, eff, shapes or {}, auto)


def preset_family(preset: Any) -> Any:
    """The trainer's family adapter bound to ``model.path`` when it is a pipeline folder
    (``workbench.worker.setup.pipeline_family``), else None (a factory or single model folder).

    Raises:
        PlanInputError: the folder or a component is wrong (naming ``model.path``).
    """

    if preset.model.path is None:
        return None
    try:
        return pipeline_family(preset, torch.device("meta"))
    except (PipelineFolderError, ValueError) as exc:
        message = str(exc)  # some already name the field (folder.py: a missing folder)
        field = "" if message.startswith("model.path:") else "model.path: "
        raise PlanInputError(f"{field}{message}") from None


def preset_model(preset: Any, family: Any = None) -> torch.nn.Module:
    """The transformer of a validated ``Preset`` on ``meta``, LoRA added (rank, targets): a
    pipeline folder's is the one its ``family`` trains (``preset_family`` when not given),
    with the family's LoRA targets unless the preset names some (as the trainer does).

    Raises:
        PlanInputError: neither ``model.factory`` nor ``model.path``, or a folder without a
            transformer config (naming ``model.path``).
    """

    dtype = getattr(torch, preset.model.dtype)
    m = preset.model
    if m.factory is not None:
        model = meta_model(MODEL_CLASSES[m.factory], check_spec(m.factory, m.size), dtype)
    elif m.path is not None:
        family = family or preset_family(preset)
        folder = Path(m.path).expanduser() if family is None else family.transformer_dir
        model = folder_model(folder, dtype)
        preset = family_targets(preset, family)
    else:
        raise PlanInputError("model: give model.factory or model.path")
    try:
        add_lora(model, preset.rank, list(preset.lora.target_modules))
    except ValueError as exc:
        raise PlanInputError(f"lora.target_modules: {exc}") from None
    return model


def preset_inputs(
    model: torch.nn.Module, preset: Any, text_len: int | None, family: Any = None
) -> Any:
    """What ``inventory`` runs the model on: for a pipeline folder the trainer's own call
    (``calls.family_call``: the family's latents, text and ``predict`` on ``meta``), else
    ``meta`` keyword arguments of a factory model at the preset's resolution (8x VAE), batch
    and caption length.

    Raises:
        PlanInputError: a single model folder of a class the factory does not know (its
            inputs come from its pipeline: give the pipeline folder), or a field the shapes
            come from is wrong (named).
    """

    family = family or preset_family(preset)
    if family is not None:
        return family_call(family, model, preset, text_len)
    side = preset.resolution // 8
    side -= side % 2
    try:
        return example_inputs(
            model,
            batch_size=preset.batch_size,
            latent_hw=(side, side),
            text_len=text_len or preset.data.max_caption_tokens,
            frames=preset.data.frames or 2,
            device="meta",
        )
    except TypeError as exc:
        raise PlanInputError(
            f"model.path: {exc}; a plan builds its inputs from the pipeline folder "
            "(model_index.json beside transformer/): give that folder"
        ) from None


def plan_preset(
    data: dict[str, Any],
    profile: DeviceProfile,
    *,
    name: str = "(preset)",
    text_len: int | None = None,
    efficiency: float | None = None,
    quant_error: str = "cached",
) -> Plan:
    """The plan of a preset's JSON object on ``profile``; with SquareQ on, the quantization
    error table (``quant_error``: a mode of ``workbench.plan.quant_error.MODES``).

    Raises:
        PlanInputError: the preset is invalid (the message lists the fields), or a field the
            plan needs is wrong (naming it).
        OSError: ``compute`` cannot write SquareQ's cache folder (names it).
    """

    try:
        preset = validate_preset(data)
    except PresetError as exc:
        lines = [f"{p['path']}: {p['message']}" for p in exc.problems]
        raise PlanInputError("; ".join(lines)) from None
    if preset.training_method != "lora":
        raise PlanInputError("training_method: the planner models LoRA runs only")
    family = preset_family(preset)
    model = preset_model(preset, family)
    inputs = preset_inputs(model, preset, text_len, family)
    memory = data.get("memory") or {"strategy": "none"}
    plan = plan_model(model, inputs, memory, profile, name=name, efficiency=efficiency)
    plan.quant_error = measure_preset(preset, family, preset_model, quant_error)
    return plan
