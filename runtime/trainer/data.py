"""Training data: an image folder with caption files (the common trainer layout), or frame stacks.

Layout::

    DIR/0001.png   DIR/0001.txt        one image sample + its caption
    DIR/clip7/     DIR/clip7.txt       a video sample: a folder of frames (sorted by name)

Images are resized (shorter side to the target) and center-cropped to ``resolution`` x
``resolution``, or, with bucketing, to the aspect bucket nearest their own aspect ratio
(``resolution**2`` pixels, sides multiples of 64 so every family's latent patching divides).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
BUCKET_MULTIPLE = 64
"""Bucket sides are multiples of this (VAE 8x times a 2x2 patch, with room to spare)."""


@dataclass(frozen=True)
class Sample:
    """One training sample: an image (or the frames of a clip) and its caption."""

    files: tuple[Path, ...]
    caption: str


class DataError(ValueError):
    """The data folder is missing, empty or holds unreadable samples."""


def _caption(path: Path, ext: str, default: str) -> str:
    cap = path.with_suffix("." + ext.lstrip("."))
    return cap.read_text(encoding="utf-8").strip() if cap.is_file() else default


def scan_folder(
    folder: str | Path,
    *,
    captions: str = "txt",
    default_caption: str = "",
    limit: int | None = None,
    frames: int | None = None,
) -> list[Sample]:
    """The samples of ``folder``, sorted by name; with ``frames``, sub-folders are clips.

    Raises:
        DataError: the folder does not exist or holds no sample, or a clip has fewer than
            ``frames`` frames.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"data.path: {str(folder)!r} is not a folder")
    samples: list[Sample] = []
    for entry in sorted(folder.iterdir()):
        if frames is not None and entry.is_dir():
            stack = sorted(p for p in entry.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if len(stack) < frames:
                raise DataError(
                    f"data.frames: clip {entry.name!r} has {len(stack)} frames, expected >= {frames}"
                )
            samples.append(
                Sample(tuple(stack[:frames]), _caption(entry, captions, default_caption))
            )
        elif entry.is_file() and entry.suffix.lower() in IMAGE_SUFFIXES:
            files = (entry,) * (frames or 1)  # a still image as a clip of identical frames
            samples.append(Sample(files, _caption(entry, captions, default_caption)))
        if limit is not None and len(samples) >= limit:
            break
    if not samples:
        raise DataError(f"data.path: no images ({', '.join(IMAGE_SUFFIXES)}) in {str(folder)!r}")
    return samples


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


def load_image(path: Path, hw: tuple[int, int]) -> torch.Tensor:
    """(3, H, W) float32 in [-1, 1]: resized so it covers ``hw``, then center-cropped."""
    from PIL import Image

    with Image.open(path) as img:
        img = img.convert("RGB")
        h, w = hw
        scale = max(h / img.height, w / img.width)
        new = (max(w, round(img.width * scale)), max(h, round(img.height * scale)))
        img = img.resize(new, Image.Resampling.BICUBIC)
        left, top = (new[0] - w) // 2, (new[1] - h) // 2
        img = img.crop((left, top, left + w, top + h))
        arr = np.asarray(img, dtype=np.float32) / 127.5 - 1.0  # (H, W, 3)
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def load_sample(sample: Sample, resolution: int, bucketing: bool) -> torch.Tensor:
    """(3, H, W) for an image, (F, 3, H, W) for a clip of ``F`` frames."""
    from PIL import Image

    with Image.open(sample.files[0]) as first:
        hw = target_size((first.height, first.width), resolution, bucketing)
    frames = [load_image(f, hw) for f in sample.files]
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
