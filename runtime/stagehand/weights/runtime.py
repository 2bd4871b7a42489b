"""WeightRuntime: a model's blocks stream through a pinned pool to the compute device.

Usage (standalone)::

    runtime = WeightRuntime(model, StagehandConfig(...), device="cuda", checkpoint_dir=folder)
    for step in range(steps):
        runtime.begin_step(step)                 # optional: NOTE [ Step boundaries ]
        with runtime.managed_forward():
            loss = loss_fn(model(**inputs))
        with runtime.managed_backward():
            loss.backward()
        with runtime.optimizer_context(optimizer):   # trainable params + state on the device
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        runtime.end_step()
    runtime.close()

A composed strategy builds one ``SavedTensorRouter([weights.packer, activations.packer])`` and
passes ``install_hooks=False``. See NOTE [ Block trace ] (scheduler.py), NOTE [ Eviction
policy ] (policy.py), NOTE [ Step boundaries ] (steps.py), NOTE [ Backward block boundaries ]
and NOTE [ Saved weight views ] (hooks.py). Source: the LTX-2 bf16 on 24 GB case study.

The runtime holds the lifecycle (set-up, steps, contexts, close) and applies the policy's
decisions (loads, evictions, counts and ``stagehand/block`` records); what to evict and prefetch
is decided in ``policy.py``, step boundaries in ``steps.py``, block boundaries in ``hooks.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from stagehand.common.device import uses_cuda
from stagehand.common.memory import DeviceMemory
from stagehand.common.saved_tensors import SavedTensorRouter
from stagehand.common.telemetry import Telemetry, default_telemetry
from stagehand.config.memory import MB, StagehandConfig, Watermarks
from stagehand.config.records import WEIGHTS_STEP
from stagehand.weights import policy
from stagehand.weights.convert import restore_blocks
from stagehand.weights.counts import StepCounts, Totals
from stagehand.weights.hooks import BlockBoundaries, SavedViews
from stagehand.weights.optimizer import refuse_unfrozen, trainable_on_device
from stagehand.weights.registry import Block, BlockState, find_blocks
from stagehand.weights.scheduler import BlockScheduler
from stagehand.weights.setup import open_host_side
from stagehand.weights.steps import StepBoundaries
from stagehand.weights.transfer import TransferEngine

TELEMETRY_FILE = "stagehand_telemetry.jsonl"
"""Where a runtime built without a ``Telemetry`` writes (working directory; ``Telemetry()``: nowhere)."""


class WeightRuntime:
    """Weight streaming for one model (see the module docstring).

    ``telemetry``: the run's stream; None writes ``TELEMETRY_FILE`` (closed with the runtime).

    Raises (at set-up): ``BlockDiscoveryError``, ``UnmatchedParameterError``,
    ``ParameterMismatchError``, ``BlockTooLargeError``, ``PoolConfigError``, ``ValueError``
    (watermarks, mode), all from ``stagehand.weights.errors``.
    """

    def __init__(
        self,
        model: nn.Module,
        config: StagehandConfig,
        *,
        device: torch.device | str,
        memory: DeviceMemory | None = None,
        telemetry: Telemetry | None = None,
        mode: Literal["training", "inference"] = "training",
        checkpoint_dir: str | Path | None = None,
    ) -> None:
        if mode not in ("training", "inference"):
            raise ValueError(f'mode must be "training" or "inference", got {mode!r}')
        self.device = torch.device(device)
        cuda = uses_cuda(self.device)
        found = find_blocks(model, config.block_pattern)
        vram = torch.cuda.get_device_properties(self.device).total_memory if cuda else 0
        self.model, self.mode = model, mode
        self._owns_memory = memory is None
        self.memory = memory if memory is not None else DeviceMemory(self.device)
        self._owns_telemetry = telemetry is None
        self.telemetry = telemetry if telemetry is not None else default_telemetry(TELEMETRY_FILE)
        self.conductor: Any | None = None
        self.window_grows = config.prefetch_window_blocks is None
        """The window follows the measured waits (NOTE [ Window growth ] in ``policy.py``): the
        preset left it to the runtime and no live limit has set it since."""
        self.high_mb = self.low_mb = None
        self.settle_due = False  # a watermark change (either runtime's) due at the next step begin
        self.set_watermarks(config.vram_high_watermark_mb, config.vram_low_watermark_mb)
        # Pipeline settings the preset left out, from the blocks and the card (defaults.py).
        host = open_host_side(model, found, config, self.device, cuda, vram, mode, checkpoint_dir)
        self.config = config = host.config
        self.pool, self.source, self.blocks = host.pool, host.source, host.blocks
        self.resident_bytes = host.resident_bytes
        self.squareq, self.cache = host.squareq, host.cache
        self.mode_reason = host.mode_reason
        """``(weights_mode, weights_mode_reason)`` of the ``stagehand/step`` records."""
        self.memory.track(self.resident_bytes, "weights")
        self.scheduler = BlockScheduler(config.prefetch_window_blocks)
        self.transfer = TransferEngine(
            self.device,
            self.pool,
            self.memory,
            self.source,
            config.max_inflight_transfers,
            reader_threads=config.reader_threads,
            reader_min_bytes=int(config.reader_min_block_mb * MB),
            cache=self.cache,
        )
        self._frozen = (
            []
            if mode == "inference"
            else [s for b in self.blocks for s in b.layout if not s.trainable]
        )
        """Block parameters frozen at set-up (``refuse_unfrozen``)."""
        self.views = SavedViews(self._ensure_loaded)
        self.views.frozen = not any(block.trainable for block in self.blocks)
        self.packer = self.views.pack
        """``SavedTensorRouter`` packer: a handle for views of loaded block weights, else None
        (NOTE [ Saved weight views ] in hooks.py)."""
        self.router = SavedTensorRouter([self.packer])
        self._active: set[int] = set()  # blocks between a use's begin and end
        self.steps = StepBoundaries(
            inference=mode == "inference",
            begin=partial(self._start, explicit=False),
            end=partial(self._end_step, detected=True),
        )
        self.phases = self.steps.phases
        """The step's phase (NOTE [ Step boundaries ] in steps.py)."""
        self.boundaries = BlockBoundaries(
            self.blocks,
            self._active,
            self.phases,
            training=mode == "training",
            forward_started=self.steps.forward,
            backward_started=self.steps.backward,
            use=self._use,
            done=self._done,
        )
        self.counts = StepCounts()
        self._last: dict[str, Any] = {}
        self._closed = False

    # -- knobs ----------------------------------------------------------------------------------
    def set_watermarks(self, high_mb: float, low_mb: float) -> None:
        """Set the VRAM watermarks (MB); a change after set-up re-derives the blocks kept at
        the next step begin (NOTE [ Live watermarks ] in ``policy.py``). Raises ``ValueError``
        naming the field at fault (``Watermarks``)."""
        marks = Watermarks(high_mb, low_mb)
        before, self.high_mb, self.low_mb = (self.high_mb, self.low_mb), marks.high_mb, marks.low_mb
        self.settle_due |= before[0] is not None and before != (self.high_mb, self.low_mb)

    def snapshot(self) -> dict[str, int]:
        """The knobs in force (the user's, under the Conductor's caps) for the Conductor's
        ``runtime_snapshots``."""
        return {
            "max_inflight": self.transfer.inflight_limit,
            "prefetch_window": self.scheduler.window,
        }

    # -- steps ----------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Open step ``step`` (closing a step still open) and prefetch its first blocks."""
        if self.steps.open:
            self.end_step()
        self._start(step, explicit=True)

    @property
    def step(self) -> int | None:
        """The open (or last) step's number."""
        return self.steps.step

    def _start(self, step: int, explicit: bool) -> None:
        self.steps.enter_step(step, explicit)
        self.transfer.back.refuse_lost_writes()
        self.counts = StepCounts(at_begin=self._totals())
        if self._owns_memory:
            self.memory.reset_peak()
        self.telemetry.step = step  # a composed strategy sets the same number
        if self.settle_due:  # NOTE [ Live watermarks ] in policy.py: a trace step, as at a start
            self.settle_due = False
            for block in policy.evictable(self.blocks, ()):
                self._evict(block, reason="limits")
            self.scheduler.retrace()
            if self.window_grows:
                self.scheduler.prefetch_window = self.config.prefetch_window_blocks
        self._prefetch()

    def end_step(self) -> None:
        """Close the step: finish backward leftovers, close the trace, write ``stagehand/step``;
        every copy back to host masters is complete when it returns (the user's code runs next
        and may read them)."""
        self._end_step(detected=False)

    def _end_step(self, detected: bool) -> None:
        """``end_step``; ``detected``: closed by the next step's first block (no ``end_step``
        call, NOTE [ Step boundaries ]): the user's code between the steps has already run, so
        frozen weights' copies back stay in flight, each waited for by its block's next load
        (a host wait here, in a forward, would stall the host behind the copy engine)."""
        if not self.steps.open:
            return
        self.boundaries.finish()
        self.transfer.back.synchronize(frozen=not detected)
        steady = self.scheduler.traced  # and the order unchanged (not ``traced``) at its end
        traced = self.scheduler.end_step()
        self.steps.leave_step()
        counts = self.counts
        counts.copy_waits, counts.copy_wait_ms = self.transfer.compute_waits.collect(not detected)
        window = self.scheduler.prefetch_window
        mem = self.memory.snapshot()
        self._last = {
            **self.counts.record(self._totals()),
            **mem,
            "pool_used_mb": self.pool.used_bytes / MB,
            "pool_total_mb": self.pool.pool_bytes / MB,
            "pool_allocated_mb": self.pool.allocated_bytes / MB,
            "pool_locked_mb": self.pool.locked_bytes / MB,
            "vram_high_watermark_mb": self.high_mb,
            "vram_low_watermark_mb": self.low_mb,
            "prefetch_window_blocks": window,  # the user's setting (or the grown one)
            **self.cache.record(*self.mode_reason),
            "trace_updated": traced,
            "step_time_ms": (time.perf_counter() - self.phases.step_started) * 1e3,
        }
        self.telemetry.emit(*WEIGHTS_STEP, **self._last)
        if self.window_grows and steady and not traced:
            grown = policy.grown_window(window, counts.copy_waits, len(self.blocks))
            self.scheduler.prefetch_window = grown
        self.squareq.emit(self.telemetry)  # SquareQ's ``squareq/step``, when it is on
        self._prefetch()  # the next step's first blocks (cursor is at the order's start)
        # The user's code runs next and may write weights (CopyBack.expose).
        self.transfer.back.expose(self.blocks, partial(self._ready, grads=False))

    def counters(self) -> dict[str, int]:
        """Work of the open step (the last one between steps): ``blocks_loaded``,
        ``blocks_evicted``, ``prefetch_hits``, ``prefetch_misses``, ``file_reads`` (tensors read
        from the safetensors files), ``h2d_bytes`` (bytes copied to the device),
        ``resident_blocks`` (on the device now; ``stagehand/step``: at the step's end),
        ``pageable_copies`` and ``host_waits`` (``stagehand.strategy.base.COUNTERS``)."""
        return self.counts.counters(self._totals())

    def _totals(self) -> Totals:
        return Totals.read(self.source, self.transfer, self.cache, self.blocks)

    def step_metrics(self) -> dict[str, Any]:
        """The last closed step's ``stagehand/step`` fields (docs/contracts.md)."""
        return dict(self._last)

    # -- contexts -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def managed_forward(self, install_hooks: bool = True) -> Iterator[None]:
        """Forward under the saved-tensor router (skip with ``install_hooks=False`` when a
        composed strategy installs one router with this runtime's ``packer`` first)."""
        with self.router.hooks() if install_hooks else contextlib.nullcontext():
            yield

    @contextlib.contextmanager
    def managed_backward(self) -> Iterator[None]:
        """Backward; on exit, unfinished blocks are finished and the copies back the host reads
        (gradients, trainable weights) waited on."""
        yield
        self.boundaries.finish()
        self.transfer.back.synchronize(frozen=False)

    def optimizer_context(
        self, optimizer: torch.optim.Optimizer | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Trainable block parameters, their gradients and optimizer state on the compute device
        for ``optimizer.step()``, back to their host masters after (the seed's bug 6)."""
        refuse_unfrozen(self._frozen)
        self.transfer.back.synchronize(frozen=False)
        for block in self.blocks:
            if block.state is BlockState.PREFETCHING:
                self._ready(block)
            elif block.state is BlockState.GPU_READY:  # loaded by a forward use only
                self.transfer.grads_to_device(block)
        return trainable_on_device(self.blocks, self.device, self.memory, optimizer)

    # -- scheduling: the policy's decisions applied (policy.py) ----------------------------------
    def _use(self, block: Block, direction: str) -> None:
        self.scheduler.record_use(block.index, recompute=direction == "recompute")
        self._active.add(block.index)
        self._emit_block("enter", block, direction=direction)
        self._ensure(block, grads=direction == "backward")  # TransferEngine.ready's grads
        self._prefetch()

    def _ensure(self, block: Block, grads: bool = True) -> None:
        if block.state is BlockState.GPU_READY:
            self._count_hit(block)
            if grads:
                self.transfer.grads_to_device(block)
            return
        t0 = time.perf_counter()
        miss = block.state is BlockState.UNLOADED
        if miss:
            self.counts.prefetch_misses += 1
            self._apply(policy.room_for_use, block, self.high_mb * MB)
            self.transfer.load(block, speculative=False)
            self.counts.blocks_loaded += 1
            self._emit_block("load", block, prefetch=False)
        else:
            self._count_hit(block)
        self._ready(block, grads, measured=not miss)
        # Host time the compute waited: a demand load (on CUDA a prefetched block's event wait
        # is on the device and costs the host nothing).
        stall_ms = (time.perf_counter() - t0) * 1e3
        self.counts.stall_time_ms += stall_ms
        if miss:
            self._emit_block("stall", block, stall_ms=stall_ms)

    def _count_hit(self, block: Block) -> None:
        if block.prefetched:
            self.counts.prefetch_hits += 1
            block.prefetched = False

    def _ready(self, block: Block, grads: bool = True, measured: bool = False) -> None:
        self.transfer.ready(block, grads, measured)
        self.views.add(block)

    def _prefetch(self) -> None:
        if not policy.prefetch(self.scheduler, self.blocks, self._make_room, self._load_ahead):
            self.counts.prefetch_skipped += 1

    def _apply(self, rule: Any, *args: Any) -> Any:  # a loop of policy.py on this runtime
        usage = self.memory.usage_bytes
        return rule(self.scheduler, self.blocks, self._active, *args, usage, self._evict)

    def _make_room(self, block: Block) -> bool:
        """Whether ``block`` fits under the high watermark (``policy.make_room``)."""
        return self._apply(policy.make_room, block, self.high_mb * MB)

    def _load_ahead(self, block: Block) -> bool:
        """Issue ``block``'s speculative load under the Conductor's grant; False when not issued
        (no grant, no slab or copy slot)."""
        grant = None
        if self.conductor is not None:
            grant = self.conductor.request_transfer("h2d", "speculative")
            if not grant.granted:
                return False
        if not self.transfer.load(block, speculative=True, grant=grant):
            if grant is not None:
                grant.release()
            return False
        block.prefetched = True
        self.counts.blocks_loaded += 1
        self._emit_block("load", block, prefetch=True)
        return True

    def _done(self, block: Block, direction: str) -> None:
        self._emit_block("exit", block, direction=direction)
        self._active.discard(block.index)
        self._apply(policy.release_after_use, self.high_mb * MB, self.low_mb * MB)
        self._prefetch()

    def _evict(self, block: Block, **fields: Any) -> None:
        self.views.discard(block)
        self.transfer.evict(block)
        self.counts.blocks_evicted += 1
        self._emit_block("evict", block, **fields)

    # -- policy hooks (layer offload: runtime/stagehand/layer_offload) ------------------------------------
    def make_resident(self, indices: Iterable[int]) -> None:
        """Load blocks ``indices`` now and keep them on the device until ``close``: a resident
        block is never evicted after a use, by the watermarks or by ``evict_stale``.

        Raises:
            IndexError: an index is not a block.
        """
        for index in indices:
            block = self.blocks[index]
            block.resident = True
            if block.state is BlockState.UNLOADED:
                self.transfer.load(block, speculative=False)
                self._emit_block("load", block, prefetch=False, resident=True)
            if block.state is BlockState.PREFETCHING:
                self._ready(block)

    def evict_stale(self, keep: Iterable[int]) -> list[int]:
        """Evict every loaded, non-resident block outside ``keep`` and the prefetch window: a
        block whose end boundary never fired (a non-reentrant checkpoint recomputation that
        stopped early, an exception mid-block). Returns the evicted indices; each eviction is a
        ``stagehand/block`` ``evict`` record with ``reason: "stale"``."""
        keep = set(keep) | {b.index for b in policy.window(self.scheduler, self.blocks)}
        stale = policy.evictable(self.blocks, (), keep)
        for block in stale:
            self._active.discard(block.index)
            self._evict(block, reason="stale")
        return [b.index for b in stale]

    # -- saved weight views ---------------------------------------------------------------------
    def _ensure_loaded(self, block: Block) -> None:
        if block.state is not BlockState.GPU_READY:
            self._ensure(block)

    # -- telemetry ------------------------------------------------------------------------------
    def _emit_block(self, event: str, block: Block, **fields: Any) -> None:
        if self.config.block_events:
            allocated, reserved = self.memory.allocated_and_reserved()
            self.telemetry.emit(
                "stagehand",
                "block",
                event=event,
                block=block.index,
                block_name=block.name,
                vram_allocated_mb=allocated / MB,
                vram_reserved_mb=reserved / MB,
                vram_source=self.memory.source,
                **fields,
            )

    # -- teardown -------------------------------------------------------------------------------
    def close(self, restore: bool = True) -> None:
        """Remove the hooks, free the pinned pool and every block buffer (seed bug 3). With
        ``restore`` the block parameters become ordinary tensors on the device again (read from
        their host master or checkpoint); without it file-backed ones stay empty."""
        if self._closed:
            return
        self.end_step()
        self.boundaries.remove()
        for block in self.blocks:
            if block.on_device:
                self._evict(block)
        self.transfer.drain()  # no slab may be freed while a copy still reads it
        self.transfer.close()
        if restore:
            restore_blocks(self.blocks, self.source, self.device)
        self.pool.close()
        if self.cache.pin:  # restore's copies read the images: done before they are unlocked
            torch.cuda.synchronize(self.device)
        self.cache.close()
        if self.source is not None:
            self.source.close()
        self.memory.untrack(self.resident_bytes, "weights")
        self.views.clear()
        if self._owns_telemetry:
            self.telemetry.close()
        self._closed = True
