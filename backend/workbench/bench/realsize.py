"""``workbench bench --model flux-dev --folder DIR``: the real-size rows.

A real model's config (``workbench.bench.realmodel``; FLUX.1-dev first) with random bf16 weights
made on the device and saved sharded in ``DIR`` (kept: a folder whose ``config.json`` matches
is reused), LoRA r16 on ``to_q/to_k/to_v/to_out.0``, gradient checkpointing, AdamW, 1024 px
(4096 image + 512 text tokens), batch 1. Every row runs in its own child process (its own
peak VRAM and RSS), after the probes:

=====================  ====================================================================
row                    memory section
=====================  ====================================================================
``resident``           ``strategy: none``: every weight on the device (the baseline)
``stream_file``        the preset's weight streaming alone, file-backed (no spill, no Conductor)
``stream_module``      the same, module-backed (``file_backed: false``)
``stream_file_int8``   ``stream_file`` with SquareQ (``squareq: {format: int8}``): frozen
                       linear weights stored, cached and copied in 8 bits (``runtime/stagehand/squareq``;
                       its quantized copy is cached beside the weights, in ``DIR-squareq``)
``stream_file_fp8``    the same in ``fp8_e4m3``
``preset``             the model's preset ``memory`` section as is (flux-dev-24gb: streaming
                       + activation spill + Conductor)
``layer_offload_0.9``  ``presets/flux-2048-layer-offload.json``'s section
``stream_half``        ``stream_file`` with a budget for half the blocks' bytes: low watermark
                       resident + half, high a window above (``h2d_expected_bytes``: 2 x the
                       bytes that do not fit, NOTE [ Eviction policy ]); its ``memory_config``
                       holds those watermarks, and its ``plan`` simulates them
=====================  ====================================================================

Probes (``probe``): pinned and pageable H2D GB/s, page cache -> pinned buffer read GB/s on 1,
4 and 8 threads (CUDA; on CPU host memcpy and page-cache reads into ordinary memory). The bound
of a row is ``max(compute, bytes moved / pinned H2D)``: compute is the resident row's step,
bytes moved its H2D bytes per step (block loads and activation restores), so a row at its bound
hides every copy behind compute on the copy engine. On CPU there is no H2D link: the bound uses
the memcpy rate and is a smoke figure only.

Every ok row carries ``plan``: the planner's prediction of its section (``prediction.py``:
blocks resident and on the device at the step's end, loads, H2D bytes, misses, waits, step
ms, peak) beside what it measured. Sections with ``"auto"`` on a card the bench sizes for
(tiny rows, ``--card-gb``) are resolved by the driver with the planner's own rule and
activation estimate (``realmodel.card_section``), so both sides run one section.

``--size tiny`` (a CPU smoke run; ``tests/bench/test_realsize.py`` runs it) builds the
same config scaled to tiny widths, every block kept, its preset sections scaled by the ratio of
the largest blocks: the same code path.
"""

from __future__ import annotations

import copy
import json
import os
import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from stagehand.common.attention import apply_attention_backend
from stagehand.common.card import emulate_card
from stagehand.common.telemetry import ListSink, Telemetry
from stagehand.config.memory import MemoryConfig
from stagehand.strategy import build_strategy
from stagehand.strategy.auto import plans_activations
from workbench.bench.probes import host_bandwidth
from workbench.bench.realmodel import (
    build_weights,
    card_section,
    load_lora_model,
    model_inventory,
    preset_memory,
    real_model,
    scale_section,
    section_scale,
)
from workbench.plan.sections import planned_activations
from workbench.plan.workload import train_steps
from workbench.worker.assets import example_inputs

ROWS = (
    "resident",
    "stream_file",
    "stream_file_int8",
    "stream_file_fp8",
    "stream_module",
    "preset",
    "layer_offload_0.9",
    "stream_half",
)
SQUAREQ_ROWS = {"stream_file_int8": "int8", "stream_file_fp8": "fp8_e4m3"}
LAYER_OFFLOAD_PRESET = "flux-2048-layer-offload"
_STREAM_ONLY_DROP = ("activation_stagehand", "conductor_config", "text_encoder_block_swap")
GB = 1e9
MB = 2**20


def row_memory(name: str, model: str, size: str, card_bytes: int | None = None) -> dict[str, Any]:
    """The ``memory`` section of row ``name`` for ``model`` at ``size`` (module table).

    Raises:
        ValueError: unknown row (the message lists them).
    """
    spec = real_model(model)
    preset = preset_memory(spec.preset)
    if card_bytes is not None:  # an emulated card (--card-gb): "auto" resolved for it
        preset = card_section(spec, preset, card_bytes)
    elif size != "real":  # "auto" is resolved on the run's own card; a tiny row has none
        preset = card_section(spec, preset)
    preset = scale_section(preset, section_scale(spec, size))
    stream = {k: v for k, v in preset["stagehand"].items() if k not in _STREAM_ONLY_DROP}
    checkpointed = {"gradient_checkpointing": True}
    if name == "resident":
        return {"strategy": "none", **checkpointed}
    if name in ("stream_file", "stream_module", "stream_half"):
        section = {**stream, "file_backed": name != "stream_module"}
        return {"strategy": "stagehand", **checkpointed, "stagehand": section}
    if name in SQUAREQ_ROWS:
        section = {**stream, "file_backed": True, "squareq": {"format": SQUAREQ_ROWS[name]}}
        return {"strategy": "stagehand", **checkpointed, "stagehand": section}
    if name == "preset":
        return preset
    if name == "layer_offload_0.9":
        return preset_memory(LAYER_OFFLOAD_PRESET)
    raise ValueError(f"real-size rows are {list(ROWS)}, got {name!r}")


def row_activation_peak(model: str, size: str, memory: dict[str, Any], device: str) -> int:
    """The activation peak (bytes) a row whose section still says ``"auto"`` resolves with at
    build, as a run does (``stagehand.strategy.auto.plans_activations``): the planner's estimate
    for ``model`` at ``size`` (``workbench.plan.sections.planned_activations``), so the row keeps the
    blocks its ``plan`` simulates; 0 when nothing is ``"auto"`` or there is no budget. The
    driver computes it (its inventory is measured once per process) into the row's job."""
    config = MemoryConfig.model_validate(copy.deepcopy(memory))
    if not plans_activations(config, device):
        return 0
    sh = config.stagehand
    inv = model_inventory(model, size, sh.block_pattern, sh.resident_trainable_max_fraction)
    return planned_activations(inv, config.gradient_checkpointing)


def half_budget(weights: Any) -> int:
    """Watermarks for ``stream_half`` on the weight runtime ``weights``: low = its resident
    bytes + half the blocks' bytes, high = low + the window's largest blocks. Returns the H2D
    bytes a steady step should move: 2 x the blocks' bytes over the budget."""
    sizes = sorted((b.nbytes for b in weights.blocks), reverse=True)
    half = sum(sizes) // 2
    low = weights.resident_bytes + half
    high = low + sum(sizes[: weights.scheduler.window])
    weights.set_watermarks(high / MB, low / MB)
    return 2 * (sum(sizes) - half)


# -- child jobs (workbench.bench.child.JOBS) ----------------------------------------------------
def build_job(job: dict[str, Any]) -> dict[str, Any]:
    """Random weights saved sharded in ``job["folder"]``, unless a matching folder is there."""
    spec, folder, size = real_model(job["model"]), Path(job["folder"]), job["size"]
    want = spec.model_config(size)
    config = folder / "config.json"
    if config.is_file():
        have = json.loads(config.read_text())
        if all(json.dumps(have.get(k)) == json.dumps(v) for k, v in want.items()):
            return {"status": "ok", "reused": True, "folder": str(folder)}
    folder.mkdir(parents=True, exist_ok=True)
    built = build_weights(spec, folder, size, job["device"])
    return {"status": "ok", "reused": False, "folder": str(folder), **built}


def _timed_copies(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    dst.copy_(src, non_blocking=True)  # warm the path
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return repeats * src.numel() / (time.perf_counter() - t0) / GB


def _read_rate(files: list[Path], buffer: torch.Tensor, threads: int) -> float:
    """GB/s reading ``files`` (in the page cache) into ``buffer``, ``threads`` parts each."""
    view = memoryview(buffer.numpy())
    total = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for path in files:
            size = min(path.stat().st_size, buffer.numel())
            part = -(-size // threads)

            def read(k: int, path: Path = path, size: int = size, part: int = part) -> int:
                fd = os.open(path, os.O_RDONLY)
                try:
                    start = k * part
                    return os.preadv(fd, [view[start : min(size, start + part)]], start)
                finally:
                    os.close(fd)

            total += sum(pool.map(read, range(threads)))
    return total / (time.perf_counter() - t0) / GB


def probe_job(job: dict[str, Any]) -> dict[str, Any]:
    """The probes (module docstring), in GB/s (1e9 bytes/s)."""
    device = torch.device(job["device"])
    nbytes = int(job.get("probe_bytes", 2**30))
    files = sorted(Path(job["folder"]).glob("*.safetensors"))[:3]
    out: dict[str, Any] = {"status": "ok", "device": str(device), "torch": torch.__version__}
    cuda = device.type == "cuda"
    if cuda:
        out["name"] = torch.cuda.get_device_name(device)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out["h2d_pinned_gbps"] = _timed_copies(dev, pinned, 5)
        out["h2d_pageable_gbps"] = _timed_copies(dev, torch.ones(nbytes, dtype=torch.uint8), 5)
        buffer = pinned
    else:
        bw = host_bandwidth(min(nbytes, 128 * 2**20))
        out["memcpy_gbps"] = bw["memcpy_gbps"]
        buffer = torch.empty(nbytes, dtype=torch.uint8)
    target = "pagecache_to_pinned" if cuda else "pagecache_to_host"
    for threads in (1, 4, 8):
        _read_rate(files[:1], buffer, threads)  # the files into the page cache
        out[f"{target}_{threads}t_gbps"] = _read_rate(files, buffer, threads)
    return out


def row_job(job: dict[str, Any]) -> dict[str, Any]:
    """One row: ``warmup + steps`` LoRA steps under the row's section (module docstring)."""

    spec, size, device = real_model(job["model"]), job["size"], torch.device(job["device"])
    attention = apply_attention_backend("auto", device)  # NOTE [ cuDNN SDPA guard ]
    card = job.get("card_bytes")
    # The emulated card bounds the streamed rows (on the CPU their tracked bytes: the row's
    # child process alone); ``resident`` (the baseline) keeps the card.
    if card is not None and job["row"] != "resident":
        emulate_card(device, card)
    # The driver resolves the section once (``card_section`` measures the model on meta).
    memory = job.get("memory") or row_memory(job["row"], job["model"], size, card)
    if job["row"] in SQUAREQ_ROWS:  # the quantized copy beside the weights, built once
        memory["stagehand"]["squareq"]["cache_dir"] = str(job["folder"]).rstrip("/") + "-squareq"
    t0 = time.perf_counter()
    model = load_lora_model(spec, job["folder"])
    strategy = build_strategy(
        model,
        memory,
        device=device,
        telemetry=Telemetry(ListSink()),
        checkpoint_dir=job["folder"],
        activation_peak=job.get("activation_peak", 0),
    )
    expected = None
    if job["row"] == "stream_half":  # its budget is the built runtime's: the section as it ran
        expected = half_budget(strategy.weights)
        section = memory["stagehand"]
        section["vram_high_watermark_mb"] = strategy.weights.high_mb
        section["vram_low_watermark_mb"] = strategy.weights.low_mb
    setup_s = time.perf_counter() - t0
    latent_hw, text_len = spec.inputs_shape(size)
    inputs = example_inputs(
        model, latent_hw=latent_hw, text_len=text_len, device=device, dtype=torch.bfloat16
    )
    figures = train_steps(strategy, model, inputs, warmup=job["warmup"], steps=job["steps"])
    counters = strategy.counters()  # the last step's
    weights = getattr(strategy, "weights", None)
    blocks = weights.blocks if weights is not None else []
    squareq = weights.squareq.info if weights is not None else {}
    strategy.close()
    return {
        "status": "ok",
        "name": job["row"],
        "memory_config": memory,
        "setup_s": setup_s,
        "step_ms": figures.step_ms,
        "step_ms_median": statistics.median(figures.step_ms),
        "loss": figures.loss,
        "vram_peak_alloc_bytes": max(figures.vram_peak_bytes),
        "vram_peak_reserved_bytes": max(figures.vram_reserved_peak_bytes),
        "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "h2d_bytes_per_step": counters["h2d_bytes"] + counters["spill_bytes"],
        # What a host cache holds of the blocks (8-bit images with SquareQ), the cache on or not.
        "host_image_bytes": sum(b.staged_bytes for b in blocks if not b.trainable),
        "squareq": {k: v for k, v in squareq.items() if k != "worst_layers"},
        **({"h2d_expected_bytes": expected} if expected is not None else {}),
        "counters": counters,
        "attention": attention.as_record(),
    }
