"""The settings a planned run's runtimes use: the preset's ``memory.stagehand`` section with
what it leaves out derived as the runtime derives it (``stagehand/weights/defaults.py``) and its
``"auto"`` fields resolved as the strategy resolves them (``stagehand/strategy/auto.py``), or
layer offload's derived section; the block sizes and activation estimate those rules take."""

from __future__ import annotations

from contract.config import MemoryConfig, StagehandSection
from stagehand.layer_offload.section import ceiling_mb, section_for
from stagehand.strategy.auto import resolve_auto
from stagehand.weights.defaults import resolve, staged_sizes
from stagehand.weights.registry import ALIGN
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
            sh = resolve_auto(  # "auto" fields as the strategy resolves them at build
                sh,
                block_sizes=sizes,
                trainable=2 * inv.lora_bytes + inv.optimizer_bytes,  # weights, grads, AdamW
                activation_peak=planned_activations(inv, memory.gradient_checkpointing),
                card_bytes=profile.vram_bytes if cuda else None,
            )
        except ValueError as exc:  # a budget too small for the window: the rule names it
            raise PlanInputError(f"memory.stagehand.vram_high_watermark_mb: {exc}") from None
        # With SquareQ the slab stages the 8-bit images, as the runtime sizes it.
        staged = staged_sizes(sh.squareq is not None, [b.image_bytes for b in inv.blocks])
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


def block_sizes(inv: Inventory) -> list[int]:
    """Each block's bytes as the runtime sizes its pipeline (slab, window, "auto"): all its
    parameters, adapter included, aligned."""
    return [-(-b.param_bytes // ALIGN) * ALIGN for b in inv.blocks]


def planned_activations(inv: Inventory, checkpointing: bool) -> int:
    """The activation peak ``"auto"`` plans for (bytes): what the step saves outside the blocks,
    and per block its inputs with checkpointing (plus one block's recomputation), else all it
    saves."""
    outside = sum(inv.saved_pre) + sum(inv.saved_post)
    if checkpointing:
        blocks = sum(b.input_bytes for b in inv.blocks)
        return outside + blocks + max((b.saved_bytes for b in inv.blocks), default=0)
    return outside + sum(b.saved_bytes for b in inv.blocks)
