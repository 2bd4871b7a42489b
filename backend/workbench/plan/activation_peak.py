"""The activation peak a run resolves ``"auto"`` limits with at build: the planner's estimate
(``workbench.plan.sections.planned_activations``) of the inventory ``workbench plan`` measures for the
same preset. ``workbench train`` (``backend/workbench/cli/train.py``) hands it to the worker, whose layer
sits below the planner's."""

from __future__ import annotations

from typing import Any

from workbench.plan.plan import preset_family, preset_inputs, preset_model, section_inventory
from workbench.plan.sections import planned_activations


def planned_activation_peak(preset: Any) -> int:
    """The activation peak ``"auto"`` resolves with for a run of the validated ``preset``
    (bytes): ``planned_activations`` of the inventory ``plan_preset`` measures (the same meta
    model, adapter and inputs at ``data.max_caption_tokens``). The worker resolves ``"auto"``
    with it at build (``backend/workbench/worker/run.py``), so a run starts with the watermarks its plan shows.

    Raises:
        PlanInputError: a field the inventory needs is wrong (named).
    """
    family = preset_family(preset)
    model = preset_model(preset, family)
    inputs = preset_inputs(model, preset, None, family)
    inv = section_inventory(model, inputs, preset.memory.stagehand)
    return planned_activations(inv, preset.memory.gradient_checkpointing)
