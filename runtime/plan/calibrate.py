"""This machine's CPU profile, measured: micro-benchmarks plus one calibration step.

On a CPU the cost of a step is mostly per operation (Python module code, autograd recording,
ATen dispatch: microseconds each, thousands per step) rather than FLOPs, and a block load costs
more than its bytes (a fresh allocation faults its pages in, the parameters are re-viewed). Those
two constants are measured on a tiny Flux-style transformer (the factory's ``flux``/``tiny``
spec, random weights, built in memory): one LoRA step all resident gives the cost per operation
(its measured time less FLOPs at the GEMM rate and bytes at the memory bandwidth, divided by
the operations the planner's own ``inventory`` counts for it), and the same step under weight
streaming gives the cost per block load beyond its bytes. About two seconds, once per process.
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


def _tiny_model() -> torch.nn.Module:
    from runtime.assets.models import check_spec, model_class
    from runtime.plan.inventory import add_lora

    torch.manual_seed(0)
    model = model_class("flux")(**check_spec("flux", "tiny"))
    add_lora(model, 4, LORA_TARGETS)
    return model


def calibrate(gemm_tflops: float, mem_gbps: float, copy_gbps: float) -> tuple[float, float]:
    """``(op_us, load_us)``: the cost of one operation and of one block load beyond its bytes at
    ``copy_gbps``, in microseconds, measured on the tiny model (see the module docstring)."""
    from runtime.assets import example_inputs
    from runtime.assets.models import check_spec
    from runtime.common.telemetry import Telemetry
    from runtime.plan.inventory import add_lora, inventory, meta_model
    from runtime.strategy import build_strategy

    meta = meta_model("FluxTransformer2DModel", dict(check_spec("flux", "tiny")), torch.float32)
    add_lora(meta, 4, LORA_TARGETS)
    inv = inventory(meta, example_inputs(meta, latent_hw=LATENT, device="meta"))
    f, o, m = inv.backward_ratio
    flops = (inv.outside_flops + sum(b.forward_flops for b in inv.blocks)) * (1 + f)
    ops = (inv.outside_ops + sum(b.forward_ops for b in inv.blocks)) * (1 + o)
    moved = (inv.outside_moved + sum(b.forward_moved for b in inv.blocks)) * (1 + m)
    moved += 2 * inv.block_bytes  # weights read in forward and backward (simulate._forward)

    def run(memory: dict) -> tuple[float, dict]:
        model = _tiny_model()
        strategy = build_strategy(model, memory, device="cpu", telemetry=Telemetry())
        inputs = example_inputs(model, latent_hw=LATENT)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        try:
            return _step_ms(model, strategy, inputs, optimizer)
        finally:
            strategy.close()

    base_ms, _ = run({"strategy": "none", "gradient_checkpointing": False})
    rest_ms = base_ms - flops / (gemm_tflops * 1e12) * 1e3 - moved / (mem_gbps * 1e9) * 1e3
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
    stream_ms, counters = run(stream)
    loads = max(counters.get("blocks_loaded", 0), 1)
    copy_ms = counters.get("h2d_bytes", 0) / (copy_gbps * 1e9) * 1e3
    load_us = max(stream_ms - base_ms - copy_ms, 0.0) * 1e3 / loads
    return op_us, load_us
