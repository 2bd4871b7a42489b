"""The host cache: frozen blocks kept in host memory as *images* laid out like their device buffer,
so a load is one H2D copy straight from the image (no file read, no slab, no second host copy).

Two kinds of image, one per block at most, both only for blocks with no trainable parameter
(trainable ones are copied back to their host masters at eviction: they are never cached):

- *cached* (file-backed blocks): made at the block's first load, filled by that load's read and
  kept; later loads copy from it. Budget: ``host_cache_mb`` (None: auto, from the RAM available
  at set-up minus a margin on CUDA, off on CPU where the device's memory is the host's, 0: off),
  and at each new image the RAM available now must stay above the margin. A block that does
  not fit keeps streaming from its file through the slabs (``refused_blocks`` counts them; the
  ``stagehand/step`` record reports it), so a model larger than RAM still runs file-backed.
- *registered* (module-backed blocks): made at set-up from the host masters, which become views
  of it (the masters' bytes move, they are not doubled). On CUDA this is what page-locks
  module-backed weights, so the copy engine reads them directly; on CPU images are made only
  with the cache on (an explicit ``host_cache_mb``), else module-backed blocks stage as before.

On CUDA an image is page-locked (``page_locked_buffer``: ``cudaHostRegister``, whole pages, no
power-of-two rounding); a lock that fails (a pinned-memory cap, or no memory to map) stops the
caching for the run, with the reason in ``refusal``; blocks go on streaming through the slabs.
Where the platform caps page-locked memory below RAM (Windows, WSL2: about half of RAM,
``host_ram.pinned_cap``) the images never take the last of it: they stop at ``pin_limit``, the
cap less the pinned pool's lock and ``pinned_headroom`` (a quarter of the cap, at least 4 GiB)
kept for the page-locked allocations made later (the activation pool and its misses, host
gradients, ``pin_memory`` copies); else those would fail with a CUDA out-of-memory mid-step.
``host_cache_mb: 0`` turns every image off, registered ones included. ``close`` unlocks every
image (the memory stays valid pageable memory for views still held). A cached image is never
written after its fill; a registered one only by its own block's copy back (a block left on the
device while the user's code ran: ``CopyBack.expose``), which that block's next load waits
for on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stagehand.common.device import host_buffer, page_locked_buffer, slot_views, unlock
from stagehand.common.host_ram import host_ram, pinned_cap
from stagehand.config.memory import MB
from stagehand.weights.registry import Block

MARGIN_FRACTION = 0.25
"""Share of the machine's RAM the cache leaves free (the trainer's own memory, the activation
pools, the OS): an image is refused when it would leave less available."""
MIN_MARGIN_BYTES = 8 * 1024 * MB
"""The margin is at least this (8 GiB)."""


PINNED_HEADROOM_FRACTION = 0.25
"""Share of a pinned-memory cap the images leave to later page-locked allocations."""
MIN_PINNED_HEADROOM_BYTES = 4 * 1024 * MB
"""That headroom is at least this (4 GiB)."""


def pinned_headroom(cap: int) -> int:
    """Bytes of page-lockable memory the images leave free under a cap of ``cap`` bytes."""
    return max(MIN_PINNED_HEADROOM_BYTES, int(PINNED_HEADROOM_FRACTION * cap))


def pin_limit(locked_bytes: int) -> tuple[int, str] | None:
    """Bytes of images that may be page-locked beside ``locked_bytes`` already locked (the
    pinned pool), with the rule in words, or None where no cap is known (``pinned_cap``)."""
    _, total = host_ram()
    cap = pinned_cap(total)
    if cap is None:
        return None
    headroom = pinned_headroom(cap)
    limit = max(0, cap - headroom - locked_bytes)
    return limit, (
        f"{limit / MB:.0f} MB = pinned-memory cap {cap / MB:.0f} MB (half of RAM) - pinned "
        f"pool {locked_bytes / MB:.0f} MB - {headroom / MB:.0f} MB kept for the other pools"
    )


def ram_margin(total: int) -> int:
    """Bytes of RAM the cache leaves available on a machine of ``total`` bytes."""
    return max(MIN_MARGIN_BYTES, int(MARGIN_FRACTION * total))


def cache_budget(host_cache_mb: float | None, cuda: bool) -> int:
    """The cache's budget in bytes: ``host_cache_mb`` when given (0: off); None: on CUDA the RAM
    available now (``host_ram``: a container's memory limit counts) minus ``ram_margin``, on CPU 0 (a CPU "device" is host memory: a cache there
    would hold every block twice)."""
    if host_cache_mb is not None:
        return int(host_cache_mb * MB)
    if not cuda:
        return 0
    available, total = host_ram()
    return max(0, available - ram_margin(total))


def cacheable(block: Block) -> bool:
    """Whether ``block`` may have an image: no trainable parameter in its layout."""
    return not block.trainable


@dataclass(eq=False)
class Image:
    buffer: torch.Tensor
    """uint8, the block's ``nbytes``, laid out as its device buffer."""
    ready: bool = False
    """Filled (cached: set by the load that read it; registered: at once)."""
    registered: bool = False


class HostCache:
    """Images of frozen blocks (see the module docstring). ``budget``: bytes of cached images
    (``cache_budget``); ``pin``: page-lock images (CUDA) on ``device``; ``pin_limit``: bytes of
    images it may page-lock and the rule that gave it (``pin_limit``; None: no cap);
    ``registers``: make registered images (default: when ``budget`` is positive)."""

    def __init__(
        self,
        budget: int,
        pin: bool,
        *,
        device: torch.device | None = None,
        pin_limit: tuple[int, str] | None = None,
        registers: bool | None = None,
    ) -> None:
        self.budget, self.pin, self.device = budget, pin, device
        self.pin_limit = pin_limit
        self.registers = budget > 0 if registers is None else registers
        self.locked_bytes = 0
        """Bytes of images page-locked so far."""
        self.images: dict[int, Image] = {}
        self.cached_bytes = 0
        """Bytes of cached (file-backed) images, ready or being filled."""
        self.registered_bytes = 0
        """Bytes of registered (module-backed) images."""
        self.hits = 0
        """Loads copied straight from a ready image."""
        self.reads_avoided = 0
        """Checkpoint tensors those loads did not read from the files."""
        self.refused: set[int] = set()
        """Blocks that did not fit (they stream from the file through the slabs)."""
        self.refusal: str | None = None
        """Why caching stopped for the run (a failed page-lock), None while it may go on."""

    @classmethod
    def for_run(
        cls, host_cache_mb: float | None, cuda: bool, device: torch.device, locked_bytes: int
    ) -> HostCache:
        """The cache of a runtime on ``device``: budget from ``host_cache_mb`` (``cache_budget``),
        at most the pin limit beside the pinned pool's ``locked_bytes`` on CUDA; registered
        images on CUDA (on CPU only with the cache on), none with ``host_cache_mb: 0``."""
        budget = cache_budget(host_cache_mb, cuda)
        limit = pin_limit(locked_bytes) if cuda else None
        if limit is not None and host_cache_mb is None:
            budget = min(budget, limit[0])
        registers = host_cache_mb != 0 and (cuda or budget > 0)
        return cls(budget, pin=cuda, device=device, pin_limit=limit, registers=registers)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def _buffer(self, nbytes: int) -> torch.Tensor | None:
        """A new image buffer, or None (and caching stopped, with the reason) when it cannot be
        had: over ``pin_limit``, or the allocation or the lock failed (no memory, a cap)."""
        if not self.pin:
            try:
                return host_buffer(nbytes, pin=False)
            except RuntimeError as exc:  # PyTorch's CPU allocator out of memory
                self.refusal = f"allocating a {nbytes / MB:.0f} MB block image failed: {exc}"
                return None
        if self.pin_limit is not None and self.locked_bytes + nbytes > self.pin_limit[0]:
            self.refusal = (
                f"page-locked block images stop at {self.pin_limit[1]}: a {nbytes / MB:.0f} MB "
                f"image would exceed it ({self.locked_bytes / MB:.0f} MB locked)"
            )
            return None
        try:
            buffer = page_locked_buffer(nbytes, self.device)
        except RuntimeError as exc:
            self.refusal = f"page-locking a {nbytes / MB:.0f} MB block image failed: {exc}"
            return None
        self.locked_bytes += nbytes
        return buffer

    def ready(self, block: Block) -> torch.Tensor | None:
        """``block``'s filled image (a load copies from it: counted as a hit), else None."""
        image = self.images.get(block.index)
        if image is None or not image.ready:
            return None
        self.hits += 1
        if not image.registered:
            self.reads_avoided += sum(len(run[3]) for run in block.read_plan or ())
        return image.buffer

    def reserve(self, block: Block) -> torch.Tensor | None:
        """An image for ``block``'s first load to fill (``filled`` marks it ready), or None:
        not cacheable, cache off or stopped, over the budget, or the RAM available now would
        fall under the margin (then the block counts in ``refused``)."""
        image = self.images.get(block.index)
        if image is not None:
            return image.buffer  # an earlier fill that failed: filled again
        if not self.enabled or self.refusal is not None or not cacheable(block):
            return None
        if block.index in self.refused:
            return None
        if self.cached_bytes + block.staged_bytes > self.budget:
            self.refused.add(block.index)
            return None
        available, total = host_ram()  # read only for an image the budget allows
        if available - block.staged_bytes < ram_margin(total):
            self.refused.add(block.index)
            return None
        buffer = self._buffer(block.staged_bytes)
        if buffer is None:
            return None
        self.images[block.index] = Image(buffer)
        self.cached_bytes += block.staged_bytes
        return buffer

    def filled(self, block: Block) -> None:
        """``block``'s image holds its bytes (called by the reader that filled it)."""
        self.images[block.index].ready = True

    def register(self, block: Block) -> bool:
        """Move a module-backed frozen block's host masters into one image (they become views
        of it); False (masters unchanged) when images are off (``registers``: never with
        ``host_cache_mb: 0``), the block has a file-backed or trainable parameter, or the image
        cannot be page-locked."""
        if not self.registers or self.refusal is not None or not cacheable(block):
            return False
        layout = block.staged_layout
        if any(slot.host is None for slot in layout):
            return False
        buffer = self._buffer(block.staged_bytes)
        if buffer is None:
            return False
        for slot, view in zip(layout, slot_views(buffer, layout), strict=True):
            view.copy_(slot.host)
            slot.host = view
            if slot.param is not None:  # None: a SquareQ code entry (its parameter is empty)
                slot.param.data = view
        self.images[block.index] = Image(buffer, ready=True, registered=True)
        self.registered_bytes += block.staged_bytes
        return True

    def record(self, mode: str, reason: str) -> dict[str, object]:
        """The cache's fields of a ``stagehand/step`` record (docs/contracts.md)."""
        return {
            "weights_mode": mode,
            "weights_mode_reason": reason,
            "host_cache_mb": self.cached_bytes / MB,
            "host_cache_budget_mb": self.budget / MB,
            "host_cache_registered_mb": self.registered_bytes / MB,
            "host_cache_refused_blocks": len(self.refused),
            "host_cache_refusal": self.refusal,
        }

    def close(self) -> None:
        """Unlock every page-locked image (call after the copies reading them finished)."""
        if self.pin:
            for image in self.images.values():
                unlock(image.buffer)
        self.images.clear()
        self.locked_bytes = 0


def weights_mode(
    blocks: list[Block], cache: HostCache, host_cache_mb: float | None, cuda: bool
) -> tuple[str, str]:
    """Which mode a run streams in, and why (the ``stagehand/step`` record's ``weights_mode``
    and ``weights_mode_reason``; the README's "Which mode a run is in"):

    - ``"host-cache"``: file-backed blocks, every frozen one within the cache's budget: read
      once, then copied from host memory;
    - ``"host-cache-partial"``: the budget holds only part of them; the rest is read from the
      files at every load (the reason gives both sizes);
    - ``"file-backed"``: file-backed blocks read from their files at every load (cache off, or
      every streamed block has trainable weights);
    - ``"module-backed"``: every block weight held in host memory by the module (no checkpoint
      folder, ``file_backed: false``, or trainable block weights), page-locked when registered.
    """
    files = [b for b in blocks if any(slot.key is not None for slot in b.layout)]
    if not files:
        locked = sum(1 for i in cache.images.values() if i.registered)
        how = f"{locked} of {len(blocks)} blocks' host weights in one image each"
        how += ", page-locked" if cache.pin else ""
        if host_cache_mb == 0:
            how = "no block image (host_cache_mb: 0): loads stage through the slabs"
        return "module-backed", f"no block weight is read from a checkpoint file; {how}"
    frozen = sum(b.staged_bytes for b in files if cacheable(b))
    if cache.budget <= 0:
        why = "host_cache_mb: 0" if host_cache_mb == 0 else "host_cache_mb not set"
        if host_cache_mb is None:
            why += " (auto: off on CPU)" if not cuda else " and no RAM above the margin"
        return "file-backed", f"{why}: every load reads its block from the files"
    if frozen == 0:
        return "file-backed", "every streamed block has trainable weights (never cached)"
    if cache.budget < frozen:
        return "host-cache-partial", (
            f"host cache of {cache.budget / MB:.0f} MB holds part of {frozen / MB:.0f} MB of "
            "frozen blocks; the rest is read from the files at every load"
        )
    return "host-cache", (
        f"{frozen / MB:.0f} MB of frozen blocks within the host cache's {cache.budget / MB:.0f} "
        "MB: read from the files once, then copied from host memory"
    )
