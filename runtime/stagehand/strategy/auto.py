"""``"auto"`` fields of a ``memory.stagehand`` section resolved to MB before the runtimes are built.

The weight watermarks follow NOTE [ Auto watermarks ] (``runtime/stagehand/weights/auto.py``), the
activation watermarks and the Conductor's caps NOTE [ Who gives way ]
(``runtime/stagehand/conductor/arbitration.py``); this module only gathers the figures and writes them
into the section. The composed strategy calls it at build with the planned activation peak and
again after the trace step with the measured one; the planner calls it with its own estimate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stagehand.conductor.arbitration import AUTO_PRESSURE_THRESHOLD, auto_limits
from stagehand.config.limits import ACTIVATION_PAIR, AUTO, WEIGHT_PAIR
from stagehand.config.memory import MB, MemoryConfig, StagehandSection
from stagehand.weights.auto import auto_watermarks, margin_bytes
from stagehand.weights.defaults import block_bytes, resolve
from stagehand.weights.registry import find_blocks

NO_BUDGET_MB = 1e9
"""What ``"auto"`` gives on a tracked (CPU) device without a numeric Conductor cap: no limit
(every block stays, nothing spills): host RAM is the device and there is no card to fit."""

OPTIMIZER_COPIES = 4
"""Bytes per trainable parameter byte on the device: the weight, its gradient and AdamW's two
moments (kept in the parameter's dtype by ``torch.optim.AdamW``)."""


def has_auto(section: StagehandSection | None) -> bool:
    """Whether any watermark or cap of ``section`` is ``"auto"``."""
    if section is None:
        return False
    act, cond = section.activation_stagehand, section.conductor_config
    fields = [section.vram_high_watermark_mb]
    if act is not None:
        fields.append(act.vram_high_watermark_mb)
    if cond is not None and cond.enabled:
        fields.append(cond.vram_soft_cap_mb)
    return AUTO in fields


def plans_activations(memory: MemoryConfig, device: torch.device | str) -> bool:
    """Whether a run of ``memory`` on ``device`` resolves ``"auto"`` with an activation peak
    (the planner's at build): the stagehand strategy with an ``"auto"`` field and a budget to
    fit (a CUDA card, or an enabled Conductor's soft cap in MB). Without a budget ``"auto"``
    gives ``NO_BUDGET_MB`` whatever the peak."""
    section = memory.stagehand
    if memory.strategy != "stagehand" or not has_auto(section):
        return False
    return torch.device(device).type == "cuda" or device_budget(section, None) is not None


def trainable_bytes(model: torch.nn.Module) -> int:
    """Device bytes of the trainable parameters with their gradients and optimizer state."""
    return OPTIMIZER_COPIES * sum(
        p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
    )


def device_budget(section: StagehandSection, card_bytes: int | None) -> int | None:
    """The bytes ``"auto"`` fits into: the card (None on a CPU device), or the Conductor's soft
    cap when it is enabled, a number and lower. None: no budget (a CPU device, no cap)."""
    cond = section.conductor_config
    caps = [card_bytes] if card_bytes is not None else []
    if cond is not None and cond.enabled and cond.vram_soft_cap_mb != AUTO:
        caps.append(int(cond.vram_soft_cap_mb * MB))
    return min(caps) if caps else None


def resolve_auto(
    section: StagehandSection,
    *,
    block_sizes: Sequence[int],
    trainable: int,
    activation_peak: int,
    card_bytes: int | None,
) -> StagehandSection:
    """``section`` with every ``"auto"`` field in MB (a section without one is returned as is).

    Args:
        block_sizes: each streamed block's bytes (the window is the largest ones).
        trainable: ``trainable_bytes`` of the model.
        activation_peak: the step's activation peak in bytes (planned, or measured).
        card_bytes: the CUDA card's memory; None on a CPU device (tracked bytes).

    Raises:
        ValueError: the budget is too small (``auto_watermarks`` names the figures).
    """
    if not has_auto(section):
        return section
    cuda = card_bytes is not None
    window = resolve(section, block_sizes, cuda=cuda, vram_bytes=card_bytes or 0)
    window_bytes = sum(sorted(block_sizes, reverse=True)[: window.prefetch_window_blocks])
    budget = device_budget(section, card_bytes)
    update: dict = {}
    act, cond = section.activation_stagehand, section.conductor_config
    if budget is None:
        high = low = act_high = act_low = soft = hard = NO_BUDGET_MB * MB
    else:
        margin = margin_bytes(budget, cuda)
        high, low = auto_watermarks(budget, activation_peak, trainable, window_bytes, margin)
        limits = auto_limits(budget, window_bytes, margin)
        act_high, act_low = limits.activation_high_bytes, limits.activation_low_bytes
        soft, hard = limits.soft_cap_bytes, limits.hard_cap_bytes
    if section.vram_high_watermark_mb == AUTO:
        update.update(vram_high_watermark_mb=high / MB, vram_low_watermark_mb=low / MB)
    if act is not None and act.vram_high_watermark_mb == AUTO:
        marks = {"vram_high_watermark_mb": act_high / MB, "vram_low_watermark_mb": act_low / MB}
        update["activation_stagehand"] = act.model_copy(update=marks)
    if cond is not None:
        caps: dict = {}
        if cond.vram_soft_cap_mb == AUTO:
            caps.update(vram_soft_cap_mb=soft / MB, vram_hard_cap_mb=hard / MB)
        if section.vram_high_watermark_mb == AUTO:  # the plan fills the card up to the soft cap
            if "backward_pressure_threshold" not in cond.model_fields_set:
                caps["backward_pressure_threshold"] = AUTO_PRESSURE_THRESHOLD
        update["conductor_config"] = cond.model_copy(update=caps)
    return section.model_copy(update=update)


class AutoSection:
    """A section with ``"auto"`` fields and the figures its model gives (blocks, trainable
    bytes, the card), for ``resolve_auto`` at build and after the trace step.

    ``measured``: the activation peak measured at the end of the first forward (device bytes
    other than weights: ``usage - tracked weights``), None once used."""

    def __init__(
        self, section: StagehandSection, model: torch.nn.Module, device, training: bool = True
    ) -> None:
        device = torch.device(device)
        self.section = section
        self.block_sizes = block_bytes(find_blocks(model, section.block_pattern))
        # An inference strategy (stage 1's text encoders) keeps no gradient or optimizer state,
        # whatever its parameters' requires_grad says.
        self.trainable = trainable_bytes(model) if training else 0
        cuda = device.type == "cuda"
        self.card = torch.cuda.get_device_properties(device).total_memory if cuda else None
        self.measured: int | None = None
        self._done = False
        act = section.activation_stagehand
        self.fields: list[str] = []
        """The live-limit fields that were ``"auto"`` (a pair is, or is not, together)."""
        if section.vram_high_watermark_mb == AUTO:
            self.fields += WEIGHT_PAIR
        if act is not None and act.vram_high_watermark_mb == AUTO:
            self.fields += ACTIVATION_PAIR

    def resolve(self, activation_peak: int) -> StagehandSection:
        return resolve_auto(
            self.section,
            block_sizes=self.block_sizes,
            trainable=self.trainable,
            activation_peak=activation_peak,
            card_bytes=self.card,
        )

    def measure(self, memory) -> None:
        """Record the activation peak once (the trace step's forward end)."""
        if not self._done:
            self._done = True
            self.measured = max(0, memory.usage_bytes() - memory.tracked_bytes("weights"))
