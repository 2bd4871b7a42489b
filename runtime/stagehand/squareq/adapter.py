"""The Conductor's third adapter (the seed's ``SquareQConductorAdapter``: "reports pinned usage
(no knobs v0)").

SquareQ has no knob the Conductor tunes: its copies are the weight runtime's block loads (that
runtime's adapter caps them). What it adds to the budgets is reserved when it attaches, under
the owner ``"squareq"``:

- VRAM: the device staging of its dequantization, one image per H2D copy in flight (``max
  inflight x largest image``; NOTE [ Dequant staging ] in ``image.py``): a FLOOR reservation, so
  the soft and hard caps leave that room to it;
- pinned host memory: none of its own. Its images are staged in the weight runtime's slabs
  (reserved by that runtime) and held in its host cache (sized from RAM, ``host_cache_mb``);
  ``snapshot`` reports those bytes (``pinned_image_mb``) so the run's records show them.

It implements the protocol of ``stagehand.conductor.adapter.ConductorAdapter`` (attach, detach,
on_phase, reclaim, snapshot, base_prefetch_window) without importing it: SquareQ sits below
the runtimes (``tests/test_layers.py``), so the weight runtime can stage its images.
"""

from __future__ import annotations

from typing import Any

from stagehand.config.memory import MB


class SquareQConductorAdapter:
    """Reserves SquareQ's device staging with the Conductor and reports its bytes.

    ``squareq``: the weight runtime's ``SquareQ``; ``runtime``: that ``WeightRuntime`` (its
    host cache and in-flight limit).

    Raises (on ``attach``): ``RuntimeError`` when attached twice.
    """

    name = "squareq"
    OWNER = "squareq"

    def __init__(self, squareq: Any, runtime: Any) -> None:
        self.squareq, self.runtime = squareq, runtime
        self.conductor: Any = None
        self.reservation: Any = None

    @property
    def attached(self) -> bool:
        return self.conductor is not None

    def staging_bytes(self) -> int:
        """Device bytes of dequant staging at most: one image per H2D copy in flight."""
        return self.runtime.transfer.max_inflight * self.squareq.largest_image

    def attach(self, conductor: Any) -> None:
        if self.attached:
            raise RuntimeError(f"{type(self).__name__} is already attached")
        self.conductor = conductor
        self.reservation = conductor.reserve(
            "vram", self.staging_bytes() / MB, mode="floor", priority="required", owner=self.OWNER
        )

    def detach(self) -> None:
        if not self.attached:
            return
        if self.reservation is not None:
            self.reservation.release()
        self.conductor = self.reservation = None

    def on_phase(self, phase: Any, hints: Any) -> None:
        """No knobs (v0): nothing to publish."""

    def reclaim(self, direction: str) -> None:
        """Holds no transfer slot (its copies are the weight runtime's)."""

    def base_prefetch_window(self) -> int | None:
        return None

    def snapshot(self) -> dict[str, Any]:
        """Its bytes: format, device staging reserved, images in the host cache (pinned on
        CUDA), the images' share of the compute-dtype blocks, and the dequantization so far."""
        cache = self.runtime.cache
        in_cache = sum(
            image.buffer.numel()
            for index, image in cache.images.items()
            if self.runtime.blocks[index].image is not None
        )
        nbytes, blocks, ms = self.squareq.timer.totals()
        return {
            "format": self.squareq.format,
            "staging_mb": self.staging_bytes() / MB,
            "staging_reserved": bool(self.reservation is not None and self.reservation.granted),
            "pinned_image_mb": in_cache / MB if cache.pin else 0.0,
            "host_image_mb": in_cache / MB,
            "image_ratio": self.squareq.image_bytes / max(self.squareq.block_bytes, 1),
            "bytes_dequantized": nbytes,
            "dequant_ms": ms,
        }
