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

import time

import torch

from runtime.config import MB

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
LATENT = (8, 8)


def _step_ms(model, strategy, inputs, optimizer, steps: int = 8) -> tuple[float, dict]:
    from runtime.assets import output_tensor

    best, counters = float("inf"), {}
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
            best = min(best, (time.perf_counter() - t0) * 1e3)
            counters = strategy.counters()
    return best, counters


def _model(size: str) -> torch.nn.Module:
    from runtime.assets.models import check_spec, model_class
    from runtime.plan.inventory import add_lora

    torch.manual_seed(0)
    model = model_class("flux")(**check_spec("flux", size))
    add_lora(model, 4, LORA_TARGETS)
    return model


def _counts(size: str):
    """``(inventory, flops, ops, bytes moved)`` of one resident LoRA step of the factory's flux
    ``size``, as the simulation counts them (weights read in forward and backward included)."""
    from runtime.assets import example_inputs
    from runtime.assets.models import check_spec
    from runtime.plan.inventory import add_lora, inventory, meta_model

    meta = meta_model("FluxTransformer2DModel", dict(check_spec("flux", size)), torch.float32)
    add_lora(meta, 4, LORA_TARGETS)
    inv = inventory(meta, example_inputs(meta, latent_hw=LATENT, device="meta"))
    f, o, m = inv.backward_ratio
    flops = (inv.outside_flops + sum(b.forward_flops for b in inv.blocks)) * (1 + f)
    ops = (inv.outside_ops + sum(b.forward_ops for b in inv.blocks)) * (1 + o)
    moved = (inv.outside_moved + sum(b.forward_moved for b in inv.blocks)) * (1 + m)
    moved += 2 * inv.block_bytes  # weights read in forward and backward (simulate._forward)
    return inv, flops, ops, moved


def calibrate(gemm_tflops: float, mem_gbps: float, copy_gbps: float) -> tuple[float, float, float]:
    """``(op_us, load_us, mem_gbps)``: the cost of one operation and of one block load beyond
    its bytes at ``copy_gbps`` (microseconds), and the rate at which a step moves its bytes
    (GB/s), from resident steps of the tiny and the small model and a streamed step of the tiny
    one (see the module docstring).

    The two resident steps give two equations, ``ms = flops / gemm + ops x op + bytes / mem``,
    for the two unknowns: the tiny step is mostly operations, the small one mostly bytes (its
    matrix products, at a few dozen tokens, read weights more than they compute; a 64 MB
    in-place multiply, ``mem_gbps`` as given, runs 2-4x faster than that). Where the solution is
    not positive (a step disturbed by other load), ``mem_gbps`` as given and the tiny step alone.
    """
    from runtime.assets import example_inputs
    from runtime.common.telemetry import Telemetry
    from runtime.strategy import build_strategy

    def run(size: str, memory: dict) -> tuple[float, dict]:
        model = _model(size)
        strategy = build_strategy(model, memory, device="cpu", telemetry=Telemetry())
        inputs = example_inputs(model, latent_hw=LATENT)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        try:
            return _step_ms(model, strategy, inputs, optimizer)
        finally:
            strategy.close()

    resident = {"strategy": "none", "gradient_checkpointing": False}
    inv, flops, ops, moved = _counts("tiny")
    _, flops_s, ops_s, moved_s = _counts("small")
    base_ms, _ = run("tiny", resident)
    small_ms, _ = run("small", resident)
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
    largest = max(b.nbytes for b in inv.blocks)
    high = (inv.resident_bytes + 1.5 * largest) / MB
    stream = {
        "strategy": "stagehand",
        "gradient_checkpointing": False,
        "stagehand": {
            "pinned_pool_mb": 8,
            "pinned_slab_mb": 1,
            "vram_high_watermark_mb": high,
            "vram_low_watermark_mb": high,
            "prefetch_window_blocks": 1,
            "file_backed": False,
            "block_events": False,
        },
    }
    stream_ms, counters = run("tiny", stream)
    loads = max(counters.get("blocks_loaded", 0), 1)
    copy_ms = counters.get("h2d_bytes", 0) / (copy_gbps * 1e9) * 1e3
    load_us = max(stream_ms - base_ms - copy_ms, 0.0) * 1e3 / loads
    return op_us, load_us, mem_gbps
