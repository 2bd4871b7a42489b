"""Small measurements beside the step times: pinned H2D bandwidth, the KEEP-path cost and the
weight runtime's cost per block transition."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from stagehand.common.telemetry import Telemetry
from stagehand.config.memory import StagehandConfig
from stagehand.strategy.base import MemoryStrategy
from stagehand.weights import WeightRuntime


def pinned_h2d_bandwidth(
    device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 10
) -> dict[str, float]:
    """Measured pinned host -> device copy bandwidth in GB/s (1e9 bytes/s), median of repeats.

    Raises:
        RuntimeError: ``device`` is not CUDA (there is no H2D link to measure).
    """
    if device.type != "cuda":
        raise RuntimeError(f"H2D bandwidth needs a CUDA device, got {device}")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)  # warm the path
    torch.cuda.synchronize(device)
    gbps = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        gbps.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return {"h2d_gbps": statistics.median(gbps), "bytes": float(nbytes), "repeats": repeats}


def host_bandwidth(nbytes: int = 128 * 2**20, repeats: int = 7) -> dict[str, float]:
    """This machine's host copy and page-cache read bandwidth in GB/s (1e9 bytes/s), medians
    of ``repeats``: ``memcpy_gbps`` (``Tensor.copy_`` between two host buffers, the copy a CPU
    "H2D" is) and ``file_read_gbps`` (``os.preadv`` of a file already in the page cache into a
    host buffer, the read a file-backed block load is). The CPU rows' bound uses both.
    ``memcpy_fresh_gbps`` copies into a newly allocated buffer each time, as a block load into
    its new device buffer does on CPU, in a process without ``cache_host_allocations``: the
    page faults of first touch included (reported, not part of the bound; the rows run with
    the cache, as the trainer's worker does)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # fault the pages in
    copy_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_s.append(time.perf_counter() - t0)
    fresh_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.empty(nbytes, dtype=torch.uint8).copy_(src)
        fresh_s.append(time.perf_counter() - t0)
    read_s = []
    with tempfile.NamedTemporaryFile(prefix="stagehand-bw-") as f:
        f.write(src.numpy().tobytes())
        f.flush()
        fd = os.open(f.name, os.O_RDONLY)
        try:
            view = memoryview(dst.numpy())
            os.preadv(fd, [view], 0)  # into the page cache
            for _ in range(repeats):
                t0 = time.perf_counter()
                got = os.preadv(fd, [view], 0)
                read_s.append(time.perf_counter() - t0)
                if got != nbytes:
                    raise RuntimeError(f"short read: {got} of {nbytes} bytes")
        finally:
            os.close(fd)
    return {
        "memcpy_gbps": nbytes / statistics.median(copy_s) / 1e9,
        "memcpy_fresh_gbps": nbytes / statistics.median(fresh_s) / 1e9,
        "file_read_gbps": nbytes / statistics.median(read_s) / 1e9,
        "bytes": float(nbytes),
        "repeats": repeats,
    }


def _chain(x: torch.Tensor, w: torch.Tensor, n_ops: int) -> torch.Tensor:
    y = x
    for _ in range(n_ops):
        y = y * w  # saves y and w: two saved tensors per op
    return y


def keep_path_cost(
    strategy: MemoryStrategy, *, first_step: int, n_ops: int = 2000, repeats: int = 5
) -> dict[str, float]:
    """Cost of the strategy's saved-tensor hooks on the KEEP path, in microseconds per tensor.

    A chain of ``n_ops`` small multiplies (2 saved tensors each, 256 bytes: never spilled) is
    timed inside ``strategy.forward()`` and without any hooks; the difference of the medians
    over ``repeats`` divided by the saved tensors is the per-tensor cost: the whole router as
    autograd calls it (weight packer, then activation packer). ``activation_packer_us_per_tensor``
    is the activation packer alone, called directly on 16x16 tensors. The strategy must be a
    KEEP-only one (watermark never reached), else spills would be timed too.
    """
    device = strategy.device
    x = torch.ones(64, device=device, requires_grad=True)
    w = torch.ones(64, device=device, requires_grad=True)
    saved = 2 * n_ops
    plain, hooked = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        _chain(x, w, n_ops)
        plain.append(time.perf_counter() - t0)
        with strategy.step(first_step + r):
            with strategy.forward():
                t0 = time.perf_counter()
                _chain(x, w, n_ops)
                hooked.append(time.perf_counter() - t0)
    plain_s, hooked_s = statistics.median(plain), statistics.median(hooked)
    out = {
        "us_per_tensor": (hooked_s - plain_s) / saved * 1e6,
        "saved_tensors": float(saved),
        "plain_ms": plain_s * 1e3,
        "hooked_ms": hooked_s * 1e3,
    }
    packer = getattr(getattr(strategy, "activations", None), "packer", None)
    if callable(packer):
        out["activation_packer_us_per_tensor"] = _packer_cost_us(
            strategy, packer, first_step + repeats, device
        )
    return out


def _packer_cost_us(strategy: MemoryStrategy, packer, step: int, device, n: int = 20000) -> float:
    """The activation runtime's packer alone, called directly (no autograd, no router)."""
    tensors = [torch.randn(16, 16, device=device) for _ in range(n)]
    with strategy.step(step):
        with strategy.forward():
            t0 = time.perf_counter()
            for t in tensors:
                packer(t)
            elapsed = time.perf_counter() - t0
    return elapsed / n * 1e6


def transition_cost(
    device: torch.device, n_blocks: int = 32, width: int = 8, repeats: int = 30
) -> dict[str, float]:
    """The weight runtime's own time per block transition (one load and one eviction), in
    microseconds, with the bytes copied made negligible: ``n_blocks`` blocks of ten
    ``width x width`` linears (20 parameters, ~3 KB: a transformer block has about as many
    tensors), file-backed from a safetensors file, forward only under the runtime with
    watermarks 0 and no prefetch (every block loaded and evicted once per forward), against the
    same forward without it. Median over ``repeats`` forwards each; block telemetry on, as
    presets have it.
    """
    import tempfile
    from pathlib import Path

    from safetensors.torch import save_file

    def stack() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            *(
                torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(10)))
                for _ in range(n_blocks)
            )
        ).requires_grad_(False)

    x = torch.randn(4, width, device=device)
    plain = stack().to(device)
    model = stack()
    config = StagehandConfig(
        pinned_pool_mb=1,
        pinned_slab_mb=1,
        prefetch_window_blocks=0,
        vram_high_watermark_mb=0,
        vram_low_watermark_mb=0,
        block_pattern=r"\d+",
    )

    def timed(net: torch.nn.Module) -> float:
        times = []
        with torch.no_grad():
            for _ in range(repeats):
                t0 = time.perf_counter()
                net(x)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    with tempfile.TemporaryDirectory() as folder:
        save_file(model.state_dict(), str(Path(folder) / "model.safetensors"))
        runtime = WeightRuntime(
            model,
            config,
            device=device,
            telemetry=Telemetry(),
            mode="inference",
            checkpoint_dir=folder,
        )
        timed(model)  # the trace step
        streamed, base = timed(model), timed(plain)
        runtime.close()
    return {
        "us_per_transition": (streamed - base) / n_blocks * 1e6,
        "blocks": float(n_blocks),
        "tensors_per_block": 20.0,
    }


# -- the device timeline of CUDA rows -----------------------------------------------------------
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
"""CUDA runtime calls that block the host until the device caught up (a host sync)."""


def union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` spans (microseconds in, microseconds out)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def overlap_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the time covered by both span sets: ``|union(a) & union(b)|``."""
    return union_us(a) + union_us(b) - union_us(a + b)


def device_timeline(run, steps: int) -> dict[str, float]:
    """Profile ``run()`` (``steps`` training steps on CUDA) with CPU and CUDA activities: host
    syncs (``SYNC_CALLS``) per step, and the H2D copies against the compute kernels on the
    device timeline: ``h2d_copy_ms`` per step (the union of ``Memcpy HtoD`` spans) and
    ``h2d_hidden_fraction`` (the share of that time during which a kernel also ran; 1.0: every
    copy hidden behind compute). Needs CUDA (the CUDA activity traces the runtime API calls and
    the device spans; with the CPU activity alone neither is recorded).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    events = prof.events()
    copies, kernels = [], []
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        span = (e.time_range.start, e.time_range.end)
        if e.name.startswith("Memcpy HtoD"):
            copies.append(span)
        elif not e.name.startswith(("Memcpy", "Memset")):
            kernels.append(span)
    copy_us = union_us(copies)
    return {
        "host_syncs_per_step": sum(e.name in SYNC_CALLS for e in events) / steps,
        "h2d_copy_ms_per_step": copy_us / 1e3 / steps,
        "h2d_hidden_fraction": overlap_us(copies, kernels) / copy_us if copy_us else None,
    }
