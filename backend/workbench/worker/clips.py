"""Video clips for the video pipeline families: a folder of ``.mp4`` / ``.webm`` / ``.mov`` /
``.mkv`` files with ``.txt`` captions beside them, decoded with PyAV (FFmpeg's bindings); images
in the same folder are clips of one frame. The folder is scanned as the image families' are
(``scan.scan_folder(videos=True)``: hidden, unreadable and uncaptioned files are named).

Each clip gives its first ``data.frames`` frames, each resized to cover the target size and
center-cropped (the same rule as ``data.load_image``), as (F, 3, H, W) in [-1, 1].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from workbench.worker.data import WHITE, image_hw, load_image, target_size
from workbench.worker.scan import VIDEO_SUFFIXES, DataError, Sample


def is_video(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_SUFFIXES


def _frames(path: Path, count: int | None):
    """The first ``count`` frames (all with None) of a clip as PIL images.

    Raises:
        DataError: the file cannot be decoded, or has fewer than ``count`` frames.
    """
    import av

    out = []
    try:
        with av.open(str(path)) as container:
            for frame in container.decode(video=0):
                out.append(frame.to_image())
                if count is not None and len(out) >= count:
                    break
    except (av.FFmpegError, IndexError, ValueError) as exc:
        raise DataError(
            f"data.path: clip {path.name!r} cannot be decoded ({type(exc).__name__}: {exc}); "
            "expected a video FFmpeg reads (mp4, webm, mov, mkv)"
        ) from None
    if count is not None and len(out) < count:
        raise DataError(
            f"data.frames: clip {path.name!r} has {len(out)} frames, expected >= {count}"
        )
    return out


def frame_count(path: Path) -> int:
    """Frames of the clip at ``path``: the container's count, or the decoded frames when the
    container gives none (webm, mkv).

    Raises:
        DataError: the file cannot be decoded.
    """
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            if stream.frames:
                return int(stream.frames)
            return sum(1 for _ in container.decode(video=0))
    except (av.FFmpegError, IndexError, ValueError) as exc:
        raise DataError(
            f"data.path: clip {path.name!r} cannot be decoded ({type(exc).__name__}: {exc}); "
            "expected a video FFmpeg reads (mp4, webm, mov, mkv)"
        ) from None


def default_frames(samples: list[Sample], temporal: int) -> tuple[int, str]:
    """``(frames, why)``: ``data.frames`` for a video family when the preset leaves it out. 1
    for a folder of images (each is a clip of one frame); with clips, the largest
    ``temporal * k + 1`` (what a VAE compressing ``temporal`` frames into one after the first
    takes) that every clip can give, i.e. the shortest clip's.

    Raises:
        DataError: a clip cannot be decoded or has no frame (names the file).
    """
    counts = {s.files[0].name: frame_count(s.files[0]) for s in samples if is_video(s.files[0])}
    if not counts:
        return 1, "default for a folder of images: 1 frame"
    shortest = min(counts, key=counts.__getitem__)
    if counts[shortest] < 1:
        raise DataError(f"data.path: clip {shortest!r} has no frame")
    frames = (counts[shortest] - 1) // temporal * temporal + 1
    return frames, (
        f"default: the largest {temporal}k + 1 every clip gives "
        f"({len(counts)} clips, the shortest {shortest!r} has {counts[shortest]} frames)"
    )


def _fit(img, hw: tuple[int, int]) -> torch.Tensor:
    """(3, H, W) in [-1, 1]: resized to cover ``hw``, center-cropped (as ``data.load_image``)."""
    from PIL import Image

    img = img.convert("RGB")
    h, w = hw
    scale = max(h / img.height, w / img.width)
    new = (max(w, round(img.width * scale)), max(h, round(img.height * scale)))
    img = img.resize(new, Image.Resampling.BICUBIC)
    left, top = (new[0] - w) // 2, (new[1] - h) // 2
    arr = np.asarray(img.crop((left, top, left + w, top + h)), dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def load_clip(
    sample: Sample,
    frames: int | None,
    resolution: int,
    bucketing: bool,
    background: tuple[int, int, int] = WHITE,
) -> torch.Tensor:
    """(F, 3, H, W) in [-1, 1]: ``frames`` frames of a clip, or an image as one frame (read as
    ``data.load_image`` reads it: upright, 16-bit scaled, transparency on ``background``).

    Raises:
        DataError: a clip that cannot be decoded or is too short (names the file).
    """
    path = sample.files[0]
    if not is_video(path):
        hw = target_size(image_hw(path), resolution, bucketing)
        return load_image(path, hw, background)[None]  # (1, 3, H, W)
    images = _frames(path, frames)
    hw = target_size((images[0].height, images[0].width), resolution, bucketing)
    return torch.stack([_fit(img, hw) for img in images])
