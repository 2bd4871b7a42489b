"""``workbench bench --model flux-dev --folder DIR``: the real-size rows (issue 27).

A real model's config (``runtime.bench.realmodel``; FLUX.1-dev first) with random bf16 weights
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
``preset``             the model's preset ``memory`` section as is (flux-dev-24gb: streaming
                       + activation spill + Conductor)
``layer_offload_0.9``  ``presets/flux-2048-layer-offload.json``'s section
=====================  ====================================================================

Probes (``probe``): pinned and pageable H2D GB/s, page cache -> pinned buffer read GB/s on 1,
4 and 8 threads (CUDA; on CPU host memcpy and page-cache reads into ordinary memory). The bound
of a row is ``max(compute, bytes moved / pinned H2D)``: compute is the resident row's step,
bytes moved its H2D bytes per step (block loads and activation restores), so a row at its bound
hides every copy behind compute on the copy engine. On CPU there is no H2D link: the bound uses
the memcpy rate and is a smoke figure only.

``--size tiny`` (a CPU smoke run; ``tests/runtime/bench/test_realsize.py`` runs it) builds the
same config scaled to tiny widths, every block kept, its preset sections scaled by the ratio of
the largest blocks: the same code path.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from runtime.bench.configs import LAYER_OFFLOAD_RSS_NOTE
from runtime.bench.realmodel import (
    build_weights,
    load_lora_model,
    preset_memory,
    real_model,
    scale_section,
    section_scale,
)

ROWS = ("resident", "stream_file", "stream_module", "preset", "layer_offload_0.9")
LAYER_OFFLOAD_PRESET = "flux-2048-layer-offload"
_STREAM_ONLY_DROP = ("activation_stagehand", "conductor_config", "text_encoder_block_swap")
GB = 1e9


def row_memory(name: str, model: str, size: str) -> dict[str, Any]:
    """The ``memory`` section of row ``name`` for ``model`` at ``size`` (module table).

    Raises:
        ValueError: unknown row (the message lists them).
    """
    spec = real_model(model)
    preset = scale_section(preset_memory(spec.preset), section_scale(spec, size))
    stream = {k: v for k, v in preset["stagehand"].items() if k not in _STREAM_ONLY_DROP}
    checkpointed = {"gradient_checkpointing": True}
    if name == "resident":
        return {"strategy": "none", **checkpointed}
    if name in ("stream_file", "stream_module"):
        section = {**stream, "file_backed": name == "stream_file"}
        return {"strategy": "stagehand", **checkpointed, "stagehand": section}
    if name == "preset":
        return preset
    if name == "layer_offload_0.9":
        return preset_memory(LAYER_OFFLOAD_PRESET)
    raise ValueError(f"real-size rows are {list(ROWS)}, got {name!r}")


# -- child jobs (runtime.bench.worker.JOBS) ----------------------------------------------------
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
        from runtime.bench.probes import host_bandwidth

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
    from runtime.assets import example_inputs
    from runtime.bench.workload import train_steps
    from runtime.common.attention import apply_attention_backend
    from runtime.common.telemetry import ListSink, Telemetry
    from runtime.strategy import build_strategy

    spec, size, device = real_model(job["model"]), job["size"], torch.device(job["device"])
    attention = apply_attention_backend("auto", device)  # NOTE [ cuDNN SDPA guard ]
    memory = row_memory(job["row"], job["model"], size)
    t0 = time.perf_counter()
    model = load_lora_model(spec, job["folder"])
    strategy = build_strategy(
        model, memory, device=device, telemetry=Telemetry(ListSink()), checkpoint_dir=job["folder"]
    )
    setup_s = time.perf_counter() - t0
    latent_hw, text_len = spec.inputs_shape(size)
    inputs = example_inputs(
        model, latent_hw=latent_hw, text_len=text_len, device=device, dtype=torch.bfloat16
    )
    figures = train_steps(strategy, model, inputs, warmup=job["warmup"], steps=job["steps"])
    counters = strategy.counters()  # the last step's
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
        "counters": counters,
        "attention": attention.as_record(),
    }


# -- the table -------------------------------------------------------------------------------
def add_bounds(rows: list[dict[str, Any]], probe: dict[str, Any]) -> None:
    """``x_resident``, ``bound_ms`` and ``x_bound`` on every ok row (module docstring)."""
    rate = probe.get("h2d_pinned_gbps") or probe.get("memcpy_gbps")
    base = next((r for r in rows if r["name"] == "resident" and r["status"] == "ok"), None)
    for row in rows:
        if row["status"] != "ok" or base is None:
            continue
        compute = base["step_ms_median"]
        row["x_resident"] = row["step_ms_median"] / compute
        copy_ms = row["h2d_bytes_per_step"] / (rate * GB) * 1e3 if rate else 0.0
        row["bound_ms"] = max(compute, copy_ms)
        row["x_bound"] = row["step_ms_median"] / row["bound_ms"]


def _notes(row: dict[str, Any]) -> str:
    c = row["counters"]
    notes = [
        f"loads {c['blocks_loaded']}",
        f"misses {c['prefetch_misses']}",
        f"file reads {c['file_reads']}",
        f"denials {c['denials']}",
        f"pageable {c['pageable_copies']}",
    ]
    if row["name"].startswith("layer_offload"):
        notes.append(LAYER_OFFLOAD_RSS_NOTE)
    return ", ".join(notes)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'row':<18} {'ms/step':>9} {'x res':>6} {'bound ms':>9} {'x bound':>7} "
        f"{'alloc GB':>8} {'H2D GB':>7} {'RSS GB':>7}  notes"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['name']:<18} {r['status']}: {r.get('reason')}")
            continue
        lines.append(
            f"{r['name']:<18} {r['step_ms_median']:>9.1f} {r.get('x_resident', 0):>6.2f} "
            f"{r.get('bound_ms', 0):>9.1f} {r.get('x_bound', 0):>7.2f} "
            f"{r['vram_peak_alloc_bytes'] / GB:>8.3f} {r['h2d_bytes_per_step'] / GB:>7.3f} "
            f"{r['rss_peak_bytes'] / GB:>7.2f}  {_notes(r)}"
        )
    return "\n".join(lines)


def run(args: Any, log: Any) -> int:
    """The real-size bench for parsed ``args`` (``runtime.bench.cli``); writes ``args.out``."""
    from runtime.bench.runner import Runner

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size
    if args.folder is None:
        raise SystemExit("workbench bench: --model flux-dev needs --folder DIR (weights go there)")
    runner = Runner(timeout_s=args.timeout)
    base = {"model": args.model, "folder": args.folder, "size": size, "device": device}
    t0 = time.perf_counter()
    log(f"bench: {args.model} ({size}) weights in {args.folder} ...")
    built = runner.run("realsize_build", base, timeout_s=max(args.timeout, 3600))
    if built.get("status") != "ok":
        log(f"bench: building the weights failed: {built.get('reason')}")
        return 1
    probe_bytes = 2**30 if size == "real" else 16 * 2**20
    probe = runner.run("realsize_probe", {**base, "probe_bytes": probe_bytes})
    steps = args.steps or 4
    warmup = args.warmup if args.warmup is not None else 2
    only = [n for n in args.only.split(",") if n] or list(ROWS)
    rows = []
    for name in [n for n in ROWS if n in only or n == "resident"]:
        started = time.perf_counter()
        job = {**base, "row": name, "steps": steps, "warmup": warmup}
        row = runner.run("realsize_row", job)
        row.setdefault("name", name)
        log(f"  {name:<18} {row['status']:<5} {time.perf_counter() - started:6.1f} s")
        rows.append(row)
    add_bounds(rows, probe)
    result = {
        "kind": "bench_realsize",
        "format": 1,
        "model": args.model,
        "size": size,
        "device": device,
        "build": built,
        "probe": probe,
        "steps": steps,
        "warmup": warmup,
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }
    name = probe.get("name", device)
    print(
        f"workbench bench: {args.model} ({size}) on {name}, torch {probe.get('torch')}, "
        f"{warmup} warm-up + {steps} measured LoRA steps per row"
    )
    print(
        "probes (GB/s): "
        + ", ".join(f"{k[:-5]} {v:.1f}" for k, v in probe.items() if k.endswith("_gbps"))
    )
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out} ({result['wall_s']:.0f} s)")
    return 0 if all(r["status"] == "ok" for r in rows) else 1
