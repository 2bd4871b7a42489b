"""Discrete-event simulation of training steps under the weight runtime's own schedule.

The simulation walks the use order the weight runtime traces (NOTE [ Block trace ]: forward
blocks in order, then their backward in reverse; a checkpoint recomputation is part of its
block's backward use) through a real ``BlockScheduler`` and the runtime's own prefetch and
eviction policy (``prefetch``, ``make_room``, ``release_after_use`` in
``runtime/stagehand/weights/policy.py``), and the activation runtime's spill decision
(``ActivationBudgetManager.pressure``, hysteresis included) against a simulated
``DeviceMemory`` reading. What it adds is the clock: compute from FLOPs at the
profile's TFLOPs times an efficiency, H2D copies at the profile's bandwidth on one copy engine
with ``max_inflight_transfers`` slots and the pool's slabs, synchronous on a CPU device.

# NOTE [ Where a load's bytes come from ]
On a GPU a block load is one of (``StepResult.loads_by_source``):

- ``host_cache``: the block has a pinned image in the host cache (``runtime/stagehand/weights/host_cache.py``:
  a file-backed frozen block's image is made by its first load while the cache's budget holds;
  module-backed blocks are registered at set-up): one H2D copy at ``h2d_gbps``;
- ``page_cache`` / ``disk``: a file-backed block without an image is read by the reader threads
  into a pinned slab, then copied: two stages, the reads on their own timeline at
  ``read_gbps`` (the page cache, the default) or ``disk_gbps`` (``--disk-gbps``: the files come
  from storage), each copy starting when its read is done and the copy engine is free. Reads of
  later blocks overlap earlier copies, so a long run of loads goes at the slower of the two.

The plan's ``source_mode`` names the mode of the steady step's loads. A CPU device keeps its
calibrated model (one synchronous copy, plus ``disk_gbps`` per file-backed byte).

Device bytes follow the runtime's accounting: resident bytes, the buffers of loaded blocks, and
activations. On a CPU device (``tracked``) activations count only when the activation runtime
keeps them (it is what tracks them); on a GPU every kept activation is in VRAM.

Layer offload (``memory.strategy: "layer_offload"``) runs the same walk with the layer-offload
runtime's own policy: its settings (``section_for``: slab, pool, window, watermarks, the
activation runtime's), its resident set (``resident_count``: the first blocks, never evicted)
and its fixed layer order (``LayerOrderScheduler``, no trace step); a checkpointed layer saves
the tensors its wrapper passes as checkpoint inputs (``BlockInfo.checkpoint_inputs``).

Activations are counted as the activation runtime counts them (``backend/workbench/plan/sim_activations.py``,
NOTE [ Tracked activations in the plan ]): a checkpointed block's inputs as it is entered, before
its use, each storage once; on a CPU device reported to the weight runtime in batches.

# NOTE [ The Conductor at a step's end ]
A composed strategy ends its parts in reverse order, the Conductor last: the weight runtime's
prefetch at a step's end (the next step's first blocks) runs under the Conductor's optimizer
protection (``runtime/stagehand/conductor/policy.py``, rule 2: no speculative transfer), is refused, and is
issued at the next step's begin, once the Conductor has reset its hints. The simulation does the
same, so those loads count in the step that makes them: after the trace step of the tiny FLUX.1-dev
preset row, 71 and 31 loads instead of 73 and 29. Otherwise not modelled: the Conductor's grants
(its slots only delay prefetch), its backward pressure and contention rules, the CUDA allocator's
fragmentation and workspaces (the peak is of allocated bytes), the time of activation spills and
restores on a GPU (their side-stream copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stagehand.config.memory import MB, MemoryConfig
from stagehand.layer_offload.schedule import LayerOrderScheduler, resident_count
from stagehand.weights.policy import (
    grown_window,
    make_room,
    prefetch,
    release_after_use,
    room_for_use,
)
from stagehand.weights.scheduler import BlockScheduler
from workbench.plan.inventory import BlockInfo, Inventory
from workbench.plan.profiles import DeviceProfile
from workbench.plan.result import StepResult
from workbench.plan.sections import weight_section
from workbench.plan.sim_activations import Activations
from workbench.plan.sources import host_cache_budget


class _Memory:
    """The ``DeviceMemory`` face the activation budget reads (tracked bytes)."""

    is_cuda = False

    def __init__(self) -> None:
        self.used = 0

    def usage_bytes(self) -> int:
        return self.used


@dataclass
class _Block:
    index: int
    info: BlockInfo
    on_device: bool = False
    ready_at: float = 0.0
    prefetched: bool = False
    resident: bool = False
    cached: bool = False
    """Has a pinned image in the host cache (NOTE [ Where a load's bytes come from ])."""

    staged: int = 0
    """Bytes staged, cached and copied per load: the 8-bit image with SquareQ, else ``nbytes``."""

    @property
    def nbytes(self) -> int:
        return self.info.nbytes


class Simulation:
    """One model, one memory section, one device profile (see the module docstring)."""

    def __init__(
        self, inv: Inventory, memory: MemoryConfig, profile: DeviceProfile, *, efficiency: float
    ) -> None:
        self.inv, self.memory, self.profile = inv, memory, profile
        self.eff = efficiency
        self.tracked = profile.tracked
        self.mem = _Memory()
        self.layer_offload = memory.strategy == "layer_offload"
        sh = weight_section(inv, memory, profile)
        self.streaming = (
            self.layer_offload or memory.strategy == "stagehand" and sh.weight_streaming
        )
        self.gc = memory.gradient_checkpointing
        act = sh.activation_stagehand if sh is not None else None
        # Layer offload always builds the activation runtime (a training step).
        self.act = act if act is not None and (act.enabled or self.layer_offload) else None
        squareq = memory.squareq_format() is not None
        self.blocks = [
            _Block(i, b, staged=b.image_bytes if squareq else b.nbytes)
            for i, b in enumerate(inv.blocks)
        ]
        self.step_open = False
        if self.layer_offload:
            n = len(self.blocks)
            for block in self.blocks[: resident_count(memory.layer_offload_fraction, n)]:
                block.resident = block.on_device = True
            self.scheduler = LayerOrderScheduler(
                n,
                sh.prefetch_window_blocks,
                training=True,
                blocks=self.blocks,
                step_open=lambda: self.step_open,  # nothing is loaded ahead between steps
            )
        elif self.streaming:
            self.scheduler = BlockScheduler(sh.prefetch_window_blocks)
        cond = sh.conductor_config if sh is not None else None
        self.conductor = self.streaming and not self.layer_offload and bool(cond and cond.enabled)
        """The Conductor refuses the prefetch at a step's end (NOTE [ The Conductor at a step's
        end ])."""
        self.window_grows = (
            self.streaming
            and not self.layer_offload
            and memory.stagehand.prefetch_window_blocks is None
        )
        if self.streaming:
            self.high, self.low = sh.vram_high_watermark_mb * MB, sh.vram_low_watermark_mb * MB
            self.max_inflight = sh.max_inflight_transfers
            self.slab_bytes = sh.pinned_slab_mb * MB
            self.slabs = sh.pinned_pool_mb // sh.pinned_slab_mb
            self.file_backed = sh.file_backed
            self.cache_left = host_cache_budget(inv, memory, profile)
            if not self.file_backed and not self.tracked:  # registered at set-up
                for block in self.blocks:
                    block.cached = block.info.frozen and self._take_image(block)
        self.read_free = 0.0
        self.count_acts = self.act is not None or not self.tracked or not self.streaming
        # A non-reentrant checkpoint's recomputation saves its tensors through its own
        # (innermost) saved-tensor hooks: no runtime sees them, so on CPU nothing tracks them;
        # on a GPU they are in VRAM until the block's backward ends.
        self.count_recompute = not self.tracked
        self.active: set[int] = set()
        self.copies: list[tuple[float, bool]] = []  # (done at, holds a slab)
        self.h2d_free = 0.0
        self.now = 0.0
        self.acts = Activations(self, self.act, self.tracked)

    # -- bytes ------------------------------------------------------------------------------------
    def _add(self, nbytes: int, label: str) -> None:
        self.mem.used += nbytes
        r = self.result
        r.peak_bytes = max(r.peak_bytes, self.mem.used)
        r.curve.append((round(self.now, 4), self.mem.used, label))

    # -- weights ----------------------------------------------------------------------------------
    def _evict(self, block: _Block) -> None:
        block.on_device = block.prefetched = False
        self._add(-block.nbytes, f"evict {block.info.name}")

    def _take_image(self, block: _Block) -> bool:
        if not block.info.frozen or block.staged > self.cache_left:
            return False
        self.cache_left -= block.staged
        return True

    def _source(self, block: _Block) -> str:
        if self.tracked:
            return "tracked"
        if block.cached or not self.file_backed:
            return "host_cache"
        return "disk" if self.profile.disk_gbps else "page_cache"

    def _copy_ms(self, block: _Block) -> float:
        p = self.profile
        ms = block.staged / (p.h2d_gbps * 1e9) * 1e3 + p.load_us * 1e-3
        if self.file_backed and p.disk_gbps:
            ms += block.staged / (p.disk_gbps * 1e9) * 1e3
        return ms

    def _load(self, block: _Block, speculative: bool) -> bool:
        self.copies = [c for c in self.copies if c[0] > self.now]
        if speculative and len(self.copies) >= self.max_inflight:
            return False
        slab = block.staged <= self.slab_bytes
        if speculative and slab and sum(1 for c in self.copies if c[1]) >= self.slabs:
            return False
        r = self.result
        source = self._source(block)
        r.loads_by_source[source] = r.loads_by_source.get(source, 0) + 1
        r.h2d_bytes += block.staged
        r.blocks_loaded += 1
        self.loaded.add(block.index)
        if self.profile.synchronous_copies:
            # A CPU "device": the copy runs on the host, in line with compute.
            ms = self._copy_ms(block)
            r.h2d_ms += ms
            self.now += ms
            r.exposed_h2d_ms += ms
            block.ready_at = self.now
        else:
            p = self.profile
            start = self.now
            if source in ("page_cache", "disk"):  # read into a slab first (the NOTE)
                rate = p.disk_gbps if source == "disk" else p.read_gbps
                start = max(start, self.read_free) + block.staged / (rate * 1e9) * 1e3
                self.read_free = start
                r.read_bytes += block.staged
                block.cached = self._take_image(block)
            ms = block.staged / (p.h2d_gbps * 1e9) * 1e3 + p.load_us * 1e-3
            r.h2d_ms += ms
            self.h2d_free = block.ready_at = max(start, self.h2d_free) + ms
            self.copies.append((block.ready_at, slab))
        block.on_device = True
        self._add(block.nbytes, f"load {block.info.name}")
        return True

    def _prefetch(self) -> None:
        prefetch(self.scheduler, self.blocks, self._make_room, self._load_ahead)

    def _make_room(self, block: _Block) -> bool:
        usage = self.mem.usage_bytes
        return make_room(
            self.scheduler, self.blocks, self.active, block, self.high, usage, self._evict
        )

    def _load_ahead(self, block: _Block) -> bool:
        if not self._load(block, speculative=True):
            return False
        block.prefetched = True
        return True

    def _use(self, block: _Block) -> None:
        self.scheduler.record_use(block.index)
        self.active.add(block.index)
        if not block.on_device:
            self.result.misses += 1
            usage = self.mem.usage_bytes
            room_for_use(
                self.scheduler, self.blocks, self.active, block, self.high, usage, self._evict
            )
            self._load(block, speculative=False)
        if block.ready_at > self.now:
            self.result.waits += 1
            self.result.copy_waits += block.prefetched
            self.result.stall_ms += block.ready_at - self.now
            self.result.exposed_h2d_ms += block.ready_at - self.now
            self.now = block.ready_at
        block.prefetched = False  # used: no longer loaded ahead (NOTE [ Prefetch window ])
        self._prefetch()

    def _done(self, block: _Block) -> None:
        self.active.discard(block.index)
        usage = self.mem.usage_bytes
        release_after_use(
            self.scheduler, self.blocks, self.active, self.high, self.low, usage, self._evict
        )
        self._prefetch()

    # -- activations (``backend/workbench/plan/sim_activations.py``) ------------------------------------------------
    def _save(self, segment: Any, sizes: list[int]) -> None:
        if self.count_acts:
            self.acts.save(segment, sizes)

    def _compute(self, flops: float, ops: float = 0, moved: float = 0) -> None:
        p = self.profile
        ms = flops / (p.tflops * 1e12 * self.eff) * 1e3 + ops * p.op_us * 1e-3
        if p.mem_gbps:
            ms += moved / (p.mem_gbps * 1e9) * 1e3
        self.now += ms
        self.result.compute_ms += ms

    def _forward_saved(self, info: BlockInfo) -> list[int]:
        """The sizes of what the block's forward saves for backward: its checkpoint inputs when
        checkpointed (layer offload's wrapper: the tensors it passes positionally; diffusers'
        checkpointing: the block's tensor arguments, each counted once), else every saved
        activation."""
        if not self.gc:
            return info.saved
        return info.checkpoint_inputs if self.layer_offload else info.saved_inputs

    # Each pass reads the block's weights once (its GEMMs' weight operands): with few tokens
    # that, not the FLOPs, bounds a matrix product.
    def _forward(self, info: BlockInfo) -> None:
        self._compute(info.forward_flops, info.forward_ops, info.forward_moved + info.nbytes)

    def _backward(self, info: BlockInfo) -> None:
        f, o, m = self.inv.backward_ratio
        moved = info.forward_moved * m + info.nbytes
        self._compute(info.forward_flops * f, info.forward_ops * o, moved)

    # -- one step -----------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Simulate one step; the scheduler's trace carries over to the next call."""
        self.result = r = StepResult()
        self.step_open = True  # as the runtime's StepBoundaries.open (NOTE [ Layer-order window ])
        self.loaded: set[int] = set()
        on_device = {b.index for b in self.blocks if b.on_device}
        t0 = self.now
        r.window = self.scheduler.window if self.streaming else 0
        self.acts.begin_step()
        r.curve.append((0.0, self.mem.used, "step"))
        r.peak_bytes = self.mem.used  # a new peak window starts at the usage in force
        if self.conductor:  # the prefetch its optimizer protection refused at the last step's end
            self._prefetch()
        inv = self.inv
        self._save("pre", inv.saved_pre)
        r_f, r_o, r_m = inv.backward_ratio
        outside = (inv.outside_flops / 2, inv.outside_ops / 2, inv.outside_moved / 2)
        self._compute(*outside)
        first_use = self.now
        for block in self.blocks:  # forward
            if self.gc:  # a checkpoint saves its inputs as it is entered, before the block
                self._save(block.index, self._forward_saved(block.info))
            if self.streaming:
                self._use(block)
            self._forward(block.info)
            if not self.gc:
                self._save(block.index, self._forward_saved(block.info))
            if self.streaming:
                self._done(block)
        self._save("post", inv.saved_post)
        self._compute(*outside)
        self._compute(outside[0] * 2 * r_f, outside[1] * 2 * r_o, outside[2] * 2 * r_m)
        self.acts.free("post")
        for block in reversed(self.blocks):  # backward (a recomputation is part of the use)
            if self.streaming:
                self._use(block)
            self.acts.restore(block.index)
            if self.gc:
                self._forward(block.info)
                if self.count_recompute:  # saved in backward, needed at once: kept
                    self._add(block.info.saved_bytes, f"recompute {block.info.name}")
            self._backward(block.info)
            if self.gc and self.count_recompute:
                self._add(-block.info.saved_bytes, f"backward {block.info.name}")
            self.acts.free(block.index)
            if self.streaming:
                self._done(block)
        last_use = self.now
        self.acts.free("pre")
        self.acts.end_step()
        if self.streaming:
            traced = self.scheduler.traced
            steady = not self.scheduler.end_step() and traced  # the same order before and after
            self.step_open = False
            if self.window_grows and steady:  # NOTE [ Window growth ], where the runtime does
                sched = self.scheduler
                sched.prefetch_window = grown_window(
                    sched.prefetch_window, r.copy_waits, len(self.blocks)
                )
            if not self.conductor:
                self._prefetch()
        r.step_ms = self.now - t0
        if self.streaming:
            r.streamed_blocks = len(self.loaded)
            stayed = on_device - self.loaded
            r.resident_block_bytes = sum(self.blocks[i].nbytes for i in stayed)
        band = [b for t, b, _ in r.curve[1:] if first_use <= t <= last_use]
        r.low_bytes = min(band, default=self.mem.used)
        return r

    def run(self, steps: int = 3) -> list[StepResult]:
        """Steps from a cold start: step 0 traces (every block a demand load), the rest follow
        the trace; the last is the steady state. Curve times are relative to each step. A window
        that grows (NOTE [ Window growth ]) adds steps until two in a row ran with the window
        in force: ``steps`` plus at most two per doubling."""
        inv = self.inv
        self.mem.used = inv.resident_bytes if self.streaming else inv.param_bytes
        self.mem.used += sum(b.nbytes for b in self.blocks if b.resident)
        if not self.tracked or not self.streaming:
            # LoRA gradients and AdamW's two moments live on the device from the first step on
            # (tracked on CPU only when a streamed block holds them: not with a resident LoRA).
            self.mem.used += inv.lora_bytes + inv.optimizer_bytes
        out: list[StepResult] = []
        limit = steps + 2 * len(self.blocks).bit_length()
        while len(out) < steps or self.window_grows and len(out) < limit and not self._settled(out):
            start = self.now
            result = self.step()
            result.curve = [
                (round(t - start, 4) if i else 0.0, b, e)
                for i, (t, b, e) in enumerate(result.curve)
            ]
            out.append(result)
        return out

    def _settled(self, out: list[StepResult]) -> bool:
        """The last two steps ran with the window in force (no growth after either)."""
        return len(out) >= 2 and out[-2].window == out[-1].window == self.scheduler.window
