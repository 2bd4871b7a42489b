"""Watermark pressure with hysteresis: spill from the high watermark until under the low one.

Source: "Activation Stagehand" ("Check VRAM pressure ... against the high
watermark"; config ``vram_high_watermark_mb`` / ``vram_low_watermark_mb``). VRAM is read like
the weight runtime reads it, through the shared ``DeviceMemory.usage_bytes()``: CUDA allocator
figures on GPU, tracked bytes on CPU (where kept saved tensors are tracked, so spilling lowers
the figure).

On CUDA ``usage_bytes`` reads the allocator statistics (tens of microseconds), too slow for a
pack hook that runs for every saved tensor. Between reads the manager estimates usage as the last
reading plus the bytes saved since (saved tensors are mostly fresh allocations, so the estimate
errs towards spilling) and reads again every ``refresh_packs`` packs or ``refresh_bytes`` bytes.
On CPU a reading is one attribute, so it reads every time.
"""

from __future__ import annotations

from stagehand.common.memory import DeviceMemory
from stagehand.config.memory import MB, Watermarks


class ActivationBudgetManager:
    """Decides, per saved tensor, whether VRAM pressure calls for a spill."""

    def __init__(
        self,
        memory: DeviceMemory,
        high_mb: float,
        low_mb: float,
        *,
        refresh_packs: int | None = None,
        refresh_bytes: int = 16 * MB,
    ) -> None:
        self.memory = memory
        self.high_bytes = 0
        self.low_bytes = 0
        self.set_watermarks(high_mb, low_mb)
        self.refresh_packs = (
            refresh_packs if refresh_packs is not None else (32 if memory.is_cuda else 1)
        )
        self.refresh_bytes = refresh_bytes
        self.spilling = False
        """Hysteresis state: True from crossing the high watermark until under the low one."""
        self._reading = 0
        self._since_packs = 0
        self._since_bytes = 0
        self._read = memory.usage_bytes
        if self.refresh_packs == 1:  # two calls less on the per-tensor path (CPU)
            self.usage_bytes = self._usage_now
            self.pressure = self._pressure_now

    def set_watermarks(self, high_mb: float, low_mb: float) -> None:
        """Change the watermarks (MB).

        Raises:
            ValueError: a negative or non-numeric watermark, or the low one above the high one
                (``Watermarks``' rule).
        """
        marks = Watermarks(high_mb, low_mb)
        self.high_mb, self.low_mb = marks.high_mb, marks.low_mb
        self.high_bytes = int(self.high_mb * MB)
        self.low_bytes = int(self.low_mb * MB)

    def reset(self) -> None:
        """Start of a step: take a fresh reading, keep spilling only if still over the mark."""
        self._reading = self.memory.usage_bytes()
        self._since_packs = self._since_bytes = 0
        self.spilling = self._reading >= self.high_bytes

    def usage_bytes(self, nbytes: int = 0, pending: int = 0) -> int:
        """Current (estimated on CUDA) usage in bytes, counting ``nbytes`` just saved and
        ``pending`` bytes the caller has not yet reported to ``DeviceMemory``."""
        self._since_packs += 1
        self._since_bytes += nbytes
        if self._since_packs >= self.refresh_packs or self._since_bytes >= self.refresh_bytes:
            self._reading = self._read()
            self._since_packs = self._since_bytes = 0
        return self._reading + self._since_bytes + pending

    def _usage_now(self, nbytes: int = 0, pending: int = 0) -> int:
        return self._read() + pending

    def pressure(self, nbytes: int = 0, pending: int = 0) -> bool:
        """True when the tensor of ``nbytes`` being saved should spill (hysteresis applied).

        At or above the high watermark spilling starts; below the low one it stops. A high
        watermark of 0 therefore spills every eligible tensor.
        """
        usage = self.usage_bytes(nbytes, pending)
        if usage >= self.high_bytes:
            self.spilling = True
        elif usage < self.low_bytes:
            self.spilling = False
        return self.spilling

    def _pressure_now(self, nbytes: int = 0, pending: int = 0) -> bool:
        """``pressure`` reading every time (``refresh_packs == 1``), inlined."""
        usage = self._read() + pending
        if usage >= self.high_bytes:
            self.spilling = True
        elif usage < self.low_bytes:
            self.spilling = False
        return self.spilling
