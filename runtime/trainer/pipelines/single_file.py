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


def convert_single_file(info: PipelineInfo, cache_dir: Path, dtype: torch.dtype) -> Path:
    """The converted transformer folder for ``info.transformer_path`` (built once per file).

    Raises:
        PipelineFolderError: the file's keys do not fit the transformer class (lists a few of
            the file's and of the expected keys).
    """
    import diffusers

    single = Path(info.transformer_path).expanduser()
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
