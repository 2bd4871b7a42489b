"""``model.transformer_path``: a single-file transformer checkpoint (``.safetensors`` as model
makers and ComfyUI distribute them), loaded with diffusers' ``from_single_file`` against the
pipeline folder's ``transformer/config.json``, then written once, sharded, into the cache in the
folder layout the weight runtime streams from (file-backed streaming reads tensors by the
model's own parameter names, which the original layout does not use)."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.trainer.encode import cache_key
from runtime.trainer.pipelines.folder import (
    DENOISERS,
    PipelineFolderError,
    PipelineInfo,
    safetensors_header,
)

SHARD_BYTES = 2 * 1024**3
"""Shard size of the converted copy (the Hub's usual 2-10 GB shards; any size streams)."""


def refuse_scaled_fp8(single: Path) -> None:
    """Refuse a file of scaled 8-bit weights (ComfyUI's fp8 files: ``<layer>.scale_weight``):
    diffusers' single-file conversion reads the codes without their scale, so the weights would
    be silently wrong. Such weights stream as stored from a diffusers-layout folder with
    ``memory.stagehand.squareq`` (``runtime/squareq/prequantized.py``).

    Raises:
        PipelineFolderError: names the first scaled weight, its dtype and its scale key.
    """
    header = safetensors_header(single)
    for key in sorted(header):
        owner, _, leaf = key.rpartition(".")
        if leaf in ("scale_weight", "weight_scale") and f"{owner}.weight" in header:
            weight = header[f"{owner}.weight"]
            raise PipelineFolderError(
                f"model.transformer_path: {single} stores scaled 8-bit weights ({owner}.weight is "
                f"{weight['dtype']} {weight['shape']} with {key!r}), which the single-file "
                "conversion would read without their scale; use a diffusers-layout transformer "
                "folder of it (model.path) with memory.stagehand.squareq"
            )


def convert_single_file(info: PipelineInfo, cache_dir: Path, dtype: torch.dtype) -> Path:
    """The converted transformer folder for ``info.transformer_path`` (built once per file).

    Raises:
        PipelineFolderError: the file's keys do not fit the transformer class (lists a few of
            the file's and of the expected keys).
    """
    import diffusers

    single = Path(info.transformer_path).expanduser()
    refuse_scaled_fp8(single)
    stat = single.stat()
    key = cache_key(kind="single-file", file=str(single), size=stat.st_size, mtime=stat.st_mtime_ns)
    out = cache_dir / f"transformer-{key}"
    if (out / "config.json").is_file():
        return out
    comp = next(c for c in info.components if c.name in DENOISERS)  # transformer / unet
    cls = getattr(diffusers, comp.class_name)
    try:
        model = cls.from_single_file(
            str(single), config=info.path, subfolder=comp.name, torch_dtype=dtype
        )
    except Exception as exc:  # the loaders raise anything from KeyError to IndexError
        found = sorted(safetensors_header(single))[:5]
        config = cls.load_config(Path(info.path) / comp.name)
        with torch.device("meta"):
            expected = sorted(cls.from_config(config).state_dict())[:5]
        raise PipelineFolderError(
            f"model.transformer_path: {single} does not load as {comp.class_name} "
            f"({type(exc).__name__}: {exc}); its keys start {found}, expected keys like "
            f"{expected} (diffusers) or the original layout of the model's release"
        ) from exc
    tmp = cache_dir / f".{out.name}.tmp"
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size=SHARD_BYTES)
    tmp.rename(out)
    return out
