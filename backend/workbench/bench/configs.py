"""The benchmark's configurations: which strategy each row runs and with what memory section.

Every row is one ``BenchConfig``. Rows of group ``ours`` carry a preset ``memory`` section that
``stagehand.strategy.build_strategy`` turns into a strategy; ``peer`` rows name a stock technique
(``workbench.bench.peers``); the ``baseline`` row is ``strategy: "none"``.

Watermarks are sized from the model's blocks so streaming and spilling really happen on a small
budget (the tracked CPU budget as well as a GPU's): the weight high watermark is the non-block
bytes plus three blocks, the low watermark plus two, so at most a few blocks are resident.
Sources: the LTX-2 bf16 on 24 GB case study (``memory.stagehand``),
"Activation Stagehand" (``activation_stagehand``), "Conductor: Resource Arbitration Across Memory Runtimes"
(``conductor_config``), the Flux 2048 px layer-offload case study (layer offload).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from stagehand.config.memory import MB, MemoryConfig

CPU_PEER_NOTE = "cpu: offload target is host memory, comparison not meaningful"

# Watermark that is never reached: the activation runtime keeps every saved tensor.
NEVER_MB = 1_000_000.0


@dataclass(frozen=True)
class ModelInfo:
    """Sizes of one model folder, measured once by the prepare job (bytes)."""

    arch: str
    size: str
    folder: str
    n_blocks: int
    param_bytes: int
    block_bytes: int
    """The largest block's parameter bytes."""
    nonblock_bytes: int
    """Parameter bytes outside the blocks (embedders, norms, projections)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelInfo:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class BenchConfig:
    """One row: a name, the group it belongs to and how to build its strategy."""

    name: str
    label: str
    group: str
    """``baseline`` | ``ours`` | ``peer``."""
    memory: dict[str, Any] | None = None
    """Preset ``memory`` section for ``build_strategy`` (baseline and ours)."""
    peer: str | None = None
    """``group_offload`` | ``group_offload_stream`` | ``save_on_cpu`` for peer rows."""
    file_backed: bool = False
    """Frozen block weights stream from the safetensors files (``stagehand.file_backed``).
    The model folder is always passed as ``checkpoint_dir``, as the trainer does."""
    needs_cuda: bool = False
    keep_path_probe: bool = False
    """Measure the activation hooks' KEEP-path cost (us per saved tensor) in this row."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "group": self.group,
            "memory_config": self.memory,
            "peer": self.peer,
            "file_backed": self.file_backed,
        }


def _mb(nbytes: float) -> float:
    return round(nbytes / MB, 3)


def stagehand_section(info: ModelInfo, *, file_backed: bool) -> dict[str, Any]:
    """``memory.stagehand`` for weight streaming with a budget of half the blocks (MB): the low
    watermark holds the resident weights and half the blocks' bytes, the high one the largest
    block more (a window of 1), so the other half streams. Under the high watermark every block
    the trace needs before the next load stays (NOTE [ Prefetch window ]): a budget of the
    largest blocks rather than half of them would keep every block of a small model."""
    block_mb = info.block_bytes / MB
    slab_mb = max(1, math.ceil(block_mb))
    window = 1
    low = info.nonblock_bytes + (info.param_bytes - info.nonblock_bytes) / 2
    return {
        "pinned_pool_mb": slab_mb * (window + 2),
        "pinned_slab_mb": slab_mb,
        "vram_high_watermark_mb": _mb(low + window * info.block_bytes),
        "vram_low_watermark_mb": _mb(low),
        "prefetch_window_blocks": window,
        "max_inflight_transfers": 2,
        "file_backed": file_backed,
        "block_events": False,  # one record per block enter/exit would dominate a tiny step
    }


def activation_section(*, spill_all: bool, predictive: bool) -> dict[str, Any]:
    """``activation_stagehand``: KEEP-only (watermark never reached) or spill-all (watermark 0).

    The pool keeps the seed's size classes and slab counts (512 x 1 MB first: one slab per
    spilled tensor however small, ~330 of them per step for flux-small at 16x16 latents).
    """
    high = 0.0 if spill_all else NEVER_MB
    return {
        "enabled": True,
        "vram_high_watermark_mb": high,
        "vram_low_watermark_mb": high,
        "min_spill_bytes": 0 if spill_all else 4096,
        "predictive_restore": predictive,
    }


def conductor_section(info: ModelInfo) -> dict[str, Any]:
    soft = _mb(info.nonblock_bytes + 4 * info.block_bytes) + 64
    return {
        "enabled": True,
        "vram_soft_cap_mb": soft,
        "vram_hard_cap_mb": soft + 64,
        "pinned_budget_mb": 4096,
    }


def _stagehand(info: ModelInfo, *, file_backed: bool, **nested: Any) -> dict:
    section = stagehand_section(info, file_backed=file_backed)
    section.update({k: v for k, v in nested.items() if v is not None})
    # gradient checkpointing off: activations must exist for the spill rows to move them.
    return {"strategy": "stagehand", "gradient_checkpointing": False, "stagehand": section}


def _layer_offload(fraction: float, cuda: bool) -> dict[str, Any]:
    # The seed's layer-offload run: checkpointed blocks, activations moved between layers.
    return {
        "strategy": "layer_offload",
        "gradient_checkpointing": True,
        "enable_activation_offloading": True,
        "enable_async_offloading": cuda,
        "layer_offload_fraction": fraction,
    }


LAYER_OFFLOAD_RSS_NOTE = "module-backed: RSS holds host masters of the offloaded blocks"
"""Why layer offload's RSS is high: a host master copy of every offloaded block (FLUX.1-dev at
0.9: 51 of 57 blocks, 19.6 GB in bf16; 30 GB RSS measured on an H100 host), as the seed's run
did; ``memory.stagehand.file_backed: true`` reads them from the checkpoint instead
(docs/perf-gpu.md)."""


BASELINE = BenchConfig(
    name="baseline",
    label="baseline (none, all resident)",
    group="baseline",
    memory={"strategy": "none", "gradient_checkpointing": False},
)


def main_configs(info: ModelInfo, *, cuda: bool) -> list[BenchConfig]:
    """Every row of the main table, baseline first. Memory sections are validated here."""
    keep = activation_section(spill_all=False, predictive=False)
    spill = activation_section(spill_all=True, predictive=False)
    spill_pred = activation_section(spill_all=True, predictive=True)
    peer_notes = () if cuda else (CPU_PEER_NOTE,)
    rows = [
        BASELINE,
        BenchConfig(
            "stream_module",
            "stream, module-backed",
            "ours",
            _stagehand(info, file_backed=False),
        ),
        BenchConfig(
            "stream_file",
            "stream, file-backed",
            "ours",
            _stagehand(info, file_backed=True),
            file_backed=True,
        ),
        BenchConfig(
            # The other reader setting than the device's default (2 threads on CUDA, none on
            # CPU): what moving file reads off the model's thread does, on this machine.
            "stream_file_readers",
            f"stream, file-backed, {0 if cuda else 2} readers",
            "ours",
            _stagehand(info, file_backed=True, reader_threads=0 if cuda else 2),
            file_backed=True,
        ),
        BenchConfig(
            "spill_keep",
            "+ act. spill KEEP-only",
            "ours",
            _stagehand(info, file_backed=True, activation_stagehand=keep),
            file_backed=True,
            keep_path_probe=True,
        ),
        BenchConfig(
            "spill_all",
            "+ spill-all (wm 0)",
            "ours",
            _stagehand(info, file_backed=True, activation_stagehand=spill),
            file_backed=True,
        ),
        BenchConfig(
            "spill_predictive",
            "+ spill-all + predictive",
            "ours",
            _stagehand(info, file_backed=True, activation_stagehand=spill_pred),
            file_backed=True,
        ),
        BenchConfig(
            "conductor",
            "+ Conductor",
            "ours",
            _stagehand(
                info,
                file_backed=True,
                activation_stagehand=spill_pred,
                conductor_config=conductor_section(info),
            ),
            file_backed=True,
        ),
        *(
            BenchConfig(
                f"layer_offload_{fraction}",
                f"layer offload {fraction}",
                "ours",
                _layer_offload(fraction, cuda),
                notes=(LAYER_OFFLOAD_RSS_NOTE,),
            )
            for fraction in (0.5, 0.9)
        ),
        BenchConfig(
            "peer_group_offload",
            "diffusers group offload",
            "peer",
            peer="group_offload",
            notes=peer_notes,
        ),
        BenchConfig(
            "peer_group_offload_stream",
            "diffusers group offload+stream",
            "peer",
            peer="group_offload_stream",
            needs_cuda=True,
            notes=peer_notes,
        ),
        BenchConfig(
            "peer_save_on_cpu", "torch save_on_cpu", "peer", peer="save_on_cpu", notes=peer_notes
        ),
    ]
    for row in rows:
        if row.memory is not None:
            MemoryConfig.model_validate(copy.deepcopy(row.memory))
    return rows


def scale_configs(info: ModelInfo, *, cuda: bool) -> list[BenchConfig]:
    """Rows repeated for each block count: baseline, streaming, streaming + spill-all."""
    spill_pred = activation_section(spill_all=True, predictive=True)
    return [
        BASELINE,
        BenchConfig(
            "stream_file",
            "stream, file-backed",
            "ours",
            _stagehand(info, file_backed=True),
            file_backed=True,
        ),
        BenchConfig(
            "spill_predictive",
            "stream + spill-all + predictive",
            "ours",
            _stagehand(info, file_backed=True, activation_stagehand=spill_pred),
            file_backed=True,
        ),
    ]


def large_configs(info: ModelInfo, *, cuda: bool) -> list[BenchConfig]:
    """The >= 1 GB model rows behind the file-backed RSS goal.

    One block in use and one prefetched (window 1, two slabs): on CPU the "device" is host
    memory too, so every block held on it counts in RSS; the seed's setting (window 2) is the
    main table's."""
    section = _stagehand(info, file_backed=True)
    block_mb = max(1, math.ceil(info.block_bytes / MB))
    section["stagehand"].update(
        prefetch_window_blocks=1,
        max_inflight_transfers=1,
        pinned_pool_mb=2 * block_mb,
        vram_high_watermark_mb=_mb(info.nonblock_bytes + 2 * info.block_bytes),
        vram_low_watermark_mb=_mb(info.nonblock_bytes + info.block_bytes),
    )
    return [
        BASELINE,
        BenchConfig("stream_file", "stream, file-backed", "ours", section, file_backed=True),
    ]
