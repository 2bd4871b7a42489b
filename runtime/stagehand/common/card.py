"""A card of a chosen size on any device (``workbench train --card-gb``, the bench's rows).

On CUDA the caching allocator is capped with torch's ``set_per_process_memory_fraction``, and it
raises its own ``torch.OutOfMemoryError`` at the allocation that crosses the card. On the CPU
there is no device memory to cap: the runtimes' tracked device bytes (``DeviceMemory``) are held
under the card instead, and the ``track`` that would cross it raises ``torch.OutOfMemoryError``
with a CUDA-like message (``stagehand.common.memory.out_of_memory``). Either way a run meets the
card as it would meet a smaller GPU, and its out-of-memory recovery can be tested on the CPU.
"""

from __future__ import annotations

import torch

from stagehand.common.memory import EMULATED_CARD

GIB = 2**30
"""``--card-gb`` counts GiB (the bench's rows and the planner's ``--vram-gb`` alike)."""

MAX_CARD_GB = 4096
"""The largest ``--card-gb`` accepted (GiB): a typo guard, far above any card."""


def card_gb_problem(card_gb: float | None, flag: str = "--card-gb") -> str | None:
    """The sentence naming ``flag`` when ``card_gb`` is not in (0, ``MAX_CARD_GB``] GiB, else
    None (None is no card: the device as it is)."""
    if card_gb is None:
        return None
    if card_gb != card_gb or not 0 < card_gb <= MAX_CARD_GB:
        return f"{flag} must be in (0, {MAX_CARD_GB}] GiB, got {card_gb:g}"
    return None


def emulate_card(device: torch.device, card_bytes: int | None) -> float:
    """Make ``device`` a card of ``card_bytes`` for this process (None: the device as it is).

    CUDA (``cuda`` or ``cuda:N``): ``set_per_process_memory_fraction`` with the card's share of
    the device's memory, at most 1. The allocator wants an integer index (a bare
    ``torch.device("cuda")`` raises ``ValueError``): a device without one means the current
    device, as a tensor's ``.to("cuda")`` does. ``mem_get_info`` and the device properties
    still report the whole card: code that sizes itself from the card must be told
    ``card_bytes`` too (``workbench.bench.realsize.row_memory``); ``DeviceMemory.card_bytes`` is.

    CPU: every ``DeviceMemory`` built after this call holds its tracked bytes under
    ``card_bytes`` (``stagehand.common.memory.EMULATED_CARD``).

    Returns the fraction of the device's memory the card is (1.0 on the CPU).
    """
    if device.type != "cuda":
        if card_bytes is None:
            EMULATED_CARD.pop(device.type, None)
        else:
            EMULATED_CARD[device.type] = int(card_bytes)
        return 1.0
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = 1.0 if card_bytes is None else min(1.0, card_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    if card_bytes is None:
        EMULATED_CARD.pop("cuda", None)
    else:
        EMULATED_CARD["cuda"] = min(int(card_bytes), total)
    return fraction
