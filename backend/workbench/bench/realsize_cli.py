"""``workbench bench --model flux-dev``: drives the real-size jobs (``workbench.bench.realsize``,
each in its own child process through ``workbench.bench.runner``), adds each row's bound and
prints the table. Kept apart from the jobs, which the bench's child processes import
(``workbench.bench.child``), so the driver -> runner -> child -> jobs arrows go one way.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from stagehand.common.card import GIB, card_gb_problem
from workbench.bench.configs import LAYER_OFFLOAD_RSS_NOTE
from workbench.bench.prediction import bench_profile, row_prediction
from workbench.bench.realsize import GB, ROWS, row_activation_peak, row_memory
from workbench.bench.runner import Runner


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
    if row.get("host_image_bytes"):
        notes.append(f"host images {row['host_image_bytes'] / GB:.3f} GB")
    if row.get("squareq"):
        q = row["squareq"]
        notes.append(f"rel RMS max {q['rel_rms_max']:.4f} ({q['worst_layer']})")
    if "h2d_expected_bytes" in row:
        notes.append(
            f"H2D / 2 x over budget {row['h2d_bytes_per_step'] / row['h2d_expected_bytes']:.3f}"
        )
    p = row.get("plan")  # the planner's prediction of the same section
    if p is not None and "error" in p:
        notes.append(f"plan: {p['error']}")
    elif p is not None:
        notes.append(
            # At the step's end, as the runtime's resident_blocks counter counts them.
            f"plan: on device {p['on_device_blocks']} (ran {c['resident_blocks']}), "
            f"loads {p['block_loads_per_step']}, misses {p['misses_per_step']}, "
            f"waits {p['waits_per_step']} (window {p['window_blocks']}), "
            f"H2D {p['h2d_bytes_per_step'] / GB:.3f} GB, {p['step_ms']:.1f} ms"
        )
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
    """The real-size bench for parsed ``args`` (``workbench.bench.cli``); writes ``args.out``."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size
    if args.folder is None:
        raise SystemExit("workbench bench: --model flux-dev needs --folder DIR (weights go there)")
    runner = Runner(timeout_s=args.timeout)
    base = {"model": args.model, "folder": args.folder, "size": size, "device": device}
    card_gb = getattr(args, "card_gb", None)
    if card_gb is not None:
        problem = card_gb_problem(card_gb)
        if problem:
            raise SystemExit(f"workbench bench: {problem}")
        base["card_bytes"] = int(card_gb * GIB)
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
    card = base.get("card_bytes")
    planning = bench_profile(device, probe, card) if probe.get("status") == "ok" else None
    for name in [n for n in ROWS if n in only or n == "resident"]:
        started = time.perf_counter()
        # Resolved here, once, with the planner's inventory (``card_section``): the child runs
        # this section and the plan below simulates the same one.
        memory = row_memory(name, args.model, size, card)
        job = {**base, "row": name, "steps": steps, "warmup": warmup, "memory": memory}
        job["activation_peak"] = row_activation_peak(args.model, size, memory, device)
        row = runner.run("realsize_row", job)
        row.setdefault("name", name)
        if row["status"] == "ok" and planning is not None:
            # The section as the row ran it (stream_half's watermarks are set on its runtime).
            ran = row.get("memory_config", memory)
            try:
                row["plan"] = row_prediction(args.model, size, ran, planning, warmup + steps)
            except ValueError as exc:  # a section the planner refuses: the row still stands
                row["plan"] = {"error": str(exc)}
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
        "card_gb": card_gb,
        "wall_s": time.perf_counter() - t0,
    }
    name = probe.get("name", device)
    print(
        f"workbench bench: {args.model} ({size}) on {name}, torch {probe.get('torch')}, "
        f"{warmup} warm-up + {steps} measured LoRA steps per row"
        + (f", streamed rows on an emulated {card_gb:g} GiB card" if card_gb else "")
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
