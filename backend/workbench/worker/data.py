"""Training data: images (or frame stacks) brought to the training size, aspect buckets, batches.

Which files make samples is the dataset scan's business (``scan.py``). Images are converted to
8-bit RGB without damage (``to_rgb``), turned upright as their EXIF orientation says (phones store
portrait photos as landscape pixels with an orientation tag), resized (shorter side to the target) and center-cropped
to ``resolution`` x ``resolution``, or, with bucketing, to the aspect bucket nearest their own
aspect ratio (``resolution**2`` pixels, sides multiples of 64 so every family's latent patching
divides).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from workbench.worker.scan import Sample

BUCKET_MULTIPLE = 64
"""Bucket sides are multiples of this (VAE 8x times a 2x2 patch, with room to spare)."""
WHITE = (255, 255, 255)
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N", "I")
"""Modes Pillow opens 16-bit grayscale PNGs in (``I``: 32-bit ints holding 0..65535)."""
_QUARTER_TURNS = (5, 6, 7, 8)
"""EXIF orientations that turn the stored pixels a quarter turn (transposed or rotated 90)."""


def buckets(resolution: int) -> list[tuple[int, int]]:
    """Aspect buckets ``(height, width)`` of about ``resolution**2`` pixels, from 1:2 to 2:1."""
    area = resolution * resolution
    out = set()
    for h in range(BUCKET_MULTIPLE, 2 * resolution + 1, BUCKET_MULTIPLE):
        w = int(round(area / h / BUCKET_MULTIPLE)) * BUCKET_MULTIPLE
        if w >= BUCKET_MULTIPLE and 0.5 <= h / w <= 2.0:
            out.add((h, w))
    return sorted(out) or [(resolution, resolution)]


def target_size(size_hw: tuple[int, int], resolution: int, bucketing: bool) -> tuple[int, int]:
    """``(height, width)`` an image of ``size_hw`` is brought to."""
    if not bucketing:
        return resolution, resolution
    aspect = size_hw[0] / size_hw[1]
    return min(buckets(resolution), key=lambda b: abs(np.log(b[0] / b[1]) - np.log(aspect)))


def to_rgb(img, background: tuple[int, int, int] = WHITE):
    """8-bit RGB of a Pillow image of any mode, without the damage ``img.convert("RGB")`` does:
    16-bit samples are scaled to 8 bits (``convert`` clips them: a 16-bit PNG came out with 61%
    of its pixels at 255), and transparent pixels are composited onto ``background`` (``convert``
    drops the alpha and keeps whatever colour lies under it)."""
    from PIL import Image

    if img.mode in _SIXTEEN_BIT:
        levels = np.asarray(img, dtype=np.float64) / 257.0  # 65535 -> 255
        img = Image.fromarray(np.clip(np.rint(levels), 0, 255).astype(np.uint8), mode="L")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        under = Image.new("RGBA", rgba.size, (*background, 255))
        return Image.alpha_composite(under, rgba).convert("RGB")
    return img.convert("RGB")


def image_hw(path: Path) -> tuple[int, int]:
    """``(height, width)`` of the image at ``path`` as it is shown: EXIF orientations 5-8 turn
    it a quarter turn, so its stored sides swap."""
    from PIL import ExifTags, Image

    with Image.open(path) as img:
        turned = img.getexif().get(ExifTags.Base.Orientation) in _QUARTER_TURNS
        return (img.width, img.height) if turned else (img.height, img.width)


def load_image(
    path: Path, hw: tuple[int, int], background: tuple[int, int, int] = WHITE
) -> torch.Tensor:
    """(3, H, W) float32 in [-1, 1]: turned upright (EXIF orientation), resized so it covers
    ``hw``, then center-cropped. Transparent pixels show ``background``."""
    from PIL import Image, ImageOps

    with Image.open(path) as img:
        img = to_rgb(ImageOps.exif_transpose(img), background)
        h, w = hw
        scale = max(h / img.height, w / img.width)
        new = (max(w, round(img.width * scale)), max(h, round(img.height * scale)))
        img = img.resize(new, Image.Resampling.BICUBIC)
        left, top = (new[0] - w) // 2, (new[1] - h) // 2
        img = img.crop((left, top, left + w, top + h))
        arr = np.asarray(img, dtype=np.float32) / 127.5 - 1.0  # (H, W, 3)
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def load_sample(
    sample: Sample, resolution: int, bucketing: bool, background: tuple[int, int, int] = WHITE
) -> torch.Tensor:
    """(3, H, W) for an image, (F, 3, H, W) for a clip of ``F`` frames."""
    hw = target_size(image_hw(sample.files[0]), resolution, bucketing)
    frames = [load_image(f, hw, background) for f in sample.files]
    return frames[0] if len(frames) == 1 else torch.stack(frames)


def group_by_shape(shapes: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
    """Sample indices grouped by latent shape (one bucket per shape), in index order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, shape in enumerate(shapes):
        groups.setdefault(tuple(shape), []).append(i)
    return groups


def batch_indices(
    groups: dict[tuple[int, ...], list[int]], batch_size: int, generator: torch.Generator
) -> list[int]:
    """``batch_size`` sample indices from one bucket, drawn with ``generator`` (deterministic per
    step, so a resumed run draws the same batches as an uninterrupted one)."""
    keys = sorted(groups)
    sizes = torch.tensor([len(groups[k]) for k in keys], dtype=torch.float64)
    bucket = keys[int(torch.multinomial(sizes, 1, generator=generator))]
    members = groups[bucket]
    picks = torch.randint(len(members), (batch_size,), generator=generator)
    return [members[int(i)] for i in picks]
