"""The settings a planned run's runtimes use: the preset's ``memory.stagehand`` section with
what it leaves out derived as the runtime derives it (``runtime/stagehand/weights/defaults.py``) and its
``"auto"`` fields resolved as the strategy resolves them (``runtime/stagehand/strategy/auto.py``), or
layer offload's derived section; the block sizes and activation estimate those rules take."""

from __future__ import annotations

from stagehand.config.memory import MemoryConfig, StagehandSection
from stagehand.layer_offload.section import ceiling_mb, section_for
from stagehand.strategy.auto import resolve_auto
from stagehand.weights.defaults import resolve, staged_sizes
from workbench.plan.inventory import Inventory, PlanInputError
from workbench.plan.profiles import DeviceProfile


def weight_section(
    inv: Inventory, memory: MemoryConfig, profile: DeviceProfile
) -> StagehandSection | None:
    """The weight and activation runtimes' settings a run of ``memory`` uses: the preset's
    ``stagehand`` section, or for layer offload the one its strategy derives (``section_for``,
    from the inventory's largest block and weights and the profile's memory)."""
    if memory.strategy != "layer_offload":
        sh = memory.stagehand
        if sh is None:
            return None
        # The pipeline settings the preset leaves out, as the runtime derives them.
        sizes = block_sizes(inv)
        cuda = not profile.tracked
        try:
            sh = auto_section(
                inv,
                sh,
                checkpointing=memory.gradient_checkpointing,
                card_bytes=profile.vram_bytes if cuda else None,
            )
        except ValueError as exc:  # a budget too small for the window: the rule names it
            raise PlanInputError(f"memory.stagehand.vram_high_watermark_mb: {exc}") from None
        # With SquareQ the slab stages the 8-bit images, as the runtime sizes it.
        staged = staged_sizes(
            memory.squareq_format() is not None, [b.image_bytes for b in inv.blocks]
        )
        return resolve(
            sh, sizes, staged=staged, cuda=cuda, vram_bytes=profile.vram_bytes if cuda else 0
        )
    weights = inv.param_bytes + inv.buffer_bytes
    return section_for(
        memory,
        largest_block_bytes=max((b.param_bytes for b in inv.blocks), default=0),
        ceiling_mb=ceiling_mb(weights, None if profile.tracked else profile.vram_bytes),
        cuda=not profile.tracked,
    )


def auto_section(
    inv: Inventory, section: StagehandSection, *, checkpointing: bool, card_bytes: int | None
) -> StagehandSection:
    """``section`` with its ``"auto"`` fields in MB: the strategy's own ``resolve_auto`` with
    the plan's figures (``block_sizes``, ``plan_trainable_bytes``, ``planned_activations``).
    The one resolution the planner, the bench's rows and a run share, so all keep the same
    blocks resident: a run resolves at build with ``planned_activations`` of the same
    inventory (``workbench.plan.activation_peak.planned_activation_peak``), then with its measured peak after the
    trace step.

    Args:
        card_bytes: the card's memory in bytes; None on a CPU device (no budget).

    Raises:
        ValueError: the budget is too small for the window (the rule names the figures).
    """
    return resolve_auto(
        section,
        block_sizes=block_sizes(inv),
        trainable=plan_trainable_bytes(inv),
        activation_peak=planned_activations(inv, checkpointing),
        card_bytes=card_bytes,
    )


def plan_trainable_bytes(inv: Inventory) -> int:
    """Device bytes of the adapter, its gradients and AdamW's two moments (``"auto"``'s
    trainable figure; ``stagehand.strategy.auto.trainable_bytes`` counts the same on a model)."""
    return 2 * inv.lora_bytes + inv.optimizer_bytes


def block_sizes(inv: Inventory) -> list[int]:
    """Each block's bytes as the runtime sizes its pipeline (slab, window, "auto"): all its
    parameters, adapter included, each aligned (``stagehand.weights.defaults.block_bytes``)."""
    return [b.layout_bytes for b in inv.blocks]


def planned_activations(inv: Inventory, checkpointing: bool) -> int:
    """The activation peak ``"auto"`` plans for (bytes): what the step saves outside the blocks,
    and per block its inputs with checkpointing (plus one block's recomputation), else all it
    saves."""
    outside = sum(inv.saved_pre) + sum(inv.saved_post)
    if checkpointing:
        blocks = sum(b.input_bytes for b in inv.blocks)
        return outside + blocks + max((b.saved_bytes for b in inv.blocks), default=0)
    return outside + sum(b.saved_bytes for b in inv.blocks)
