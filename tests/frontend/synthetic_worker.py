"""A stand-in worker that writes the full telemetry of a weight-streaming run, without torch.

The dashboard tests point a second backend at it (``STAGEHAND_WORKBENCH_WORKER_MODULE=
tests.frontend.synthetic_worker``) for what a CPU-only tiny-ci run cannot show: block records
oscillating between post-eviction valleys and block-loaded peaks (the LTX-2 seed's dashboard),
activation spill, Conductor grants, samples, and a 100k-record run. It follows
docs/contracts.md: the record envelope, the dataset scan of a ``data.path`` (the real one,
``trainer/dataset_scan``, exit 1 when it finds no usable sample), ``DIR/control/`` requests
(stop, limits -> ``strategy/limits_applied``), exit 0 with ``run_finished``.

Knobs (environment): ``SYNTH_BLOCKS`` blocks (12), ``SYNTH_STEP_S`` seconds per step (0.3),
``SYNTH_BLOCK_MB`` MB per block (900); a preset whose ``description`` holds ``step_s=X`` sets the
seconds per step of its runs (``step_s=0`` writes a 100k-record run in seconds), and
``oom_at=N`` runs out of memory in step N's backward once: a ``trainer/oom_recovery`` record with
the weight watermarks lowered to 55 %, the rerun's ``strategy/limits_applied`` (request ``oom``),
then the step (docs/contracts.md; ``run_finished`` counts ``recoveries``); ``hold_at=N`` waits at
step N's begin (up to 120 s) for a limits request, so that a test's live limit lands mid-run on a
machine of any speed; ``ignore_stop=1`` leaves stop requests unanswered, as a hung worker
would: only the executor's SIGTERM ends the run.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sys
import time
from pathlib import Path

from stagehand.config import wire
from workbench.contract.control import LIMITS, STOP, ControlDir
from workbench.worker.scan import scan_folder


class Writer:
    def __init__(self, path: Path) -> None:
        self.f = path.open("a", encoding="utf-8")
        self.seq = 0

    def emit(self, source: str, kind: str, step=None, phase=None, **fields) -> None:
        rec = {
            "seq": self.seq,
            "time": time.time(),
            "source": source,
            "kind": kind,
            "step": step,
            "phase": phase,
            **fields,
        }
        self.seq += 1
        self.f.write(wire.encode(rec) + "\n")

    def flush(self) -> None:
        self.f.flush()


def write_sample(path: Path, step: int) -> None:
    from PIL import Image

    img = Image.new("RGB", (64, 64))
    img.putdata(
        [((x * 4 + step * 20) % 256, (y * 4) % 256, 160) for y in range(64) for x in range(64)]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def recover(w: Writer, step: int, limits: dict, peak_mb: float) -> int:
    """Step ``step`` ran out of memory in its backward at ``peak_mb``: the weight watermarks are
    lowered to 55 % (``limits`` changed in place) and the rerun's step begin applies them, as
    the worker's recovery writes it. Returns 1 (one recovery)."""
    before = {k: limits[k] for k in ("vram_high_watermark_mb", "vram_low_watermark_mb")}
    after = {k: round(v * 0.55, 1) for k, v in before.items()}
    w.emit(
        "trainer",
        "oom_recovery",
        step=step,
        phase="backward",
        attempt=1,
        failure_bytes=int(peak_mb * 2**20),
        card_bytes=24 * 2**30,
        limits_before=before,
        limits_after=after,
        message="CUDA out of memory. Tried to allocate 900.00 MiB",
    )
    limits.update(after)
    changed = {k: [before[k], after[k]] for k in after}
    w.emit(
        "strategy",
        "limits_applied",
        step=step,
        phase="step_begin",
        request_id="oom",
        changed=changed,
    )
    return 1


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "train" or argv[2] != "--run-dir":
        print("usage: synthetic_worker train CONFIG --run-dir DIR", file=sys.stderr)
        return 2
    config = json.loads(Path(argv[1]).read_text())
    run_dir = Path(argv[3])
    blocks = int(os.environ.get("SYNTH_BLOCKS", "12"))
    step_s = float(os.environ.get("SYNTH_STEP_S", "0.3"))
    found = re.search(r"step_s=([0-9.]+)", str(config.get("description", "")))
    if found:
        step_s = float(found.group(1))
    block_mb = float(os.environ.get("SYNTH_BLOCK_MB", "900"))
    # A preset's description may also set block_mb=, base_mb=, ms_per_load= (step time added per
    # block loaded: runs with higher watermarks load fewer and are faster, as trials of a tune
    # are) and device_name= (its run_started record's, for calibration; underscores are spaces).
    description = str(config.get("description", ""))
    # base_mb: non-block overhead (norms, LoRA, optimizer state).
    knobs = {"block_mb": block_mb, "base_mb": 5000.0, "ms_per_load": 0.0}
    for key in knobs:
        found = re.search(rf"{key}=([0-9.]+)", description)
        if found:
            knobs[key] = float(found.group(1))
    # With any of them set, every step record's peak is the trainer's (below the high watermark
    # plus a block), so that trials with other watermarks report other peaks.
    capped = any(f"{key}=" in description for key in knobs)
    block_mb, base_mb, ms_per_load = knobs.values()
    device_name = None
    found = re.search(r"device_name=(\S+)", description)
    if found:
        device_name = found.group(1).replace("_", " ")
    sh = (config.get("memory") or {}).get("stagehand") or {}
    limits = {
        "vram_high_watermark_mb": float(sh.get("vram_high_watermark_mb", 20000)),
        "vram_low_watermark_mb": float(sh.get("vram_low_watermark_mb", 16000)),
        "prefetch_window_blocks": int(sh.get("prefetch_window_blocks", 2)),
        "max_inflight_transfers": int(sh.get("max_inflight_transfers", 2)),
    }
    max_steps = int(config.get("max_steps", 50))
    found = re.search(r"oom_at=([0-9]+)", description)
    oom_at = int(found.group(1)) if found else None
    found = re.search(r"hold_at=([0-9]+)", description)
    hold_at = int(found.group(1)) if found else None
    ignore_stop = "ignore_stop=1" in description
    recoveries = 0
    w = Writer(run_dir / wire.TELEMETRY_FILE)
    control = ControlDir(run_dir)
    data = config.get("data") or {}
    if data.get("path"):  # the worker's own scan, recorded first
        scan = scan_folder(
            Path(data["path"]),
            captions=data.get("captions", "txt"),
            default_caption=data.get("default_caption"),
            limit=data.get("limit"),
            frames=data.get("frames"),
            on_bad_file=data.get("on_bad_file", "skip"),
        )
        w.emit("trainer", "dataset_scan", **scan.record())
        if scan.problem():
            w.emit("trainer", "error", error_type="DataError", message=scan.problem(), oom=False)
            w.flush()
            return 1
    w.emit(
        "trainer",
        "run_started",
        run_name=run_dir.name,
        preset=config.get("name"),
        pid=os.getpid(),
        host=socket.gethostname(),
        max_steps=max_steps,
        device="cuda",
        device_name=device_name,
        vram_source="cuda",
        model="synthetic",
        strategy="stagehand",
        # A video run's frames per clip, as the trainer records an explicit data.frames.
        **({"frames": data["frames"], "frames_from": "data.frames"} if data.get("frames") else {}),
    )
    for done in range(0, 11, 5):
        w.emit("trainer", "stage", stage="cache", done=done, total=10, message="text embeddings")
    w.emit("trainer", "stage", stage="train", done=0, total=max_steps, message="training")
    w.flush()

    resident: set[int] = set()
    reserved = base_mb
    loss = 4.5
    for step in range(1, max_steps + 1):
        requests = control.poll()
        if step == hold_at:
            w.flush()
            deadline = time.monotonic() + 120
            while not any(r.command in (LIMITS, STOP) for r in requests):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
                requests += control.poll()
        for req in requests:
            if req.command == STOP and not ignore_stop:
                w.emit(
                    "trainer",
                    "run_finished",
                    step=step - 1,
                    status="cancelled",
                    lora_path="lora/pytorch_lora_weights.safetensors",
                    steps_done=step - 1,
                    recoveries=recoveries,
                )
                w.flush()
                return 0
            if req.command == LIMITS:
                changed = {}
                for key, value in (req.body.get("limits") or {}).items():
                    if key in limits and limits[key] != value:
                        changed[key] = [limits[key], value]
                        limits[key] = value
                w.emit(
                    "strategy",
                    "limits_applied",
                    step=step,
                    phase="step_begin",
                    request_id=req.request_id,
                    changed=changed,
                )
        if step == oom_at:
            recoveries += recover(w, step, limits, base_mb + blocks * block_mb)
        t_step = time.time()
        stalls = loads = 0
        order = list(range(blocks)) + list(reversed(range(blocks)))
        for i, b in enumerate(order):
            # Spread the step over its blocks, as a real step spends its time in them.
            if step_s:
                time.sleep(step_s / len(order))
            phase = "forward" if i < blocks else "backward"
            alloc = base_mb + len(resident) * block_mb
            if b not in resident:
                prefetched = (i + step) % 5 != 0
                if not prefetched:
                    stalls += 1
                    w.emit(
                        "stagehand",
                        "block",
                        step=step,
                        phase=phase,
                        event="stall",
                        block=b,
                        block_name=f"transformer_blocks.{b}",
                        vram_allocated_mb=alloc,
                        vram_reserved_mb=reserved,
                        vram_source="cuda",
                    )
                resident.add(b)
                loads += 1
                alloc = base_mb + len(resident) * block_mb
                reserved = max(reserved, alloc + 400)
                w.emit(
                    "stagehand",
                    "block",
                    step=step,
                    phase=phase,
                    event="load",
                    block=b,
                    block_name=f"transformer_blocks.{b}",
                    prefetch=prefetched,
                    vram_allocated_mb=alloc,
                    vram_reserved_mb=reserved,
                    vram_source="cuda",
                )
            for event in ("enter", "exit"):
                w.emit(
                    "stagehand",
                    "block",
                    step=step,
                    phase=phase,
                    event=event,
                    block=b,
                    block_name=f"transformer_blocks.{b}",
                    vram_allocated_mb=alloc,
                    vram_reserved_mb=reserved,
                    vram_source="cuda",
                )
            if alloc > limits["vram_high_watermark_mb"]:
                while (
                    resident
                    and base_mb + len(resident) * block_mb > limits["vram_low_watermark_mb"]
                ):
                    victim = min(resident, key=lambda r: abs(r - b) * -1)
                    resident.discard(victim)
                    w.emit(
                        "stagehand",
                        "block",
                        step=step,
                        phase=phase,
                        event="evict",
                        block=victim,
                        block_name=f"transformer_blocks.{victim}",
                        vram_allocated_mb=base_mb + len(resident) * block_mb,
                        vram_reserved_mb=reserved,
                        vram_source="cuda",
                    )
        step_ms = (time.time() - t_step) * 1000 + 9300 + loads * ms_per_load
        loss = 1.08 + 3.4 * math.exp(-step / 4) + 0.05 * math.sin(step * 1.7)
        peak = base_mb + blocks * block_mb
        trainer_peak = min(peak, limits["vram_high_watermark_mb"] + block_mb)
        if capped:
            peak = trainer_peak
        w.emit(
            "trainer",
            "step",
            step=step,
            phase="step_end",
            loss=loss,
            grad_norm=0.1 + 0.6 * math.exp(-step / 6) + 0.05 * abs(math.sin(step)),
            lr=1e-4,
            step_time_ms=step_ms,
            samples_per_s=1000 / step_ms,
            vram_allocated_mb=base_mb + len(resident) * block_mb,
            vram_reserved_mb=reserved,
            vram_peak_mb=trainer_peak,
            vram_source="cuda",
            rss_mb=12000 + 300 * math.sin(step / 3),
            pinned_mb=8192,
            phase_ms={
                "forward": step_ms * 0.3,
                "backward": step_ms * 0.6,
                "optimizer": step_ms * 0.1,
            },
        )
        w.emit(
            "stagehand",
            "step",
            step=step,
            blocks_loaded=blocks,
            blocks_evicted=blocks,
            prefetch_hits=blocks * 2 - stalls,
            prefetch_misses=stalls,
            stall_time_ms=stalls * 40.0,
            copy_waits=(step * 3) % 4,
            h2d_bytes=int(blocks * 2 * block_mb * 2**20),
            resident_blocks=len(resident),
            vram_allocated_mb=base_mb + len(resident) * block_mb,
            vram_reserved_mb=reserved,
            vram_peak_mb=peak,
            vram_source="cuda",
            pool_used_mb=6144 + 256 * (step % 4),
            pool_total_mb=8192,
            vram_high_watermark_mb=limits["vram_high_watermark_mb"],
            vram_low_watermark_mb=limits["vram_low_watermark_mb"],
            prefetch_window_blocks=limits["prefetch_window_blocks"],
        )
        spilled = 40 + (step % 7) * 3
        w.emit(
            "activation_stagehand",
            "step",
            step=step,
            activations_saved=200,
            activations_kept=200 - spilled,
            activations_spilled=spilled,
            activations_restored=spilled,
            spill_bytes=spilled * 24 * 2**20,
            restore_bytes=spilled * 24 * 2**20,
            stall_time_ms=5.0 + step % 3,
            stall_count=step % 3,
            pool_hits=spilled - step % 4,
            pool_misses=step % 4,
            vram_peak_mb=peak,
            prefetch_hits=spilled - 2,
            restore_ms=30.0,
        )
        w.emit(
            "conductor",
            "step",
            step=step,
            step_id=step,
            vram_allocated_mb=base_mb,
            vram_headroom_mb=24000 - peak,
            pinned_granted_mb=8192,
            h2d_inflight=step % 3,
            d2h_inflight=(step + 1) % 2,
            grant_count=blocks * 2,
            deny_count=stalls,
            partial_count=step % 2,
            phase_durations={},
            runtime_snapshots={},
        )
        w.flush()
    sample = run_dir / "samples" / f"step-{max_steps:05d}-0.png"
    write_sample(sample, max_steps)
    w.emit("trainer", "sample", step=max_steps, path=f"samples/{sample.name}", prompt="a digit")
    w.emit(
        "trainer",
        "run_finished",
        step=max_steps,
        status="succeeded",
        lora_path="lora/pytorch_lora_weights.safetensors",
        steps_done=max_steps,
        recoveries=recoveries,
    )
    w.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
