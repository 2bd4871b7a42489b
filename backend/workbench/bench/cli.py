"""``workbench bench``: every configuration side by side, a printed table and a JSON file.

    workbench bench [--model tiny|small|large] [--arch flux|sd3|ltx] [--quick] [--out bench.json]
    workbench bench --model flux-dev --folder DIR [--size real|tiny] [--out realsize.json]

``--model flux-dev`` runs the real-size rows instead (``workbench.bench.realsize``: a real
model's config with random weights saved in ``--folder``, every strategy against all-resident,
with the probes and each row's bound); ``--size tiny`` is its CPU smoke run.

Each row runs in its own child process (``workbench.bench.runner``) so its RSS peak is its own;
all rows of one invocation run one after another from the same parent, in ``--rounds`` turns
(default 2) whose step times are pooled, with the baseline run once more at the end, so the
ratios to the baseline hold on a noisy machine. ``--quick`` (few steps, tiny scale models, no large model)
finishes in minutes on a 2-core CPU; the full run adds the >= 1 GB model rows behind the
file-backed RSS goal. Rows whose strategy is not built yet print ``n/a (not built: ...)``.

JSON written to ``--out`` (sizes in bytes, times in ms)::

    {
      "kind": "bench", "format": 1, "created_at": unix s, "wall_s": float, "argv": [...],
      "quick": bool, "steps": int, "warmup": int, "rounds": int,
      "device": {"type": "cpu"|"cuda", "name", "torch", "cuda", "h2d_gbps": float|null},
      "model": ModelInfo,           # arch, size, folder, n_blocks, param_bytes, block_bytes,
                                    # nonblock_bytes
      "large_model": ModelInfo|null,
      "keep_path_us_per_tensor": float|null,
      "rows": [Row...],             # main table, baseline first
      "scale_rows": [Row...],       # baseline / stream_file / spill_predictive per block count
      "large_rows": [Row...],       # baseline and stream_file on the large model (full run)
      "goals": [{"name", "target", "measured": str|null, "met": bool|null, "note"}]
    }

    Row = {
      "name", "label", "group": "baseline"|"ours"|"peer", "section": "main"|"scale"|"large",
      "blocks": int, "model_size": str, "memory_config": dict|null, "peer": str|null,
      "file_backed": bool, "status": "ok"|"n/a"|"error", "reason": str|null, "notes": [str],
      # present when status == "ok":
      "steps", "warmup", "step_ms_median", "step_ms": [float], "ratio_to_baseline",
      "runs": int (child runs whose step times are pooled; the baseline runs once more, last),
      "run_medians": [float] (each run's median step ms, in run order),
      "ratio_rounds": [float]|null (each round's ratio to the baseline runs around it),
      "ratio_spread": [min, max]|null (of ratio_rounds: how far two rounds disagree),
      "phase_ms_median": {"forward", "backward", "optimizer"}, "loss",
      "vram_peak_bytes", "vram_reserved_peak_bytes": int|null,
      "vram_source": "cuda"|"tracked"|"counted", "vram_method": str,
      "rss_after_imports_bytes", "rss_peak_bytes", "rss_growth_bytes",
      "rss_setup_peak_bytes", "rss_train_peak_bytes",
      "h2d_bytes_per_step", "d2h_bytes_per_step": float|null, "file_read_bytes_per_step",
      "bytes_source": "telemetry"|"counted"|"estimated"|"none"|"missing ...",
      "stall_ms_per_step": float|null, "bound_ms", "ratio_to_bound": float|null
        (backend/workbench/bench/report.py add_ratios: overlapped H2D on CUDA; baseline + copies + reads on CPU),
      "telemetry": {source: {field: mean over measured steps}},
      "keep_path": {"us_per_tensor", ...} (spill_keep only), "vram_counted": {...} (counted),
      "device_timeline": {"host_syncs_per_step", "h2d_copy_ms_per_step",
                          "h2d_hidden_fraction"} (CUDA: probes.device_timeline, 2 more steps),
      "h2d_achieved_gbps": float (CUDA, rows that copy: H2D bytes / H2D copy time per step),
      "summary": {"steps_done", "max_steps", "final_loss", "peak_vram_mb",
                  "mean_step_time_ms", "spill_bytes", "stall_ms"}  # a run's summary (contracts)
    }

``workbench bench --telemetry [ARGS]`` runs the backend's telemetry-latency benchmark instead:
``workbench.cli`` dispatches it to ``workbench.cli.bench_latency`` (its own arguments, e.g.
``--rates 1000 --clients 1``); this module never imports the backend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from workbench.bench import realsize_cli
from workbench.bench.configs import ModelInfo, large_configs, main_configs, scale_configs
from workbench.bench.realmodel import REAL_MODELS
from workbench.bench.report import add_ratios, goals, goals_text, table, timeline_text
from workbench.bench.runner import Runner
from workbench.contract.preset import SIZES

ARCHS = ("flux", "sd3", "ltx")
LEGEND_CPU = (
    "VRAM on CPU: 'tracked' = bytes the runtimes placed on the compute device (resident + "
    "streamed weights,\n  + kept activations when activation spill is on; LoRA grads and AdamW "
    "state are not tracked); 'counted' = params\n  + LoRA grads + AdamW state + saved activations "
    "(counting saved_tensors_hooks, one extra untimed step)."
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workbench bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        choices=(*SIZES, *REAL_MODELS),
        default="small",
        help="factory size of the main table's model (default small), or a real model "
        "(the real-size rows)",
    )
    p.add_argument("--folder", default=None, help="real-size rows: the weights' folder")
    p.add_argument(
        "--size",
        choices=("real", "tiny"),
        default="real",
        help="real-size rows: the real config, or scaled to tiny widths (CPU smoke run)",
    )
    p.add_argument("--arch", choices=ARCHS, default="flux", help="model family (default flux)")
    p.add_argument(
        "--quick", action="store_true", help="few steps, tiny scale models, no large-model rows"
    )
    p.add_argument("--steps", type=int, help="measured steps per row (quick 5, full 10)")
    p.add_argument("--warmup", type=int, help="warm-up steps per row (quick 2, full 2)")
    p.add_argument(
        "--scale-blocks",
        default="2,4,8,16",
        help="comma-separated block counts of the scale rows ('' for none)",
    )
    p.add_argument(
        "--large",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add the >= 1 GB model rows (default: on unless --quick)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="run every row this many times in turn, pooling step times (default 2)",
    )
    p.add_argument("--only", default="", help="comma-separated row names to run (baseline kept)")
    p.add_argument(
        "--card-gb",
        type=float,
        default=None,
        help="real-size rows: emulate a card of this many GiB (CUDA: the allocator's per-process"
        ' fraction; "auto" watermarks resolved for it), e.g. 24 on an 80 GB H100',
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--cache-dir", default=None, help="asset cache (default: the factory's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per row")
    p.add_argument("--out", default="bench.json", help="JSON output (default bench.json)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    for name in ("steps", "warmup"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "steps" else 0):
            p.error(f"--{name} must be {'>= 1' if name == 'steps' else '>= 0'}, got {value}")
    try:
        args.scale_blocks = [int(n) for n in args.scale_blocks.split(",") if n.strip()]
    except ValueError:
        p.error(f"--scale-blocks expects integers like 2,4,8,16, got {args.scale_blocks!r}")
    if any(n < 2 for n in args.scale_blocks):
        p.error(f"--scale-blocks counts must be >= 2, got {args.scale_blocks}")
    return args


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _run_rows(
    runner: Runner,
    configs,
    info: dict,
    section: str,
    job: dict,
    only: set[str],
    log,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Run ``configs`` one child each, ``rounds`` times in turn, then the baseline once more.

    Step times of a configuration's runs are pooled (``runs`` says how many): a machine that
    slows down or speeds up during the section then biases the ratios less than one baseline
    measured at one end would. The other figures are the first run's.
    """
    chosen = [c for c in configs if not only or c.name in only or c.name == "baseline"]
    order = chosen * rounds + [c for c in chosen if c.name == "baseline"]
    rows: list[dict[str, Any]] = []
    for config in order:
        t0 = time.perf_counter()
        row = runner.run("row", {**job, "config": config, "model": info})
        row["section"] = section
        log(
            f"  {section:<5} {info['n_blocks']:>3} blocks  {config.name:<26} {row['status']:<5} "
            f"{time.perf_counter() - t0:5.1f} s  {row.get('reason') or ''}"
        )
        first = next((r for r in rows if r["name"] == config.name), None)
        if first is None:
            row["runs"] = 1
            if row["status"] == "ok":
                row["run_medians"] = [row["step_ms_median"]]
            rows.append(row)
        elif first["status"] == "ok" and row["status"] == "ok":
            first["run_medians"].append(row["step_ms_median"])
            first["step_ms"] = first["step_ms"] + row["step_ms"]
            first["step_ms_median"] = statistics.median(first["step_ms"])
            first["runs"] += 1
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started = time.time()
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.model in REAL_MODELS:
        return realsize_cli.run(args, log)
    device = args.device or _default_device()
    cuda = device.startswith("cuda")
    steps = args.steps or (5 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else 2
    large = args.large if args.large is not None else not args.quick
    only = {n for n in args.only.split(",") if n}
    rounds = args.rounds
    runner = Runner(timeout_s=args.timeout)

    log(
        f"bench: preparing models ({args.arch}-{args.model}, scale {args.scale_blocks}"
        f"{', large' if large else ''}) ..."
    )
    prep = runner.run(
        "prepare",
        {
            "arch": args.arch,
            "size": args.model,
            "cache_dir": args.cache_dir,
            "scale_size": "tiny" if args.quick else "small",
            "scale_blocks": args.scale_blocks,
            "large": large,
        },
        timeout_s=max(args.timeout, 1800),
    )
    if "main" not in prep:
        log(f"bench: preparing the models failed: {prep.get('reason')}")
        return 1
    hw = runner.run("hardware", {"device": device})
    job = {"device": device, "steps": steps, "warmup": warmup}

    main_info = ModelInfo.from_dict(prep["main"])
    rows = _run_rows(
        runner, main_configs(main_info, cuda=cuda), prep["main"], "main", job, only, log, rounds
    )
    scale_rows: list[dict[str, Any]] = []
    for n in args.scale_blocks:
        info = prep["scale"][str(n)]
        part = _run_rows(
            runner,
            scale_configs(ModelInfo.from_dict(info), cuda=cuda),
            info,
            "scale",
            job,
            only,
            log,
            rounds,
        )
        add_ratios(part, hw)
        scale_rows += part
    large_rows: list[dict[str, Any]] = []
    if large and "large" in prep:
        info = prep["large"]
        large_rows = _run_rows(
            runner,
            large_configs(ModelInfo.from_dict(info), cuda=cuda),
            info,
            "large",
            job,
            only,
            log,
            rounds,
        )
        add_ratios(large_rows, hw)
    add_ratios(rows, hw)

    keep = next((r for r in rows if r["name"] == "spill_keep" and r["status"] == "ok"), None)
    result: dict[str, Any] = {
        "kind": "bench",
        "format": 1,
        "created_at": started,
        "argv": argv,
        "quick": args.quick,
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "device": {
            "type": "cuda" if cuda else "cpu",
            "name": hw.get("name", "cpu"),
            "torch": hw.get("torch"),
            "cuda": hw.get("cuda"),
            "h2d_gbps": hw.get("h2d_gbps"),
            "memcpy_gbps": hw.get("memcpy_gbps"),
            "memcpy_fresh_gbps": hw.get("memcpy_fresh_gbps"),
            "file_read_gbps": hw.get("file_read_gbps"),
        },
        "cpu_profile": hw.get("cpu_profile"),
        "model": prep["main"],
        "large_model": prep.get("large") if large else None,
        "keep_path_us_per_tensor": (keep or {}).get("keep_path", {}).get("us_per_tensor"),
        "transition": hw.get("transition"),
        "rows": rows,
        "scale_rows": scale_rows,
        "large_rows": large_rows,
    }
    result["goals"] = goals(result)
    result["wall_s"] = time.perf_counter() - t0

    info = prep["main"]
    bw = hw.get("h2d_gbps")
    print(
        f"workbench bench: {args.arch}-{args.model} ({info['n_blocks']} blocks, "
        f"{info['param_bytes'] / 2**20:.1f} MB fp32), device {result['device']['name']}, "
        f"{warmup} warm-up + {steps} measured LoRA steps per row, {rounds} round(s)"
        + (f", pinned H2D {bw:.1f} GB/s" if bw else "")
        + (
            f", memcpy {hw['memcpy_gbps']:.1f} GB/s ({hw['memcpy_fresh_gbps']:.1f} into fresh "
            f"memory), page-cache read {hw['file_read_gbps']:.1f} GB/s"
            if hw.get("memcpy_gbps")
            else ""
        )
    )
    print(table(rows))
    if not cuda:
        print(LEGEND_CPU)
    else:
        print("\n" + timeline_text(rows + scale_rows + large_rows, bw))
    if scale_rows:
        print("\nscale (same family, more blocks):")
        print(table(scale_rows, first="blocks / config"))
    if large_rows:
        print(f"\nlarge model ({prep['large']['param_bytes'] / 2**30:.2f} GB fp32):")
        print(table(large_rows))
    print()
    print(goals_text(result["goals"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out} ({result['wall_s']:.0f} s)")
    return 0
