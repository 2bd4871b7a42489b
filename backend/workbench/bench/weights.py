"""Benchmark: LoRA training step time and tracked device peak, plain vs streamed (file-backed).

``python -m workbench.bench.weights [--sizes tiny small] [--steps 4] [--device cpu]`` prints one
line per configuration and the per-step prefetch hits/misses. Figures, not assertions.

``python -m workbench.bench.weights --readers 1 2 4 [--read-mb 1024]`` measures instead how one
block's read scales with the reader threads: page cache -> host buffer (pinned on CUDA), GB/s,
the block's read plan split over the threads as the runtime splits it (``readers.py``).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from peft import LoraConfig

from stagehand.common import DeviceMemory, ListSink, Telemetry
from stagehand.config.memory import MB, StagehandConfig
from stagehand.weights.readers import Readers
from stagehand.weights.runtime import WeightRuntime
from stagehand.weights.sources import SafetensorsCheckpoint, split_plan
from stagehand.weights.transfer import PART_MIN_BYTES
from workbench.worker.assets import build_model, example_inputs, model_class, output_tensor


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


def reader_scaling(threads: list[int], read_mb: int, folder: str, repeats: int = 5) -> None:
    """Print GB/s of one ``read_mb`` block read (page cache -> host buffer) per thread count:
    a file of 64 tensors of ``read_mb / 64`` MB each, read once before timing (page cache)."""
    from safetensors.torch import save_file

    count = 64
    numel = read_mb * MB // count
    tensors = {f"w{i}": torch.full((numel,), i, dtype=torch.uint8) for i in range(count)}
    save_file(tensors, f"{folder}/model.safetensors")
    del tensors
    source = SafetensorsCheckpoint(folder)
    runs = source.plan([(f"w{i}", i * numel) for i in range(count)])
    pin = torch.cuda.is_available()
    dst = torch.empty(count * numel, dtype=torch.uint8, pin_memory=pin)
    source.read_plan(runs, dst)  # into the page cache
    for n in threads:
        parts = split_plan(runs, n, PART_MIN_BYTES)
        readers = Readers(n)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            reads = [lambda part=part: source.read_plan(part, dst, False) for part in parts]
            readers.stage(reads, lambda: None).result()
            best = min(best, time.perf_counter() - t0)
        readers.shutdown()
        print(
            f"readers {n}: {len(parts)} parts, {read_mb} MB in {best * 1e3:.1f} ms = "
            f"{read_mb * MB / best / 1e9:.2f} GB/s (best of {repeats}, pinned={pin})"
        )
    source.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache", default=None)
    parser.add_argument("--readers", nargs="+", type=int, default=None)
    parser.add_argument("--read-mb", type=int, default=1024)
    args = parser.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="stagehand-bench-")
    if args.readers:
        reader_scaling(args.readers, args.read_mb, cache)
        return
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
        runtime = WeightRuntime(
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
