"""What runs inside each benchmark child process: prepare the models, probe the hardware, or
measure one row. Imported once by the fork server (``workbench.bench.runner``), so every child
starts with torch, diffusers and peft already imported: its RSS at start is the post-import
baseline the RSS figures are measured against.
"""

from __future__ import annotations

import os
import resource
import statistics
import traceback
import warnings
from typing import Any

import diffusers
import peft  # noqa: F401
import psutil
import torch

from stagehand.common.memory import cache_host_allocations
from stagehand.common.telemetry import ListSink, Telemetry
from stagehand.config.memory import MB
from stagehand.strategy import build_strategy
from workbench.bench.configs import BenchConfig, ModelInfo
from workbench.bench.peers import GroupOffloadPeer, SaveOnCpuPeer, build_peer
from workbench.bench.probes import (
    device_timeline,
    host_bandwidth,
    keep_path_cost,
    pinned_h2d_bandwidth,
    transition_cost,
)
from workbench.plan.profiles import cpu_profile
from workbench.plan.workload import (
    build_scale_model,
    counted_device_bytes,
    enable_checkpointing,
    load_model,
    make_inputs,
    model_sizes,
    train_steps,
)
from workbench.worker.assets import build_model, model_class

# The loaded model classes resolve diffusers' lazy imports now, in the fork server.
for _arch in ("flux", "sd3", "ltx"):
    model_class(_arch)
diffusers.utils.logging.disable_progress_bar()  # one "Loading checkpoint shards" bar per row

H2D_FIELDS = ("h2d_bytes", "restore_bytes")
D2H_FIELDS = ("d2h_bytes", "spill_bytes")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _reset_rss_peak() -> bool:
    """Start a new RSS peak window (Linux ``clear_refs`` 5); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _info(folder: os.PathLike[str] | str, arch: str, size: str) -> dict[str, Any]:
    cls = model_class(arch)
    with torch.device("meta"):  # sizes without reading the weights
        model = cls.from_config(cls.load_config(folder))
    return {"arch": arch, "size": size, "folder": str(folder), **model_sizes(model)}


def prepare(job: dict[str, Any]) -> dict[str, Any]:
    """Build the model folders the run needs; return their ``ModelInfo`` dicts."""
    arch, size, cache = job["arch"], job["size"], job.get("cache_dir")
    out: dict[str, Any] = {"main": _info(build_model(arch, size, cache), arch, size)}
    scale_size = job["scale_size"]
    out["scale"] = {
        str(n): _info(build_scale_model(arch, scale_size, n, cache), arch, scale_size)
        for n in job["scale_blocks"]
    }
    if job.get("large"):
        out["large"] = _info(build_model(arch, "large", cache), arch, "large")
    return out


def hardware(job: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(job["device"])
    out: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        out["name"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
        out.update(pinned_h2d_bandwidth(device))
    else:
        out.update(host_bandwidth())
    out["transition"] = transition_cost(device)
    if device.type == "cpu":
        # The planner's profile of this machine, measured here, now: what the rows run under
        # (``python -m workbench.plan.check`` plans them with it; one measured at check time
        # sees another load on a shared machine).

        out["cpu_profile"] = cpu_profile().to_dict()
    return out


def _telemetry_means(sink: ListSink, measured: set[int]) -> dict[str, dict[str, float]]:
    """Per source, the mean over measured steps of every numeric field of its step records."""
    sums: dict[str, dict[str, float]] = {}
    for rec in sink.records:
        if rec["kind"] != "step" or rec.get("step") not in measured:
            continue
        bucket = sums.setdefault(rec["source"], {})
        for key, value in rec.items():
            if key in ("seq", "time", "step") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                bucket[key] = bucket.get(key, 0.0) + float(value)
    n = max(1, len(measured))
    return {src: {k: v / n for k, v in fields.items()} for src, fields in sums.items()}


def _bytes_and_stall(strategy: Any, means: dict[str, dict[str, float]], steps: int) -> dict:
    if isinstance(strategy, GroupOffloadPeer):
        return {
            "h2d_bytes_per_step": strategy.h2d_bytes_per_step,
            "d2h_bytes_per_step": strategy.d2h_bytes_per_step,
            "bytes_source": "estimated",
            "stall_ms_per_step": None,
        }
    if isinstance(strategy, SaveOnCpuPeer):
        # The counters ran over warm-up steps too; every step moves the same tensors.
        return {
            "h2d_bytes_per_step": strategy.h2d_bytes / steps,
            "d2h_bytes_per_step": strategy.d2h_bytes / steps,
            "bytes_source": "counted",
            "stall_ms_per_step": None,
        }
    if strategy.name == "none":
        return {
            "h2d_bytes_per_step": 0.0,
            "d2h_bytes_per_step": 0.0,
            "bytes_source": "none",
            "stall_ms_per_step": 0.0,
        }
    if not means:
        return {
            "h2d_bytes_per_step": None,
            "d2h_bytes_per_step": None,
            "bytes_source": "missing (no step records)",
            "stall_ms_per_step": None,
        }
    h2d = sum(f.get(k, 0.0) for f in means.values() for k in H2D_FIELDS)
    d2h = sum(f.get(k, 0.0) for f in means.values() for k in D2H_FIELDS)
    stall = sum(f.get("stall_time_ms", 0.0) for f in means.values())
    return {
        "file_read_bytes_per_step": sum(f.get("file_read_bytes", 0.0) for f in means.values()),
        "h2d_bytes_per_step": h2d,
        "d2h_bytes_per_step": d2h,
        "bytes_source": "telemetry",
        "stall_ms_per_step": stall,
    }


def run_row(job: dict[str, Any]) -> dict[str, Any]:
    """Measure one configuration on one model; never raises (errors become the row's status)."""
    config: BenchConfig = job["config"]
    info = ModelInfo.from_dict(job["model"])
    row: dict[str, Any] = {
        **config.to_dict(),
        "blocks": info.n_blocks,
        "model_size": info.size,
        "notes": list(config.notes),
        "status": "ok",
        "reason": None,
    }
    device = torch.device(job["device"])
    if config.needs_cuda and device.type != "cuda":
        return {**row, "status": "n/a", "reason": "needs CUDA"}
    warnings.filterwarnings("ignore")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if device.type == "cpu":
        cache_host_allocations()  # as the trainer's worker does: every row, the baseline too
    rss0 = psutil.Process().memory_info().rss
    try:
        return {**row, **_measure(config, info, device, job, rss0)}
    except NotImplementedError as exc:
        return {**row, "status": "n/a", "reason": f"not built: {exc}"}
    except Exception as exc:  # a failing row must not take the suite down
        tail = traceback.format_exc().strip().splitlines()[-6:]
        return {
            **row,
            "status": "error",
            "reason": f"{type(exc).__name__}: {exc}",
            "traceback": tail,
        }


def _measure(
    config: BenchConfig, info: ModelInfo, device: torch.device, job: dict[str, Any], rss0: int
) -> dict[str, Any]:
    warmup, steps = job["warmup"], job["steps"]
    model = load_model(info.folder, info.arch)
    sink = ListSink()
    telemetry = Telemetry(sink)
    if config.group == "peer":
        strategy = build_peer(config.peer or "", model, device, telemetry)
    else:
        # As the trainer does (backend/workbench/worker/run.py, Run.stage2): checkpointing is the caller's
        # job, the folder is always given and ``stagehand.file_backed`` decides its use.
        if (config.memory or {}).get("gradient_checkpointing"):
            enable_checkpointing(model)
        if config.group == "baseline":
            model.to(device)
        strategy = build_strategy(
            model,
            config.memory or {},
            device=device,
            telemetry=telemetry,
            checkpoint_dir=info.folder,
            mode="training",
        )
    inputs = make_inputs(model, info.size, device)
    setup_peak = _maxrss_bytes()
    windowed = _reset_rss_peak()
    figures = train_steps(strategy, model, inputs, warmup=warmup, steps=steps)
    train_peak = _maxrss_bytes()
    means = _telemetry_means(sink, set(range(warmup, warmup + steps)))
    out: dict[str, Any] = {
        "steps": steps,
        "warmup": warmup,
        "step_ms_median": statistics.median(figures.step_ms),
        "step_ms": figures.step_ms,
        "phase_ms_median": {
            k: statistics.median(p.get(k, 0.0) for p in figures.phase_ms)
            for k in ("forward", "backward", "optimizer")
        },
        "loss": figures.loss,
        "rss_after_imports_bytes": rss0,
        "rss_peak_bytes": max(setup_peak, train_peak) if windowed else train_peak,
        "rss_setup_peak_bytes": setup_peak,
        "rss_train_peak_bytes": train_peak if windowed else None,
        "telemetry": means,
        **_bytes_and_stall(strategy, means, warmup + steps),
    }
    out["rss_growth_bytes"] = out["rss_peak_bytes"] - rss0
    if device.type == "cuda":
        out.update(
            vram_peak_bytes=max(figures.vram_peak_bytes),
            vram_reserved_peak_bytes=max(figures.vram_reserved_peak_bytes),
            vram_source="cuda",
            vram_method="torch.cuda max_memory_allocated/reserved",
        )
    elif config.group == "ours":
        acts = getattr(strategy, "activations", None) is not None
        method = "strategy.memory (DeviceMemory) tracked peak: resident + streamed weights" + (
            " + kept activations" if acts else "; activations untracked (no activation runtime)"
        )
        out.update(
            vram_peak_bytes=max(figures.vram_peak_bytes),
            vram_reserved_peak_bytes=None,
            vram_source="tracked",
            vram_method=method,
        )
    if config.keep_path_probe:
        out["keep_path"] = keep_path_cost(strategy, first_step=warmup + steps)
    if device.type == "cuda":
        # Two more steps under the profiler (after the timed ones: its overhead is not timed).
        out["device_timeline"] = timeline = device_timeline(
            lambda: train_steps(strategy, model, inputs, warmup=0, steps=2), steps=2
        )
        copy_ms = timeline["h2d_copy_ms_per_step"]
        if copy_ms and out["h2d_bytes_per_step"]:
            out["h2d_achieved_gbps"] = out["h2d_bytes_per_step"] / (copy_ms / 1e3) / 1e9
    if device.type != "cuda" and config.group != "ours":
        counted = counted_device_bytes(model, inputs)
        out.update(
            vram_peak_bytes=counted["total_bytes"],
            vram_reserved_peak_bytes=None,
            vram_source="counted",
            vram_counted=counted,
            vram_method="params + LoRA grads + AdamW state + distinct saved activation "
            "storages (counting saved_tensors_hooks, one untimed step)",
        )
    # The run summary of docs/contracts.md, so the dashboard can list a row like a run.
    out["summary"] = {
        "steps_done": warmup + steps,
        "max_steps": warmup + steps,
        "final_loss": out["loss"],
        "peak_vram_mb": out.get("vram_peak_bytes", 0) / MB,
        "mean_step_time_ms": statistics.fmean(figures.step_ms),
        "spill_bytes": out["d2h_bytes_per_step"],
        "stall_ms": out["stall_ms_per_step"],
    }
    strategy.close()
    return out


def _realsize(name: str):
    def job(spec: dict[str, Any]) -> dict[str, Any]:
        from workbench.bench import realsize  # lazy: kept out of the forkserver's preload

        return getattr(realsize, name)(spec)

    return job


JOBS = {
    "prepare": prepare,
    "hardware": hardware,
    "row": run_row,
    # The real-size rows (``workbench.bench.realsize``), imported when first run.
    "realsize_build": _realsize("build_job"),
    "realsize_probe": _realsize("probe_job"),
    "realsize_row": _realsize("row_job"),
}


def run_job(kind: str, job: dict[str, Any]) -> dict[str, Any]:
    """Entry point the runner calls in the child."""
    return JOBS[kind](job)
