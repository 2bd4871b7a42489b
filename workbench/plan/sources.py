"""How many bytes of blocks the host cache holds in a plan (the weight runtime's rules, in
``stagehand/weights/host_cache.py``), read by the plan's host figures and by the simulation's
choice of where each load comes from (NOTE [ Where a load's bytes come from ] in
``simulate.py``)."""

from __future__ import annotations

from typing import Any

from contract.config import MB
from workbench.plan.inventory import Inventory
from workbench.plan.profiles import DeviceProfile


def host_cache_budget(inv: Inventory, memory: Any, profile: DeviceProfile) -> int:
    """Bytes of host-cache images a streamed run of ``memory`` (a ``MemoryConfig`` or its
    dict) holds: only frozen blocks have one (in 8 bits with SquareQ). Module-backed blocks (``file_backed: false``,
    layer offload) are all registered on a GPU, or on a CPU device with ``host_cache_mb`` set.
    File-backed blocks are cached up to ``host_cache_mb``; left out, on a GPU up to the RAM
    available above a margin, which a plan does not know: every frozen block is counted (the
    most it holds), and none on a CPU device (off there)."""
    if isinstance(memory, dict):
        strategy, sh = memory.get("strategy"), memory.get("stagehand") or {}
        mb, file_backed = sh.get("host_cache_mb"), sh.get("file_backed", True)
        squareq = sh.get("squareq")
    else:
        strategy, sh = memory.strategy, memory.stagehand
        mb = sh.host_cache_mb if sh is not None else None
        file_backed = sh.file_backed if sh is not None else True
        squareq = sh.squareq if sh is not None else None
    # SquareQ's images are the 8-bit ones (``Block.image_bytes``).
    eight_bit = strategy == "stagehand" and bool(squareq)
    frozen = sum(b.image_bytes if eight_bit else b.nbytes for b in inv.blocks if b.frozen)
    on = not profile.tracked if mb is None else mb > 0
    if not (strategy == "stagehand" and file_backed):
        return frozen if (on or not profile.tracked) else 0
    if not on:
        return 0
    return frozen if mb is None else min(frozen, int(mb * MB))
