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
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors.torch import load_file

from contract.config import MemoryConfig
from runtime.strategy import build_strategy
from worker.encode import ENCODE_BATCH, _atomic_save, _folder_id, cache_key
from worker.pipelines.base import PipelineFamily, load_component


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
    """Run one encoder over ``texts`` in batches, then release it and its strategy."""

    encoder = load_component(family.root, name, dtype).eval()
    strategy = None
    swap = memory.stagehand is not None and memory.stagehand.text_encoder_block_swap
    if memory.strategy != "none" and swap:
        strategy = build_strategy(
            encoder,
            memory.for_text_encoder(),  # SquareQ only with text_encoder_squareq
            device=device,
            telemetry=telemetry,
            checkpoint_dir=family.root / name,
            mode="inference",
        )
    else:
        encoder.to(device)
    setattr(pipe, name, encoder)
    chunks: dict[str, list[torch.Tensor]] = {}
    try:
        # Stage 1 is step 0 of the run's telemetry: inference steps, training starts at 1.
        with torch.inference_mode():
            with strategy.step(0) if strategy else nullcontext():
                with strategy.forward() if strategy else nullcontext():
                    for i in range(0, len(texts), ENCODE_BATCH):
                        if should_stop():
                            return None
                        got = text_pass(pipe, texts[i : i + ENCODE_BATCH], device, max_tokens)
                        for key, value in got.items():
                            chunks.setdefault(key, []).append(value.float().cpu())
                        progress(min(i + ENCODE_BATCH, len(texts)))
    finally:
        setattr(pipe, name, None)
        if strategy is not None:
            strategy.close()
        del strategy, encoder
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
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
