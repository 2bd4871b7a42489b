"""Benchmark: LoRA training step time and tracked device peak, plain vs streamed (file-backed).

``python -m runtime.weights.bench [--sizes tiny small] [--steps 4] [--device cpu]`` prints one
line per configuration and the per-step prefetch hits/misses. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from peft import LoraConfig

from runtime.assets import build_model, example_inputs, model_class, output_tensor
from runtime.common import DeviceMemory, ListSink, Telemetry
from runtime.config import MB, StagehandConfig
from runtime.weights.runtime import StagehandRuntime


def _model(path, device):
    model = model_class("flux").from_pretrained(path).requires_grad_(False)
    model.add_adapter(LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"]))
    return model.train()


def _steps(model, steps, runtime=None, device="cpu"):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    times = []
    for step in range(steps):
        inputs = example_inputs(model, seed=step, latent_hw=(16, 16), device=device)
        t0 = time.perf_counter()
        with runtime.managed_forward() if runtime else torch.enable_grad():
            loss = output_tensor(model(**inputs)).pow(2).mean()
        with runtime.managed_backward() if runtime else torch.enable_grad():
            loss.backward()
        with runtime.optimizer_context(opt) if runtime else torch.enable_grad():
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss.item()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache", default=None)
    args = parser.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="stagehand-bench-")
    for size in args.sizes:
        path = build_model("flux", size, cache)
        plain = _model(path, args.device).to(args.device)
        plain_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
        t_plain = _steps(plain, args.steps, device=args.device)
        del plain
        model = _model(path, args.device)
        sink = ListSink()
        memory = DeviceMemory(args.device)
        config = StagehandConfig(
            pinned_pool_mb=64,
            pinned_slab_mb=16,
            prefetch_window_blocks=1,
            vram_high_watermark_mb=100_000,
            vram_low_watermark_mb=100_000,
        )
        runtime = StagehandRuntime(
            model,
            config,
            device=args.device,
            memory=memory,
            telemetry=Telemetry(sink),
            checkpoint_dir=path,
        )
        t_stream = _steps(model, args.steps, runtime, device=args.device)
        runtime.end_step()
        records = sink.of("stagehand", "step")
        steady = slice(1, None)
        print(
            f"flux-{size}: model {plain_bytes / MB:.1f} MB, {len(runtime.blocks)} blocks "
            f"(max {max(b.nbytes for b in runtime.blocks) / MB:.2f} MB), resident {runtime.resident_bytes / MB:.2f} MB"
        )
        print(
            f"  step ms plain {sum(t_plain[steady]) / len(t_plain[steady]):.1f}  "
            f"streamed {sum(t_stream[steady]) / len(t_stream[steady]):.1f} (trace step {t_stream[0]:.1f})"
        )
        print(
            f"  tracked peak MB per step: {[round(r['vram_peak_mb'], 2) for r in records]} "
            f"(plain model resident: {plain_bytes / MB:.2f})"
        )
        print(
            f"  prefetch hits/misses per step: {[(r['prefetch_hits'], r['prefetch_misses']) for r in records]}"
        )
        print(f"  stall ms per step: {[round(r['stall_time_ms'], 1) for r in records]}")
        runtime.close(restore=False)


if __name__ == "__main__":
    main()
