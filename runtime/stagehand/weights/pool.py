"""The pinned pool: uniform host slabs that stage block bytes for H2D copies.

Page-locked (CUDA), the whole pool is one allocation registered with ``cudaHostRegister`` at
set-up and sliced into slabs: exactly the requested bytes are locked (``pin_memory`` goes
through PyTorch's caching host allocator, which rounds every allocation up to a power of two:
an 800 MiB slab would lock 1 GiB, and keeps freed blocks cached). A pin that fails
(Windows/WSL cap pinned memory near half of RAM) fails at set-up with a clear error, or falls
back to pageable memory when the preset allows it (``allow_pageable_fallback``: copies then run
synchronously), never mid-step. Not pinned (CPU), slabs are allocated on first use (host RSS
grows only with what is used). Either way slabs are kept until ``close`` (never per load);
``close`` unregisters and frees the pool, so the memory goes back to the OS (the seed's bug 3:
release the stage-1 pool before the transformer loads). A slab is held from staging until its copy's event completes.
An acquire never waits forever: after ``timeout_s`` it raises ``SlabTimeoutError`` naming the
blocks that hold the slabs (a defect of the public implementation: no timeout).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stagehand.common.device import host_buffer, page_locked_buffer, unlock
from stagehand.config.memory import MB
from stagehand.weights.errors import PoolConfigError, SlabTimeoutError


@dataclass(eq=False)
class Slab:
    index: int
    buffer: torch.Tensor
    """uint8, ``slab_bytes`` long."""
    holder: str | None = None


class PinnedPool:
    """``pool_bytes // slab_bytes`` slabs of ``slab_bytes`` bytes each, page-locked on ``device``
    when ``pin``.

    Raises:
        PoolConfigError: a size is not positive, the pool would hold zero slabs, or it cannot be
            page-locked or mapped (``OSError`` included) and ``allow_pageable`` is False.
    """

    def __init__(
        self,
        pool_bytes: int,
        slab_bytes: int,
        *,
        pin: bool,
        timeout_s: float,
        allow_pageable: bool = False,
        device: torch.device | None = None,
    ) -> None:
        if pool_bytes <= 0 or slab_bytes <= 0:
            raise PoolConfigError(
                f"pinned_pool_mb and pinned_slab_mb must be positive, got {pool_bytes} and {slab_bytes} bytes"
            )
        self.slab_count = pool_bytes // slab_bytes
        if self.slab_count == 0:
            raise PoolConfigError(
                f"pinned_slab_mb ({slab_bytes / MB:g}) is larger than pinned_pool_mb "
                f"({pool_bytes / MB:g}): the pool would hold zero slabs"
            )
        self.slab_bytes = slab_bytes
        self.pool_bytes = self.slab_count * slab_bytes
        self.pin = pin
        self.device = device
        """The CUDA device whose runtime page-locks the pool (None: the current one)."""
        self.timeout_s = timeout_s
        self.slabs: list[Slab] = []
        self._free: list[Slab] = []
        self.closed = False
        self.locked_bytes = 0
        """Host bytes page-locked for the pool (all of it, or 0)."""
        self._locked: torch.Tensor | None = None
        if pin:
            self._pin_all(allow_pageable)

    def _pin_all(self, allow_pageable: bool) -> None:
        try:
            buffer = self._locked = page_locked_buffer(self.pool_bytes, self.device)
            self.locked_bytes = self.pool_bytes
        except RuntimeError as exc:
            if not allow_pageable:
                raise PoolConfigError(
                    f"could not page-lock the pinned pool ({self.pool_bytes / MB:g} MB, "
                    f"pinned_pool_mb): {exc}. Lower pinned_pool_mb, or set "
                    "allow_pageable_fallback: true to stage in pageable memory (H2D copies then "
                    "run synchronously)"
                ) from exc
            buffer = host_buffer(self.pool_bytes, pin=False)
            self.pin = False
        n = self.slab_bytes
        self.slabs = [Slab(i, buffer[i * n : (i + 1) * n]) for i in range(self.slab_count)]
        self._free = self.slabs[::-1]

    @property
    def allocated_bytes(self) -> int:
        """Host bytes the pool holds now (slabs allocated so far)."""
        return len(self.slabs) * self.slab_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of slabs held by a block."""
        return (len(self.slabs) - len(self._free)) * self.slab_bytes

    def try_acquire(self, holder: str) -> Slab | None:
        """A free slab for ``holder``, or None when all ``slab_count`` slabs are held."""
        if self.closed:
            raise RuntimeError("the pinned pool is closed")
        if self._free:
            slab = self._free.pop()
        elif len(self.slabs) < self.slab_count:
            slab = Slab(len(self.slabs), host_buffer(self.slab_bytes, pin=self.pin))
            self.slabs.append(slab)
        else:
            return None
        slab.holder = holder
        return slab

    def acquire(self, holder: str, reclaim: Callable[[], bool]) -> Slab:
        """A slab for ``holder``, calling ``reclaim`` (retire finished copies; True when it freed
        something) while none is free.

        Raises:
            SlabTimeoutError: none became free within ``timeout_s`` (names the holders).
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            slab = self.try_acquire(holder)
            if slab is not None:
                return slab
            if not reclaim():
                if time.monotonic() > deadline:
                    holders = ", ".join(
                        f"slab {s.index}: {s.holder}" for s in self.slabs if s.holder
                    )
                    raise SlabTimeoutError(
                        f"no free slab for {holder!r} after {self.timeout_s} s "
                        f"(slab_acquire_timeout_s); {self.slab_count} slabs held by: {holders}"
                    )
                time.sleep(0.001)

    def release(self, slab: Slab) -> None:
        slab.holder = None
        if not self.closed:
            self._free.append(slab)

    def close(self) -> None:
        """Free every slab and hand pinned memory back to the OS (seed bug 3: the pool is
        released before the next stage loads)."""
        self.closed = True
        for slab in self.slabs:
            slab.buffer = torch.empty(0, dtype=torch.uint8)
        self.slabs.clear()
        self._free.clear()
        if self._locked is not None:
            unlock(self._locked)
            self._locked, self.locked_bytes = None, 0
