"""Stage 1 of a run: scan the data folder, then cache text embeddings and latents.

The scan comes before any model is built or loaded, so a folder without a usable sample ends
the run in seconds (``trainer/dataset_scan`` names every file left out). The cache (the
family's VAE through ``encode.encode_latents``, its text encoders through
``Family.encode_texts``) holds one text row per distinct caption or sample prompt and one
latent per sample; ``build_cache`` returns it as the ``loop.Batchable`` that stage 2 trains on,
or None when a stop request arrived while encoding.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stagehand.common.telemetry import Telemetry
from workbench.contract.preset import Preset
from workbench.contract.text import shown
from workbench.worker import encode, loop
from workbench.worker.assets import cache_root
from workbench.worker.clips import default_frames
from workbench.worker.data import group_by_shape
from workbench.worker.families import Family
from workbench.worker.progress import Progress
from workbench.worker.scan import Sample, scan_folder
from workbench.worker.setup import data_folder, held_out_samples

Stage = Callable[[str, int, int, str], None]
"""``stage(name, done, total, message)``: a ``trainer/stage`` record and a progress line."""


def scan_data(
    preset: Preset, family: Family, telemetry: Telemetry, progress: Progress
) -> list[Sample]:
    """The usable samples of the data folder. The scan is recorded (``trainer/dataset_scan``)
    before ``DataError`` ends a run that has no usable sample, or bad files under
    ``data.on_bad_file: fail``; the error names the files. A ``clips`` family takes clips (and
    images as one-frame clips), checked the same way."""
    data = preset.data
    folder = data_folder(preset)
    family.check_caption_tokens(data.max_caption_tokens)
    video = family.clips
    if video and data.frames is not None:  # left out, it is chosen from the clips (resolve_frames)
        family.check_frames(data.frames)
    found = scan_folder(
        folder,
        captions=data.captions,
        default_caption=data.default_caption,
        limit=data.limit,
        frames=None if video else data.frames,  # a clips family's data.frames: frames per clip
        on_bad_file=data.on_bad_file,
        videos=video,
    )
    telemetry.emit("trainer", "dataset_scan", **found.record())
    progress.line(
        f"data: {len(found.samples)} samples from {shown(str(found.folder))}, {len(found.skipped)} files "
        f"left out ({len(found.bad)} bad), {len(found.warnings)} warnings"
    )
    for item in found.skipped:
        progress.line(f"  left out {item.file}: {item.reason}")
    for item in found.warnings:
        progress.line(f"  warning {item.file}: {item.message}")
    found.check()
    return found.samples


def resolve_frames(
    preset: Preset, family: Family, samples: list[Sample]
) -> tuple[Preset, dict[str, Any]]:
    """The preset with ``data.frames`` set for a ``clips`` family, and the fields the run's first
    record (``trainer/run_started``) carries: ``frames`` and ``frames_from`` (``data.frames``
    when the preset gives it, which always wins, else why the default, ``clips.default_frames``).
    Other families: the preset unchanged and no fields."""
    if not family.clips:
        return preset, {}
    if preset.data.frames is not None:
        return preset, {"frames": preset.data.frames, "frames_from": "data.frames"}
    frames, why = default_frames(samples, family.temporal_ratio())
    family.check_frames(frames)
    data = preset.data.model_copy(update={"frames": frames})
    return preset.model_copy(update={"data": data}), {"frames": frames, "frames_from": why}


def build_cache(
    preset: Preset,
    family: Family,
    vae_dir: Path,
    encoder_dir: Path | None,
    samples: list[Sample],
    *,
    device: torch.device,
    telemetry: Telemetry,
    stage: Stage,
    should_stop: Callable[[], bool],
) -> loop.Batchable | None:
    """Text rows (each distinct caption and sample prompt once) and one latent per sample,
    grouped by latent shape for batching; None when ``should_stop`` said so while encoding."""

    data = preset.data
    texts = list(dict.fromkeys([s.caption for s in samples] + preset.samples.prompts))
    total = len(texts) + len(samples)
    cache_dir = cache_root() / "trainer-cache"
    stage("cache", 0, total, f"{len(samples)} samples, {len(texts)} distinct texts")

    # Latents first: the VAE is quick beside the text encoders (T5-XXL streams 9 GB), and a
    # resolution the family cannot patch is named before them.
    result = encode.encode_latents(
        samples,
        vae_dir,
        resolution=preset.resolution,
        bucketing=data.bucketing,
        background=data.background_rgb,
        device=device,
        cache_dir=cache_dir,
        progress=lambda d, t, m: stage("cache", d, total, m),
        should_stop=should_stop,
        family=family,
        frames=data.frames,
    )
    if result is None:
        return None
    latents, _ = result
    _check_resolution(family, preset, tuple(latents[0].shape))
    text_kwargs = dict(
        memory=preset.memory,
        device=device,
        telemetry=telemetry,
        cache_dir=cache_dir,
        max_tokens=data.max_caption_tokens,
        progress=lambda d, t, m: stage("cache", len(samples) + d, total, m),
        should_stop=should_stop,
    )
    dtype = loop.DTYPES[preset.model.dtype]
    text = family.encode_texts(texts, encoder_dir, dtype=dtype, **text_kwargs)
    if text is None:
        return None
    stage("cache", total, total, "text encoder released")
    row = {t: i for i, t in enumerate(texts)}
    held_out = held_out_samples(preset, len(samples))
    train = [i for i in range(len(samples)) if i not in held_out]
    groups = group_by_shape([tuple(latents[i].shape) for i in train])
    return loop.Batchable(
        latents=latents,
        text=text,
        caption_rows=[row[s.caption] for s in samples],
        prompt_rows=[row[p] for p in preset.samples.prompts],
        groups={k: [train[j] for j in v] for k, v in groups.items()},
        held_out=held_out,
    )


def _check_resolution(family: Family, preset: Preset, shape: tuple[int, ...]) -> None:
    """``family.check_latents`` on a sample's latent ``shape``, its error naming
    ``resolution`` and what it takes when the preset chose the size (no bucketing).

    Raises:
        ValueError: the family cannot patch latents of this size.
    """
    try:
        family.check_latents(shape)
    except ValueError as exc:
        if preset.data.bucketing:  # bucket sides are multiples of 64: never the preset's choice
            raise
        h, w = shape[-2:]
        factor = preset.resolution // w
        raise ValueError(
            f"resolution: {preset.resolution} px gives latents of {h} x {w} (the VAE downscales "
            f"{factor}x), and {exc}; expected a multiple of {2 * factor} px, or data.bucketing"
        ) from None
