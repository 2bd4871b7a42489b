"""This machine's CPU profile, measured: micro-benchmarks plus calibration steps.

On a CPU the cost of a step is mostly per operation (Python module code, autograd recording,
ATen dispatch: microseconds each, thousands per step) and per byte its matrix products read
rather than FLOPs, and a block load costs more than its bytes (a fresh allocation faults its
pages in, the parameters are re-viewed). Those constants are measured on the factory's
Flux-style transformers (``flux`` ``tiny`` and ``small``, random weights, built in memory): one
LoRA step of each, all resident, gives the cost per operation and per byte moved (two steps, two
unknowns, with FLOPs at the GEMM rate and the operations and bytes the planner's own
``inventory`` counts), and the tiny step under weight streaming the cost per block load beyond
its bytes. About three seconds, once per process.
"""

from __future__ import annotations

import statistics
import time

import torch

from stagehand.common.telemetry import Telemetry
from stagehand.config.memory import MB
from stagehand.strategy import build_strategy
from workbench.plan.inventory import add_lora, inventory, meta_model
from workbench.plan.workload import load_model
from workbench.worker.assets import build_model, example_inputs, output_tensor
from workbench.worker.assets.models import check_spec, model_class

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
LATENT = (8, 8)


def _step_ms(model, strategy, inputs, optimizer, steps: int = 8) -> tuple[float, dict]:
    """The median step after the first two, and the strategy's counters of the last one.

    The median, not the fastest: ``workbench bench`` reports a row's median step, and on a
    shared machine the fastest of a few steps is the moment no other process ran, 10-40% under
    the median; constants fitted to the fastest steps predicted every row too fast under load.
    """

    times, counters = [], {}
    for i in range(steps):
        t0 = time.perf_counter()
        with strategy.step(i):
            with strategy.forward():
                loss = output_tensor(model(**inputs)).float().pow(2).mean()
            with strategy.backward():
                loss.backward()
            with strategy.optimizer(optimizer):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        if i >= 2:  # after the trace step and the first traced one
            times.append((time.perf_counter() - t0) * 1e3)
            counters = strategy.counters()
    return statistics.median(times), counters


def _model(size: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_class("flux")(**check_spec("flux", size))
    add_lora(model, 4, LORA_TARGETS)
    return model


def _counts(size: str):
    """``(inventory, flops, ops, bytes moved)`` of one resident LoRA step of the factory's flux
    ``size``, as the simulation counts them (weights read in forward and backward included)."""

    meta = meta_model("FluxTransformer2DModel", dict(check_spec("flux", size)), torch.float32)
    add_lora(meta, 4, LORA_TARGETS)
    inv = inventory(meta, example_inputs(meta, latent_hw=LATENT, device="meta"))
    f, o, m = inv.backward_ratio
    flops = (inv.outside_flops + sum(b.forward_flops for b in inv.blocks)) * (1 + f)
    ops = (inv.outside_ops + sum(b.forward_ops for b in inv.blocks)) * (1 + o)
    moved = (inv.outside_moved + sum(b.forward_moved for b in inv.blocks)) * (1 + m)
    moved += 2 * inv.block_bytes  # weights read in forward and backward (simulate._forward)
    return inv, flops, ops, moved


def _stream(inv, *, file_backed: bool) -> dict:
    """Streaming with room for 2.5 blocks beside the resident bytes (watermarks equal, window
    1): every step evicts and reloads most blocks, as the bench's streaming rows do."""
    largest = max(b.nbytes for b in inv.blocks)
    slab = max(1, -(-largest // MB))
    high = (inv.resident_bytes + 1.5 * largest) / MB
    return {
        "strategy": "stagehand",
        "gradient_checkpointing": False,
        "stagehand": {
            "pinned_pool_mb": 4 * slab,
            "pinned_slab_mb": slab,
            "vram_high_watermark_mb": high,
            "vram_low_watermark_mb": high,
            "prefetch_window_blocks": 1,
            "file_backed": file_backed,
            "block_events": False,
        },
    }


def calibrate(gemm_tflops: float, mem_gbps: float, copy_gbps: float) -> dict[str, float | None]:
    """``{op_us, mem_gbps, load_us, h2d_gbps, disk_gbps}``: the cost of one operation (us) and
    the rate at which a step moves its bytes (GB/s), from resident steps of the tiny and the
    small model; the cost of a block load, fixed (``load_us``) and per byte (``h2d_gbps``),
    from streamed steps of both; the extra cost per byte of a file-backed load (``disk_gbps``:
    reads from the page cache into the slab instead of copies from the host masters), from
    the small model streamed from its folder both ways (see the module docstring).

    The two resident steps give two equations, ``ms = flops / gemm + ops x op + bytes / mem``,
    for the two unknowns: the tiny step is mostly operations, the small one mostly bytes (its
    matrix products, at a few dozen tokens, read weights more than they compute; a 64 MB
    in-place multiply, ``mem_gbps`` as given, runs 2-4x faster than that). Where the solution is
    not positive (a step disturbed by other load), ``mem_gbps`` as given and the tiny step alone.

    NOTE [ Block loads measured in a step ]
    A block load on a CPU device is two copies (masters or file into the slab, slab into a fresh
    buffer whose pages fault in) plus per-load bookkeeping. Measured alone, best of five, a
    16 MB copy pair runs at 4-5 GB/s here, with its source and destination warm in the caches;
    inside a step the blocks are cold (the step's compute evicted them since their last load)
    and the fresh buffers fault, and the small model's 20 MB loads ran at 1.3-3.6 GB/s: planned
    with the copy benchmark, its streaming rows came out 26-48% too fast. So the per-byte cost
    is solved from the streamed steps themselves, as the per-operation cost is: the tiny model
    (0.4 MB blocks, mostly fixed cost) and the small one (20 MB blocks, mostly bytes) give
    ``extra_ms = loads x load + bytes x per_byte``. ``copy_gbps`` (the copy benchmark) is the
    fallback when that solution is not positive.
    """

    def run(model, memory: dict, folder=None, steps: int = 8) -> tuple[float, dict]:
        strategy = build_strategy(
            model, memory, device="cpu", telemetry=Telemetry(), checkpoint_dir=folder
        )
        inputs = example_inputs(model, latent_hw=LATENT)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        try:
            return _step_ms(model, strategy, inputs, optimizer, steps)
        finally:
            strategy.close()

    resident = {"strategy": "none", "gradient_checkpointing": False}
    inv, flops, ops, moved = _counts("tiny")
    inv_s, flops_s, ops_s, moved_s = _counts("small")
    base_ms, _ = run(_model("tiny"), resident)
    small_ms, _ = run(_model("small"), resident)
    gemm_ms_per_flop = 1e3 / (gemm_tflops * 1e12)
    c1, c2 = base_ms - flops * gemm_ms_per_flop, small_ms - flops_s * gemm_ms_per_flop
    det = ops * moved_s - ops_s * moved
    op_ms = (c1 * moved_s - c2 * moved) / det if det else -1.0
    byte_ms = (ops * c2 - ops_s * c1) / det if det else -1.0
    if op_ms > 0 and byte_ms > 0:
        op_us, mem_gbps = op_ms * 1e3, 1e-6 / byte_ms
    else:
        rest_ms = c1 - moved / (mem_gbps * 1e9) * 1e3
        op_us = max(rest_ms, 0.0) * 1e3 / max(ops, 1)

    # Block loads (NOTE [ Block loads measured in a step ]): module-backed, both models.
    stream_ms, counters = run(_model("tiny"), _stream(inv, file_backed=False))
    folder = build_model("flux", "small")
    small_stream_ms, counters_s = run(
        load_model(folder, "flux"), _stream(inv_s, file_backed=False), folder, steps=6
    )
    loads, nbytes = max(counters.get("blocks_loaded", 0), 1), counters.get("h2d_bytes", 0)
    loads_s, nbytes_s = counters_s.get("blocks_loaded", 0), counters_s.get("h2d_bytes", 0)
    d1, d2 = stream_ms - base_ms, small_stream_ms - small_ms
    det = loads * nbytes_s - loads_s * nbytes
    load_ms = (d1 * nbytes_s - d2 * nbytes) / det if det else -1.0
    per_byte_ms = (loads * d2 - loads_s * d1) / det if det else -1.0
    if load_ms > 0 and per_byte_ms > 0:
        load_us, h2d_gbps = load_ms * 1e3, 1e-6 / per_byte_ms
    elif d2 > 0 and nbytes_s:  # the tiny step's few ms lost in noise: the small step alone
        load_us, h2d_gbps = 0.0, nbytes_s / (d2 * 1e-3) / 1e9
    else:  # the copy benchmark's rate and the tiny step alone
        h2d_gbps = copy_gbps
        load_us = max(d1 - nbytes / (copy_gbps * 1e9) * 1e3, 0.0) * 1e3 / loads
    # File-backed: the same loads with the slab filled by reads from the page cache.
    file_ms, counters_f = run(
        load_model(folder, "flux"), _stream(inv_s, file_backed=True), folder, steps=6
    )
    extra_ms = file_ms - small_stream_ms
    bytes_f = counters_f.get("h2d_bytes", 0)
    disk_gbps = bytes_f / (extra_ms * 1e-3) / 1e9 if extra_ms > 0 and bytes_f else None
    return {
        "op_us": op_us,
        "mem_gbps": mem_gbps,
        "load_us": load_us,
        "h2d_gbps": h2d_gbps,
        "disk_gbps": disk_gbps,
    }
