"""Real pipeline families: a diffusers pipeline folder in ``model.path`` (``folder.py``
inspects it, ``encode.py`` runs stage 1 on its text encoders, one adapter per family)."""

from __future__ import annotations

from pathlib import Path

from workbench.contract.preset import MODEL_TYPES
from workbench.worker.pipelines.base import PipelineFamily
from workbench.worker.pipelines.flux import FluxPipelineFamily
from workbench.worker.pipelines.flux2 import Flux2PipelineFamily
from workbench.worker.pipelines.folder import (
    PIPELINE_FAMILIES,
    PipelineFolderError,
    PipelineInfo,
    inspect_pipeline,
    safetensors_header,
    weight_files,
)
from workbench.worker.pipelines.ltx2 import LTX2PipelineFamily
from workbench.worker.pipelines.qwenimage import QwenImagePipelineFamily
from workbench.worker.pipelines.sd3 import SD3PipelineFamily
from workbench.worker.pipelines.sdxl import SDXLPipelineFamily
from workbench.worker.pipelines.single_file import convert_single_file, eight_bit_weights
from workbench.worker.pipelines.wan import WanPipelineFamily
from workbench.worker.pipelines.zimage import ZImagePipelineFamily

ADAPTERS: dict[str, PipelineFamily] = {
    a.name: a
    for a in (
        FluxPipelineFamily(),
        QwenImagePipelineFamily(),
        WanPipelineFamily(),
        LTX2PipelineFamily(),
        ZImagePipelineFamily(),
        SD3PipelineFamily(),
        SDXLPipelineFamily(),
        Flux2PipelineFamily(),
    )
}
"""Families that train from a pipeline folder; the others are inspected but refused."""

__all__ = [
    "ADAPTERS",
    "PIPELINE_FAMILIES",
    "PipelineFamily",
    "PipelineFolderError",
    "PipelineInfo",
    "adapter_for",
    "inspect_pipeline",
    "is_pipeline_folder",
    "inspect_preset",
    "trainable",
]


def trainable(info: PipelineInfo) -> bool:
    """Whether the folder ``info`` describes trains here: its family has an adapter for its
    pipeline class (the ``flux2`` adapter trains ``Flux2KleinPipeline``, not ``Flux2Pipeline``)."""
    adapter = ADAPTERS.get(info.family)
    return adapter is not None and adapter.pipeline_class == info.pipeline_class


def is_pipeline_folder(path: str | Path | None) -> bool:
    """Whether ``model.path`` is meant as a pipeline folder: it holds ``model_index.json``, or
    it is not a single model folder (no ``config.json``) -- then a missing index is an error."""
    if path is None:
        return False
    root = Path(path).expanduser()
    return (root / "model_index.json").is_file() or not (root / "config.json").is_file()


def inspect_preset(preset) -> PipelineInfo:
    """``inspect_pipeline`` for a preset's ``model`` section and its explicit ``model_type``."""

    explicit = preset.model_type if "model_type" in preset.model_fields_set else None
    stagehand = preset.memory.stagehand
    return inspect_pipeline(
        preset.model.path,
        model_type=explicit,
        aliases=MODEL_TYPES,
        transformer_path=preset.model.transformer_path,
        block_pattern=stagehand.block_pattern if stagehand is not None else None,
    )


def adapter_for(
    info: PipelineInfo,
    cache_dir: Path,
    dtype,
    expert: str | None = None,
    prequantized: bool = False,
) -> PipelineFamily:
    """The family adapter bound to the folder (a single-file transformer is converted once
    into ``cache_dir`` in the folder layout the weight runtime streams from; with
    ``prequantized``, SquareQ on, its 8-bit weights as stored: ``single_file.py``). ``expert``
    (``model.expert``) picks one of Wan 2.2's two transformers.

    Raises:
        PipelineFolderError: no adapter for the family yet, the components do not fit, or
            ``expert`` does not fit the folder.
    """
    if info.family not in ADAPTERS:
        raise PipelineFolderError(
            f"{info.path}/model_index.json: {info.pipeline_class} (family {info.family!r}) can "
            f"be inspected but not trained yet; trainable families: {sorted(ADAPTERS)}"
        )
    root = Path(info.path)
    component = ADAPTERS[info.family].expert_component(info, expert)
    transformer_dir = root / component
    if info.transformer_path is not None:
        transformer_dir = convert_single_file(info, cache_dir, dtype, prequantized)
    elif not prequantized:
        # Loaded without SquareQ, a scaled fp8 weight would be read without its scale.

        for path in weight_files(transformer_dir):
            eight_bit_weights(path, safetensors_header(path), False, field="model.path")
    bound = ADAPTERS[info.family].bind(info, transformer_dir, expert)
    bound.check_components()
    bound.check_tokenizers()
    return bound
