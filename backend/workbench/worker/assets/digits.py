"""A real (tiny) image data set: scikit-learn's bundled 8x8 handwritten digits.

``build_digits`` writes the 1,797 samples as an image folder in the common trainer layout::

    00000.png   RGB, ``size`` x ``size`` px, white digit on black
    00000.txt   "a handwritten digit zero"
    ...

No download: ``sklearn.datasets.load_digits`` ships with scikit-learn.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from workbench.worker.asset_status import digits_folder

from .cache import build_once, cache_root

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
NUM_DIGITS = 1797


def caption_for(label: int) -> str:
    """Caption for a digit label, e.g. 7 -> "a handwritten digit seven"."""
    return f"a handwritten digit {DIGIT_NAMES[int(label)]}"


def digit_pixels(size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """``(images (N, size, size) uint8, labels (N,) int)``: the digits as the folder holds them
    (0..16 scaled to 0..255, bicubic upscale), in the folder's order. Copies of one cached
    computation (it takes ~1 s)."""
    images, labels = _digit_pixels(int(size))
    return images.copy(), labels.copy()


@functools.lru_cache(maxsize=4)
def _digit_pixels(size: int) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image
    from sklearn.datasets import load_digits

    data = load_digits()
    small = np.clip(np.rint(data.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    resample = Image.Resampling.BICUBIC
    images = [
        np.asarray(Image.fromarray(im, mode="L").resize((size, size), resample)) for im in small
    ]
    return np.stack(images), data.target.astype(np.int64)


def digits_dir(cache_dir: str | os.PathLike | None = None, size: int = 64) -> Path:
    """Where the digits folder for ``size`` lives (built or not)."""
    return cache_root(cache_dir, create=False) / digits_folder(size)


def digits_spec(size: int) -> dict:
    """What the digits folder at ``size`` px is built from (its ``.complete`` is this hash)."""
    return {"dataset": "sklearn.load_digits", "size": int(size), "resample": "bicubic", "format": 1}


def build_digits(
    cache_dir: str | os.PathLike | None = None,
    size: int = 64,
    advance: Callable[[int], None] | None = None,
) -> Path:
    """Write (once) the digits image folder upscaled (bicubic) to ``size`` px; return it.
    ``advance(1)`` is called per image written (``NUM_DIGITS`` in all)."""
    if int(size) < 8:
        raise ValueError(f"size must be >= 8 px, got {size}")
    size = int(size)
    root = cache_root(cache_dir)
    final = root / digits_folder(size)

    def _build(tmp: Path) -> None:
        from PIL import Image

        images, labels = digit_pixels(size)
        for i, (img, label) in enumerate(zip(images, labels, strict=True)):
            Image.fromarray(img, mode="L").convert("RGB").save(tmp / f"{i:05d}.png", format="PNG")
            (tmp / f"{i:05d}.txt").write_text(caption_for(label) + "\n")
            if advance is not None:
                advance(1)

    return build_once(final, digits_spec(size), _build)
