"""A messy image folder, as users have them: every mode and format the trainer reads, odd sizes,
and every kind of file the dataset scan must leave out, with what the scan should say.

Used by the trainer's scan tests and by the backend's ``POST /api/data/scan`` test (imported as
``tests.worker.messy_data``).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

USABLE = [
    "G_UPPER.PNG",
    "a_gray.png",
    "b_palette.png",
    "c_rgba.png",
    "d_16bit.png",
    "e_photo.jpg",
    "f_web.webp",
    "k_no_caption.png",
    "l_latin1.png",
]
"""Images that train, in name order (upper case sorts first)."""
BAD = {
    "h_corrupt.png": "not an image Pillow can read",
    "i_empty.png": "empty file (0 bytes)",
    "j_truncated.jpg": "unreadable image (OSError: image file is truncated",
    "orphan.txt": "caption without an image",
}
"""Files ``on_bad_file`` is about -> the start of the reason the scan gives."""
LEFT_OUT = {
    "._a_gray.png": "hidden file",
    ".hidden.png": "hidden file",
    ".hidden.txt": "hidden file",
    "notes.md": "not an image",
    "sub/": "a folder",
}
"""Files only listed (not bad) -> the start of their reason."""
WARNED = {
    "k_no_caption.png": "no caption file (k_no_caption.txt)",
    "l_latin1.txt": "not UTF-8 (byte 0xe9 at offset 3): read as cp1252: 'café au lait'",
}


def _noise(h: int, w: int, channels: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (h, w, channels), dtype=np.uint8)


def build_messy(folder: Path) -> Path:
    """Write the messy folder into ``folder`` (created) and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(_noise(24, 40, 1, 0)[..., 0], mode="L").save(folder / "a_gray.png")
    Image.fromarray(_noise(37, 21, 3, 1)).convert("P").save(folder / "b_palette.png")
    rgba = _noise(32, 32, 4, 2)
    rgba[:16, :, 3] = 0  # top half transparent
    Image.fromarray(rgba, mode="RGBA").save(folder / "c_rgba.png")
    ramp = np.tile(np.linspace(0, 65535, 48), (20, 1)).astype(np.uint16)
    Image.fromarray(ramp).save(folder / "d_16bit.png")
    Image.fromarray(_noise(30, 45, 3, 3)).save(folder / "e_photo.jpg", quality=90)
    Image.fromarray(_noise(33, 33, 3, 4)).save(folder / "f_web.webp")
    Image.fromarray(_noise(16, 64, 3, 5)).save(folder / "G_UPPER.PNG")
    (folder / "h_corrupt.png").write_bytes(np.random.default_rng(6).bytes(500))
    (folder / "i_empty.png").write_bytes(b"")
    jpeg = io.BytesIO()
    Image.fromarray(_noise(40, 40, 3, 7)).save(jpeg, "JPEG")
    (folder / "j_truncated.jpg").write_bytes(jpeg.getvalue()[: len(jpeg.getvalue()) // 2])
    Image.fromarray(_noise(20, 20, 3, 8)).save(folder / "k_no_caption.png")
    Image.fromarray(_noise(28, 28, 3, 9)).save(folder / "l_latin1.png")
    Image.fromarray(_noise(20, 20, 3, 10)).save(folder / ".hidden.png")
    (folder / "._a_gray.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (folder / "sub").mkdir(exist_ok=True)
    Image.fromarray(_noise(20, 20, 3, 11)).save(folder / "sub" / "inner.png")
    (folder / "notes.md").write_text("where these came from\n")
    for name in USABLE:
        if name not in ("k_no_caption.png", "l_latin1.png"):
            (folder / name).with_suffix(".txt").write_text(f"a picture called {name}\n")
    for name in BAD:
        if name != "orphan.txt":
            (folder / name).with_suffix(".txt").write_text("a caption of a broken file\n")
    (folder / "l_latin1.txt").write_bytes("café au lait".encode("latin-1"))
    (folder / "orphan.txt").write_text("an image that is not there\n")
    (folder / ".hidden.txt").write_text("hidden\n")
    return folder
