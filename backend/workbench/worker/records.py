"""The run's own telemetry records that take more than a line to build: ``trainer/run_started``,
``trainer/resumed``, ``trainer/pipeline`` and the figures of ``trainer/error``
(``docs/contracts.md``)."""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path
from typing import Any

import torch

from stagehand.common.telemetry import Telemetry
from stagehand.config.memory import MB
from workbench.contract.preset import Preset
from workbench.contract.records import RESUMED, RUN_STARTED
from workbench.worker.progress import Progress


def run_started(
    telemetry: Telemetry,
    *,
    run_dir: Path,
    name: str,
    preset: Preset,
    device: torch.device,
    model_dir: Path,
    resume: bool,
    attention: dict[str, Any] | None = None,
    **fields: Any,
) -> None:
    """The ``trainer/run_started`` record: who runs what, where, on which device, the
    attention backend choice (``stagehand.common.attention.AttentionChoice.as_record``) and
    ``fields`` (a video run's ``frames`` and ``frames_from``, ``stage1.resolve_frames``)."""
    telemetry.emit(
        *RUN_STARTED,
        run_name=run_dir.name,
        preset=name,
        pid=os.getpid(),
        host=socket.gethostname(),
        max_steps=preset.max_steps,
        device=str(device),
        # The GPU's name: which device profile a calibration from this run is kept under.
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        vram_source="cuda" if device.type == "cuda" else "tracked",
        model=str(model_dir),
        strategy=preset.memory.strategy,
        resume=resume,
        attention=attention,
        **fields,
    )


def resumed(telemetry: Telemetry, run_dir: Path, checkpoint: Path, step: int) -> None:
    """The ``trainer/resumed`` record, its envelope ``step`` the checkpoint's: emitted before the
    first step trained again, so a reader drops the older records of the steps after it (a
    worker killed after step N + k wrote them; training resumes after step N)."""
    telemetry.emit(*RESUMED, step=step, checkpoint=str(checkpoint.relative_to(run_dir)))


def report_pipeline(info, telemetry: Telemetry, progress: Progress) -> None:
    """What the pipeline folder holds, as one ``trainer/pipeline`` record and a line."""
    found = info.as_dict()
    telemetry.emit("trainer", "pipeline", **found)
    progress.line(
        f"{info.family} ({info.pipeline_class}): "
        + ", ".join(f"{c.name} {c.class_name}" for c in info.components)
        + f"; {len(info.blocks)} blocks streamed, largest "
        f"{found['largest_block_bytes'] / MB:.2f} MB, total {found['blocks_total_bytes'] / MB:.2f} MB"
    )


def error_record(
    exc: BaseException, message: str, device: torch.device, **fields: Any
) -> dict[str, Any]:
    """The fields of the ``trainer/error`` record of ``exc``, in their order: its type,
    ``message``, traceback, whether it is an out-of-memory error, the run's ``fields``
    (steps done, LoRA path...) and on CUDA the device's memory figures (MB)."""
    oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
    vram = {}
    if device.type == "cuda" and torch.cuda.is_available():
        vram = {
            "vram_allocated_mb": torch.cuda.memory_allocated(device) / MB,
            "vram_reserved_mb": torch.cuda.memory_reserved(device) / MB,
            "vram_peak_mb": torch.cuda.max_memory_allocated(device) / MB,
            "vram_total_mb": torch.cuda.get_device_properties(device).total_memory / MB,
            "vram_source": "cuda",
        }
    return {
        "error_type": type(exc).__name__,
        "message": message,
        "traceback": "".join(traceback.format_exception(exc)),
        "oom": oom,
        **fields,
        **vram,
    }
