"""Stage 1: cache text embeddings and VAE latents to disk, then free the encoders.

The seed's two-stage run (the LTX-2 bf16 on 24 GB case study): the text encoder runs
in inference mode under the weight runtime (block-swapped) when
``memory.stagehand.text_encoder_block_swap`` is on; after caching, the encoder, its strategy and
its pinned pool are released (``strategy.close()``, ``del``, ``gc.collect()``) before the
transformer is loaded -- the seed's bug 3 was an OOM from skipping exactly that.

Two cache files under ``cache_root()/trainer-cache/``, each named by a hash of what it was made
from, so a second run with the same data and encoder reuses them:

- ``text-<hash>.safetensors``: ``hidden`` (U, T, D), ``mask`` (U, T), ``pooled`` (U, D) for the U
  unique captions and sample prompts (metadata ``texts``: their JSON list).
- ``latents-<hash>.safetensors``: ``latent.<i>`` (C, h, w) or (C, F, h, w) per sample, already
  multiplied by the VAE's ``scaling_factor``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from stagehand.config.memory import MemoryConfig
from stagehand.strategy import build_strategy
from workbench.worker.clips import load_clip
from workbench.worker.data import image_hw, load_sample, target_size
from workbench.worker.scan import Sample

if TYPE_CHECKING:
    from workbench.worker.families import Family

FORMAT = 2
"""Bumped when what a cache file holds changes for the same inputs (2: 16-bit and transparent
images are converted without damage)."""
ENCODE_BATCH = 16
"""Captions / images per encoder forward: big enough to amortise, small enough for 2 cores."""


def _folder_id(folder: Path) -> list:
    """What identifies a model folder's weights: the folder's resolved path, then its files' names,
    sizes and mtimes. The path tells apart two folders whose files agree on all three (Wan 2.2's
    experts, images built with ``SOURCE_DATE_EPOCH``); a moved folder is encoded again."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix != ".lock")
    return [str(folder.resolve())] + [
        (str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in files
    ]


def cache_key(**parts: object) -> str:
    blob = json.dumps({"format": FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def encode_texts(
    texts: list[str],
    encoder_path: Path,
    *,
    memory: MemoryConfig,
    device: torch.device,
    telemetry,
    cache_dir: Path,
    max_tokens: int,
    progress: Callable[[int, int, str], None],
    should_stop: Callable[[], bool],
) -> dict[str, torch.Tensor] | None:
    """``{hidden (U, T, D), mask (U, T), pooled (U, D)}`` for ``texts`` (unique, in order).

    Returns None when ``should_stop()`` turned true mid-way (nothing is cached then).
    """
    key = cache_key(kind="text", texts=texts, encoder=_folder_id(encoder_path), tokens=max_tokens)
    path = cache_dir / f"text-{key}.safetensors"
    if path.is_file():
        progress(len(texts), len(texts), f"text embeddings reused from {path.name}")
        return load_file(str(path))

    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(encoder_path)

    def run_batch(encoder, batch: list[str]) -> dict[str, torch.Tensor]:
        tok = tokenizer(
            batch, padding="max_length", truncation=True, max_length=max_tokens, return_tensors="pt"
        ).to(device)
        out = encoder(**tok).last_hidden_state  # (b, T, D)
        return {"hidden": out.float().cpu(), "mask": tok["attention_mask"].cpu()}

    chunks = run_encoder(
        lambda: AutoModel.from_pretrained(encoder_path, dtype=torch.float32).eval(),
        run_batch,
        texts,
        memory=memory,
        device=device,
        telemetry=telemetry,
        should_stop=should_stop,
        progress=lambda done: progress(done, len(texts), "encoding captions"),
    )
    if chunks is None:
        return None
    hidden, masks = chunks["hidden"], chunks["mask"]
    h, m = torch.cat(hidden), torch.cat(masks)  # (U, T, D), (U, T)
    pooled = (h * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp(min=1)  # (U, D)
    out = {"hidden": h, "mask": m.to(torch.int64), "pooled": pooled}
    _atomic_save(out, path, {"texts": json.dumps(texts)})
    return out


def run_encoder(
    load: Callable[[], torch.nn.Module],
    run_batch: Callable[[torch.nn.Module, list[str]], dict[str, torch.Tensor]],
    texts: list[str],
    *,
    memory: MemoryConfig,
    device: torch.device,
    telemetry,
    should_stop: Callable[[], bool],
    progress: Callable[[int], None],
    checkpoint_dir: Path | None = None,
    attach: Callable[[torch.nn.Module | None], None] | None = None,
) -> dict[str, list[torch.Tensor]] | None:
    """Stage 1's one text-encoder pass, for every family: ``load()`` the encoder (eval, on the
    CPU), block-swap it through an inference strategy of ``memory.for_text_encoder()`` when
    ``memory.stagehand.text_encoder_block_swap`` is on (streaming file-backed from
    ``checkpoint_dir`` when given), else move it onto ``device``; run
    ``run_batch(encoder, texts[i : i + ENCODE_BATCH])`` -> ``{key: (b, ...) CPU tensor}`` under
    ``torch.inference_mode`` as step 0 of the run's telemetry; then release the encoder, its
    strategy and pinned pool (``close``, ``del``, ``gc``, CUDA cache) -- the seed's bug 3 was an
    OOM from skipping that. ``attach(encoder)`` hands the encoder to whoever calls it (a
    pipeline's attribute) and ``attach(None)`` takes it back first at release.

    Returns ``{key: [per-batch tensors]}`` in ``texts`` order, or None when ``should_stop()``
    turned true mid-way. ``progress(done)`` after each batch.
    """

    encoder = load()
    strategy = None
    swap = memory.stagehand is not None and memory.stagehand.text_encoder_block_swap
    if memory.strategy != "none" and swap:
        # The seed block-swaps Gemma 3 through the weight runtime in inference mode; SquareQ
        # only with text_encoder_squareq.
        strategy = build_strategy(
            encoder,
            memory.for_text_encoder(),
            device=device,
            telemetry=telemetry,
            checkpoint_dir=checkpoint_dir,
            mode="inference",
        )
    else:
        encoder.to(device)
    if attach is not None:
        attach(encoder)
    chunks: dict[str, list[torch.Tensor]] = {}
    try:
        # Stage 1 is step 0 of the run's telemetry: inference steps, training starts at 1.
        with torch.inference_mode():
            with strategy.step(0) if strategy else nullcontext():
                with strategy.forward() if strategy else nullcontext():
                    for i in range(0, len(texts), ENCODE_BATCH):
                        if should_stop():
                            return None
                        got = run_batch(encoder, texts[i : i + ENCODE_BATCH])
                        for key, value in got.items():
                            chunks.setdefault(key, []).append(value)
                        progress(min(i + ENCODE_BATCH, len(texts)))
    finally:
        if attach is not None:
            attach(None)
        if strategy is not None:
            strategy.close()
        del strategy, encoder
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return chunks


def encode_latents(
    samples: list[Sample],
    vae_path: Path,
    *,
    resolution: int,
    bucketing: bool,
    background: tuple[int, int, int],
    device: torch.device,
    cache_dir: Path,
    progress: Callable[[int, int, str], None],
    should_stop: Callable[[], bool],
    family: Family,
    frames: int | None = None,
) -> tuple[list[torch.Tensor], float] | None:
    """Latents per sample ((C, h, w) or (C, F, h, w), scaled) and the VAE's scaling factor;
    transparent pixels are composited onto ``background`` (8-bit RGB).

    The ``family`` loads the VAE (``family.load_vae``)
    and normalises as its pipeline does (``family.encode_pixels``: (n, 3, H, W) ->
    (n, C, h, w)); a ``clips`` family's 3D VAE encodes each clip whole (``clips.load_clip``:
    ``frames`` frames, or an image as one): (1, 3, F, H, W) -> (C, F', h, w).

    Returns None when ``should_stop()`` turned true mid-way.
    """
    files = [[(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in s.files] for s in samples]
    key = cache_key(
        kind="latents",
        files=files,
        vae=_folder_id(vae_path),
        res=resolution,
        bucket=bucketing,
        background=background,
        **family.latent_key(frames),
    )
    path = cache_dir / f"latents-{key}.safetensors"
    if path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            scale = float(f.metadata()["scaling_factor"])
        stored = load_file(str(path))
        progress(len(samples), len(samples), f"latents reused from {path.name}")
        return [stored[f"latent.{i}"] for i in range(len(samples))], scale

    vae = family.load_vae(vae_path).to(device)
    scale = float(getattr(vae.config, "scaling_factor", None) or 1.0)
    latents: list[torch.Tensor] = []
    if family.clips:
        try:
            return _encode_clips(samples, vae, family, frames, resolution, bucketing,
                                 background, device, path, progress, should_stop)  # fmt: skip
        finally:
            del vae
            gc.collect()
    try:
        with torch.inference_mode():
            pending: list[torch.Tensor] = []
            for i, sample in enumerate(samples):
                if should_stop():
                    return None
                pixels = load_sample(sample, resolution, bucketing, background)  # (3,H,W)/(F,3,H,W)
                frames = pixels if pixels.dim() == 4 else pixels[None]
                pending.append(frames)
                last = i == len(samples) - 1
                same = not last and load_shape(samples[i + 1], pixels, resolution, bucketing)
                if sum(p.shape[0] for p in pending) < ENCODE_BATCH and same:
                    continue
                batch = torch.cat(pending).to(device)  # (n, 3, H, W)
                z = family.encode_pixels(vae, batch).float().cpu()  # (n, C, h, w)
                for p in pending:
                    part, z = z[: p.shape[0]], z[p.shape[0] :]
                    video = p.shape[0] > 1  # a clip: (F, C, h, w) -> (C, F, h, w)
                    latents.append(part.permute(1, 0, 2, 3).clone() if video else part[0].clone())
                pending = []
                progress(i + 1, len(samples), "encoding images")
    finally:
        del vae
        gc.collect()
    tensors = {f"latent.{i}": z for i, z in enumerate(latents)}
    _atomic_save(tensors, path, {"scaling_factor": repr(scale)})
    return latents, scale


def _encode_clips(
    samples,
    vae,
    family,
    frames,
    resolution,
    bucketing,
    background,
    device,
    path,
    progress,
    should_stop,
) -> tuple[list[torch.Tensor], float] | None:
    """One clip at a time through a video family's 3D VAE; cached like the images."""

    latents = []
    with torch.inference_mode():
        for i, sample in enumerate(samples):
            if should_stop():
                return None
            pixels = load_clip(sample, frames, resolution, bucketing, background)  # (F,3,H,W)
            batch = pixels.permute(1, 0, 2, 3)[None].to(device)  # (1, 3, F, H, W)
            latents.append(family.encode_pixels(vae, batch)[0].float().cpu())  # (C, F', h, w)
            progress(i + 1, len(samples), "encoding clips")
    _atomic_save({f"latent.{i}": z for i, z in enumerate(latents)}, path, {"scaling_factor": "1.0"})
    return latents, 1.0


def load_shape(nxt: Sample, pixels: torch.Tensor, resolution: int, bucketing: bool) -> bool:
    """Whether ``nxt`` loads to the same pixel size as ``pixels`` (so they batch together)."""
    if not bucketing:
        return True

    return target_size(image_hw(nxt.files[0]), resolution, True) == tuple(pixels.shape[-2:])
