"""SquareQ's quantization error in a plan: the table a run's first ``squareq/step`` record
carries (layers counted, mean and worst relative RMS error, the worst layer, the five worst;
``stagehand.squareq.formats.error_table``), for the model's real weights, before the run.

The figures are the SquareQ cache's own (``stagehand.squareq.store``): the blocks are laid out
as the run's weight runtime lays them out (the transformer on ``meta`` in the run's dtype,
``train_dtype``, its LoRA added, each frozen block parameter keyed to its checkpoint tensor
as ``register_blocks`` keys it), so ``cache_entries`` and the store's key are the run's. When
that folder exists its ``squareq.json`` is read; otherwise (``mode="compute"``) the store
quantizes the checkpoint into it, with its progress bar, and the run then reuses it. A folder
that does not verify (``store.cached_meta``: its record, sizes and header; the planner does not
hash the file, it trains nothing) is replaced with ``mode="compute"`` and reported, named, with
``mode="cached"``.

Not measured, with the reason, instead of failing: a factory model not built into the asset
cache yet (the run builds it; a plan builds nothing), a folder whose safetensors are sparse files (headers with holes: the planner's
real-size test folders) or hold no file, a checkpoint the run would refuse (the message
names the parameter), ``mode="cached"`` with nothing cached yet, or ``mode="off"``.
Weights stored in float8_e4m3fn in the checkpoint are streamed as stored: they have no
higher-precision source to compare with, and are counted apart (``prequantized_layers``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stagehand.squareq import store
from stagehand.squareq.prequantized import PrequantizedCheckpointError
from stagehand.squareq.runtime import cache_entries
from stagehand.weights.convert import _checked_key
from stagehand.weights.errors import (
    ParameterMismatchError,
    StagehandSetupError,
    UnmatchedParameterError,
)
from stagehand.weights.registry import find_blocks
from stagehand.weights.sources import SafetensorsCheckpoint
from workbench.plan.inventory import block_layouts
from workbench.worker.assets.cache import is_complete, spec_hash
from workbench.worker.assets.models import model_dir, model_spec
from workbench.worker.setup import denoiser_folder

MODES = ("compute", "cached", "off")
"""``compute``: read the cache, else quantize into it (``workbench plan``'s default);
``cached``: read the cache only (the New run page's plan: no minutes inside a request);
``off``: not measured (``workbench plan --no-quant-error``)."""
SPARSE_SHARE = 0.5
"""A safetensors file with less than this share of its bytes allocated on disk is sparse:
its tensors are holes that read as zeros (``tests/fixtures/sparse_pipelines.py``)."""


def sparse_file(folder: Path) -> str | None:
    """Why ``folder``'s weights cannot be read (a sparse safetensors file: names it and its
    bytes on disk), or None."""
    for path in sorted(folder.glob("*.safetensors")):
        stat = path.stat()
        on_disk = getattr(stat, "st_blocks", None)
        if on_disk is not None and on_disk * 512 < SPARSE_SHARE * stat.st_size:
            return (
                f"{path.name} is a sparse file ({on_disk * 512 / 2**20:.1f} of "
                f"{stat.st_size / 2**20:.1f} MiB on disk): its weights are holes"
            )
    return None


def keep_in_fp32(model: nn.Module) -> None:
    """Make the frozen parameters of the class's ``_keep_in_fp32_modules`` float32, as
    diffusers' ``from_pretrained(torch_dtype=...)`` loads them (``load_model_dict_into_meta``:
    a module name among the parameter name's parts), so the entries' dtypes are the run's."""
    keep = getattr(type(model), "_keep_in_fp32_modules", None) or []
    keep = [keep] if isinstance(keep, str) else keep
    for name, param in model.named_parameters():
        parts = name.split(".")
        if param.is_floating_point() and not param.requires_grad and any(m in parts for m in keep):
            param.data = param.data.to(torch.float32)


def run_blocks(model: nn.Module, source: SafetensorsCheckpoint, section: Any) -> list[Any]:
    """The weight runtime's blocks of ``model`` (on ``meta``, LoRA added) with each frozen
    parameter keyed to its checkpoint tensor, as a file-backed run's ``register_blocks`` keys
    them (``section``: ``memory.stagehand``).

    Raises:
        UnmatchedParameterError, ParameterMismatchError: as the run would (names the parameter).
    """
    found = find_blocks(model, section.block_pattern)
    blocks, _ = block_layouts(model, found, section.resident_trainable_max_fraction)
    for block in blocks:
        for slot in block.layout:
            if not slot.trainable:
                slot.key = _checked_key(source, slot.qualname, slot.shape, slot.dtype)
    return blocks


def not_measured(fmt: str, why: str) -> dict[str, Any]:
    return {"format": fmt, "measured": False, "reason": f"not measured: {why}"}


def measure(
    memory: Any,
    folder: Path | None,
    build: Callable[[], nn.Module],
    mode: str = "compute",
    progress: bool = True,
    unavailable: str | None = None,
) -> dict[str, Any] | None:
    """The quantization error table of a run's SquareQ blocks, or None when SquareQ is off.

    ``memory``: the preset's ``MemoryConfig``; ``folder``: the transformer's checkpoint folder
    (None: not there, ``unavailable`` says why); ``build``: the run's transformer on ``meta`` in its dtype, LoRA
    added (called only when the folder is readable); ``mode``: one of ``MODES``.

    Returns ``format``, ``measured`` and either ``reason`` (``"not measured: ..."``) or the
    cache's ``squareq.json`` fields: ``quantized_layers``, ``rel_rms_mean``, ``rel_rms_max``
    (relative RMS error ``||w - deq(q(w))|| / ||w||``, a fraction), ``worst_layer``,
    ``worst_layers`` (five ``[checkpoint key, rel_rms]``, worst first),
    ``prequantized_layers``, ``bytes`` (of the cache file), ``quantize_s``, ``cached`` (True:
    read, not quantized now) and ``folder``.

    Raises:
        ValueError: an unknown ``mode``.
        OSError: the cache folder cannot be written (``mode="compute"``; names it).
        store.CorruptCacheError: a folder that does not verify cannot be moved aside
            (``mode="compute"``; names it and how to clear it).
    """
    if mode not in MODES:
        raise ValueError(f"quant error mode must be one of {MODES}, got {mode!r}")
    fmt = memory.squareq_format()
    if fmt is None:
        return None
    if mode == "off":
        return not_measured(fmt, "turned off (--no-quant-error)")
    if folder is None:
        return not_measured(fmt, unavailable or "no checkpoint folder")
    why = sparse_file(folder)
    if why is not None:
        return not_measured(fmt, why)
    try:
        source = SafetensorsCheckpoint(folder)
    except StagehandSetupError as exc:
        return not_measured(fmt, str(exc))
    sq = memory.stagehand.squareq
    try:
        entries = cache_entries(run_blocks(build(), source, memory.stagehand), source)
        root = store.cache_root(sq.cache_dir)
        cache = store.folder_for(source, entries, fmt, root)
        try:
            meta = store.cached_meta(cache)
        except store.CorruptCacheError as exc:
            if mode == "cached":  # a request never quantizes: say so, and who replaces it
                return not_measured(fmt, f"{exc} (`workbench plan` or the run's set-up does)")
            meta = None  # ``ensure`` replaces it
        if meta is None and mode == "cached":
            return not_measured(
                fmt, "not in the SquareQ cache yet (`workbench plan` or the run's set-up builds it)"
            )
        if meta is None:
            bar = store.progress_bar(fmt) if progress else None
            cache, meta = store.ensure(source, entries, fmt, root, bar)
    except (UnmatchedParameterError, ParameterMismatchError, PrequantizedCheckpointError) as exc:
        return not_measured(fmt, str(exc))
    finally:
        source.close()
    return {**meta, "format": fmt, "measured": True, "folder": str(cache)}


def measure_preset(
    preset: Any, family: Any, preset_model: Callable[[Any, Any], nn.Module], mode: str
) -> dict[str, Any] | None:
    """``measure`` of a validated ``Preset``: the transformer's folder (``family``'s, else
    ``model.path``) and the model the run trains, built by the planner's ``preset_model`` on
    ``meta`` in the run's dtype (``train_dtype``: the trainer loads it so) with the class's
    float32 modules (``keep_in_fp32``) and the LoRA."""

    def build() -> nn.Module:
        model = preset.model.model_copy(update={"dtype": preset.train_dtype})
        built = preset_model(preset.model_copy(update={"model": model}), family)
        keep_in_fp32(built)
        return built

    folder, why = checkpoint_folder(preset, family)
    return measure(preset.memory, folder, build, mode, unavailable=why)


def checkpoint_folder(preset: Any, family: Any) -> tuple[Path | None, str | None]:
    """``(folder, None)``: the safetensors folder the run's weight runtime streams the
    transformer from (``workbench.worker.setup.resolve_assets``' rule), or ``(None, why)`` when
    the run builds it first (a factory model not built into the cache yet, the demo's trained
    model): nothing is built for a plan."""

    m = preset.model
    own = family.own_folders(preset) if family is not None else None
    if own is not None:
        return own[0], None
    if m.path is not None:
        return denoiser_folder(Path(m.path).expanduser()), None
    if m.pretrained is not None:
        return (
            None,
            f'the demo\'s trained model (model.pretrained "{m.pretrained}") is built by the run',
        )
    folder = model_dir(m.factory, m.size)
    if not is_complete(folder, spec_hash(model_spec(m.factory, m.size))):
        return None, f"the factory model is not built yet (the run builds it into {folder})"
    return folder, None
