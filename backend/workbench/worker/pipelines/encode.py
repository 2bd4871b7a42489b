"""Stage 1 for a pipeline folder: every text encoder, one at a time, block-swapped in inference
mode under the weight runtime, then released before the next (and before stage 2).

The seed's two-stage run (the LTX-2 bf16 on 24 GB case study): the encoder streams
file-backed from its own safetensors (``checkpoint_dir`` = its component folder), and after
its pass its strategy is closed (the pinned pool freed), the module deleted and ``gc`` run: the
seed's bug 3 was an OOM from skipping exactly that.

The cache file ``text-<hash>.safetensors`` holds ``hidden`` (U, T, D), ``mask`` (U, T) and
``pooled`` (U, Dp) (a (U, 0) tensor for families without a pooled embedding); the hash covers
the texts, the family, the token limit and the content (names, sizes, mtimes) of every text
encoder and tokenizer folder.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from stagehand.config.memory import MemoryConfig
from workbench.worker.encode import _atomic_save, _folder_id, cache_key, run_encoder
from workbench.worker.pipelines.folder import load_component

if TYPE_CHECKING:
    from workbench.worker.pipelines.base import PipelineFamily


def text_cache_path(family: PipelineFamily, texts: list[str], cache_dir: Path, max_tokens: int):
    names = [n for n, _ in family.text_passes] + list(family.tokenizers) + list(family.text_helpers)
    key = cache_key(
        kind="pipeline-text",
        family=family.name,
        texts=texts,
        tokens=max_tokens,
        components={n: _folder_id(family.root / n) for n in names},
    )
    return cache_dir / f"text-{key}.safetensors"


def encode_texts(
    family: PipelineFamily,
    texts: list[str],
    *,
    memory: MemoryConfig,
    dtype: torch.dtype,
    device: torch.device,
    telemetry,
    cache_dir: Path,
    max_tokens: int,
    progress: Callable[[int, int, str], None],
    should_stop: Callable[[], bool],
) -> dict[str, torch.Tensor] | None:
    """``{hidden, mask, pooled}`` for ``texts`` (unique, in order); None when stopped."""
    path = text_cache_path(family, texts, cache_dir, max_tokens)
    if path.is_file():
        progress(len(texts), len(texts), f"text embeddings reused from {path.name}")
        return load_file(str(path))
    pipe = family.pipeline()
    out: dict[str, list[torch.Tensor]] = {}
    # Helpers (LTX-2's connectors) are small next to the encoder: resident on the device for
    # the whole stage, released with it.
    for name in family.text_helpers:
        setattr(pipe, name, load_component(family.root, name, dtype).eval().to(device))
    try:
        for i, (name, text_pass) in enumerate(family.text_passes):
            parts = _one_encoder(
                family, pipe, name, text_pass, texts, memory, dtype, device, telemetry, max_tokens,
                should_stop, lambda d, n=name: progress(d, len(texts), f"{n}: {d}/{len(texts)}"),
            )  # fmt: skip
            if parts is None:
                return None
            for key, value in parts.items():
                out.setdefault(key, []).append(value)
            n = len(family.text_passes)
            progress(len(texts), len(texts), f"{name} released ({i + 1}/{n})")
    finally:
        for name in family.text_helpers:
            setattr(pipe, name, None)
        gc.collect()
    result = family.join_text({k: cat_padded(v) for k, v in out.items()})
    n = len(texts)
    result.setdefault("mask", torch.ones(n, result["hidden"].shape[1], dtype=torch.int64))
    result.setdefault("pooled", torch.zeros(n, 0))
    result["mask"] = result["mask"].to(torch.int64)
    _atomic_save(result, path, {"texts": json.dumps(texts), "family": family.name})
    return result


def _one_encoder(
    family, pipe, name, text_pass, texts, memory, dtype, device, telemetry, max_tokens,
    should_stop, progress,
) -> dict[str, torch.Tensor] | None:  # fmt: skip
    """One encoder over ``texts`` (``encode.run_encoder``: block-swapped from its component
    folder, released after), the pipeline holding it as ``pipe.<name>`` meanwhile."""
    chunks = run_encoder(
        lambda: load_component(family.root, name, dtype).eval(),
        lambda _, batch: {
            key: value.float().cpu()
            for key, value in text_pass(pipe, batch, device, max_tokens).items()
        },
        texts,
        memory=memory,
        device=device,
        telemetry=telemetry,
        should_stop=should_stop,
        progress=progress,
        checkpoint_dir=family.root / name,
        attach=lambda encoder: setattr(pipe, name, encoder),
    )
    if chunks is None:
        return None
    return {k: cat_padded(v) for k, v in chunks.items()}


def cat_padded(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0, zero-padding dim 1 (tokens) to the longest: encoders whose
    pipelines trim to the batch's longest prompt (Qwen-Image) give per-batch lengths; the
    padding is masked out (``mask`` 0)."""
    if parts[0].dim() < 2:
        return torch.cat(parts)
    longest = max(p.shape[1] for p in parts)
    padded = []
    for p in parts:
        pad = [0, 0] * (p.dim() - 2) + [0, longest - p.shape[1]]
        padded.append(torch.nn.functional.pad(p, pad))
    return torch.cat(padded)
