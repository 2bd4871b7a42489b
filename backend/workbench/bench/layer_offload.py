"""Benchmark line (not a test): layer offload beside block streaming and the plain model.

    python -m workbench.bench.layer_offload [--arch flux] [--size small] [--steps 3] [--warmup 1]

Prints one line per row: median step time (ms), its ratio to the plain model's, and the device
peak (MB): tracked bytes on CPU (``DeviceMemory``: resident + streamed weights + kept saved
activations), the allocator's on CUDA. The plain rows have nothing tracking them on CPU; their
figure is *counted* (``workbench.plan.workload.counted_device_bytes``: parameters + LoRA
gradients + AdamW state + saved activations). The workload is ``bench``'s: a LoRA step
(rank 4 on ``to_q/to_k/to_v/to_out.0``), MSE against a fixed target, AdamW.
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

import torch

from stagehand.config.memory import MB
from stagehand.strategy import build_strategy
from workbench.contract.preset import SIZES
from workbench.plan.workload import (
    counted_device_bytes,
    enable_checkpointing,
    load_model,
    make_inputs,
    model_sizes,
    train_steps,
)
from workbench.worker.assets import build_model, model_class


def streaming_memory(sizes: dict[str, int]) -> dict[str, Any]:
    """Block streaming with a budget of a few blocks (the benchmark's sizing), checkpointed."""
    slab = max(1, math.ceil(sizes["block_bytes"] / MB))
    return {
        "strategy": "stagehand",
        "gradient_checkpointing": True,
        "stagehand": {
            "pinned_pool_mb": 4 * slab,
            "pinned_slab_mb": slab,
            "vram_high_watermark_mb": (sizes["nonblock_bytes"] + 3 * sizes["block_bytes"]) / MB,
            "vram_low_watermark_mb": (sizes["nonblock_bytes"] + 2 * sizes["block_bytes"]) / MB,
            "prefetch_window_blocks": 2,
            "file_backed": True,
            "block_events": False,
        },
    }


def layer_offload_memory(fraction: float, offload: bool = True, async_: bool = False) -> dict:
    """The seed's section (``presets/flux-2048-layer-offload.json``) at ``fraction``."""
    return {
        "strategy": "layer_offload",
        "gradient_checkpointing": True,
        "enable_activation_offloading": offload,
        "enable_async_offloading": async_,
        "layer_offload_fraction": fraction,
    }


def bench_layer_offload(
    arch: str = "flux",
    size: str = "small",
    fractions: tuple[float, ...] = (0.5, 0.9),
    *,
    steps: int = 3,
    warmup: int = 1,
    device: str = "cpu",
    cache_dir: str | None = None,
    print_fn: Any = print,
) -> list[dict[str, Any]]:
    """Run the rows and print one line each; return them as dicts (``step_ms``, ``ratio``,
    ``peak_mb``, ``peak_source``). Builds the factory model ``(arch, size)`` once if needed."""
    folder = build_model(arch, size, cache_dir)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    cls = model_class(arch)
    with torch.device("meta"):  # sizes without reading the weights
        sizes = model_sizes(cls.from_config(cls.load_config(folder)))
    rows: list[tuple[str, dict[str, Any]]] = [
        ("plain", {"strategy": "none", "gradient_checkpointing": False}),
        ("plain + checkpointing", {"strategy": "none", "gradient_checkpointing": True}),
        ("block streaming + ckpt", streaming_memory(sizes)),
    ]
    for f in fractions:
        rows.append((f"layer offload {f:g}", layer_offload_memory(f, async_=cuda)))
    rows.append(
        (f"layer offload {max(fractions):g} keep", layer_offload_memory(max(fractions), False))
    )
    print_fn(
        f"# {arch}-{size}: {sizes['n_blocks']} blocks of <= {sizes['block_bytes'] / MB:.2f} MB, "
        f"{sizes['nonblock_bytes'] / MB:.2f} MB outside; {device}, {warmup}+{steps} steps"
    )
    out: list[dict[str, Any]] = []
    base_ms = None
    for label, memory in rows:
        model = load_model(folder, arch)
        if memory["gradient_checkpointing"]:
            enable_checkpointing(model)
        if memory["strategy"] == "none":
            model.to(dev)
        strategy = build_strategy(model, memory, device=dev, checkpoint_dir=folder)
        inputs = make_inputs(model, size, dev)
        figures = train_steps(strategy, model, inputs, warmup=warmup, steps=steps)
        step_ms = statistics.median(figures.step_ms)
        base_ms = base_ms or step_ms
        if memory["strategy"] == "none" and not cuda:
            peak, source = counted_device_bytes(model, inputs)["total_bytes"], "counted"
        else:
            peak, source = max(figures.vram_peak_bytes), strategy.memory.source
        strategy.close()
        row = {
            "label": label,
            "memory": memory,
            "step_ms": step_ms,
            "ratio": step_ms / base_ms,
            "peak_mb": peak / MB,
            "peak_source": source,
        }
        out.append(row)
        print_fn(
            f"{label:<28} step {step_ms:9.1f} ms  x{row['ratio']:5.2f} vs plain  "
            f"peak {row['peak_mb']:8.2f} MB ({source})"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="flux", choices=["flux", "sd3", "ltx"])
    parser.add_argument("--size", default="small", choices=SIZES)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    bench_layer_offload(
        args.arch,
        args.size,
        steps=args.steps,
        warmup=args.warmup,
        device=args.device,
        cache_dir=args.cache_dir,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
