"""How many bytes of blocks the host cache holds in a plan (the weight runtime's rules, in
``runtime/stagehand/weights/host_cache.py``), read by the plan's host figures and by the simulation's
choice of where each load comes from (NOTE [ Where a load's bytes come from ] in
``simulate.py``)."""

from __future__ import annotations

from stagehand.config.memory import MB, MemoryConfig
from workbench.plan.inventory import Inventory
from workbench.plan.profiles import DeviceProfile


def host_cache_budget(inv: Inventory, memory: MemoryConfig, profile: DeviceProfile) -> int:
    """Bytes of host-cache images a streamed run of ``memory`` holds: only frozen blocks have
    one (in 8 bits when SquareQ is on, ``MemoryConfig.squareq_format``). Module-backed blocks
    (``file_backed: false``, layer offload) are all registered on a GPU, or on a CPU device
    with ``host_cache_mb`` set.
    File-backed blocks are cached up to ``host_cache_mb``; left out, on a GPU up to the RAM
    available above a margin, which a plan does not know: every frozen block is counted (the
    most it holds), and none on a CPU device (off there)."""
    sh = memory.stagehand
    mb = sh.host_cache_mb if sh is not None else None
    file_backed = sh.file_backed if sh is not None else True
    # SquareQ's images are the 8-bit ones (``Block.image_bytes``).
    eight_bit = memory.squareq_format() is not None
    frozen = sum(b.image_bytes if eight_bit else b.nbytes for b in inv.blocks if b.frozen)
    on = not profile.tracked if mb is None else mb > 0
    if not (memory.strategy == "stagehand" and file_backed):
        return frozen if (on or not profile.tracked) else 0
    if not on:
        return 0
    return frozen if mb is None else min(frozen, int(mb * MB))
