"""The dataset scan: which files of a data folder make usable (image, caption) pairs, and why the
others do not, found before anything loads a model.

Layout (the common trainer layout)::

    DIR/0001.png   DIR/0001.txt        one image sample + its caption
    DIR/clip7/     DIR/clip7.txt       a video sample (with ``data.frames``): a folder of frames

The worker scans before stage 1 and records the result as ``trainer/dataset_scan``; the backend
runs the same scan for the New run page (``POST /api/data/scan``). Torch-free: only Pillow
reads the files. Every image used is decoded here once, so a zero-byte, corrupt or truncated
file is named now instead of failing stage 1 with ``OSError: image file is truncated``.

What is left out, each listed with its reason: hidden files (``.x.png``, macOS ``._x.png``),
files that are neither images nor captions, sub-folders (unless they are clips), unreadable
images and clips, captions without an image. The last three are *bad* files: with
``data.on_bad_file: fail`` any of them fails the run. Captions that are not UTF-8 are read as
cp1252 (or Latin-1) with a warning naming the file; an image without a caption takes
``data.default_caption``, or an empty caption with a warning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagehand.config.safe_read import NotRegularFile, open_regular, read_prefix
from workbench.contract.text import shown

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv")
"""Clips the video families (Wan, LTX-2) take, scanned with ``videos=True``."""
MAX_CAPTION_BYTES = 64 << 10
"""Bytes of a caption file read, 64 KiB: the text encoders read a few hundred tokens (CLIP 77, T5
and Qwen 512), a few KB of text. A longer caption is cut with a warning instead of read whole (a
1 GB caption took the server from 0.73 to 2.8 GB, issue 54)."""
LISTED_IN_ERRORS = 20
"""Files an error message names; the ``trainer/dataset_scan`` record lists all of them."""
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


class DataError(ValueError):
    """The data folder is missing, or holds no usable sample, or bad files under ``fail``."""


@dataclass(frozen=True)
class Sample:
    """One training sample: an image (or the frames of a clip) and its caption."""

    files: tuple[Path, ...]
    caption: str


@dataclass(frozen=True)
class Skipped:
    """A file (or folder, named with a trailing ``/``) left out, relative to the data folder."""

    file: str
    """Its name as shown: bytes that are not UTF-8 escaped (``c_\\xff.png``, ``workbench.contract.text``)."""
    reason: str
    bad: bool
    """An unreadable image or clip, or a caption without an image: what ``on_bad_file`` is
    about. Hidden files, other files and plain sub-folders are only listed."""


@dataclass(frozen=True)
class ScanWarning:
    """A file that is used, but not as it stands (caption re-encoded, caption missing)."""

    file: str
    message: str


@dataclass
class Scan:
    """What ``scan_folder`` found: the usable samples, what was left out and why."""

    folder: Path
    on_bad_file: str
    samples: list[Sample] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    warnings: list[ScanWarning] = field(default_factory=list)
    captions_defaulted: int = 0
    """Images that took ``data.default_caption`` (no caption file)."""
    videos: bool = False
    """Video files were samples too (``scan_folder(videos=True)``)."""

    @property
    def bad(self) -> list[Skipped]:
        return [s for s in self.skipped if s.bad]

    def problem(self) -> str | None:
        """Why the run cannot start on this data (no usable sample, or bad files under
        ``on_bad_file: fail``), naming the files; None when it can."""
        if not self.samples:
            kind = "image or clip" if self.videos else "image"
            why = f"data.path: no usable {kind} in {str(self.folder)!r}"
            return _listed(why, self.skipped)
        if self.bad and self.on_bad_file == "fail":
            why = f"data.on_bad_file is fail and {len(self.bad)} file(s) cannot be used"
            return _listed(why, self.bad)
        return None

    def check(self) -> None:
        """Raises ``DataError`` with ``problem()`` when there is one."""
        problem = self.problem()
        if problem is not None:
            raise DataError(problem)

    def record(self) -> dict[str, Any]:
        """The scan as JSON (the ``trainer/dataset_scan`` record and the API's answer)."""
        return {
            "folder": shown(str(self.folder)),
            "usable": len(self.samples),
            "skipped": [{"file": s.file, "reason": s.reason, "bad": s.bad} for s in self.skipped],
            "warnings": [{"file": w.file, "message": w.message} for w in self.warnings],
            "bad": len(self.bad),
            "captions_defaulted": self.captions_defaulted,
            "on_bad_file": self.on_bad_file,
            "problem": self.problem(),
        }


def _listed(why: str, files: list[Skipped]) -> str:
    lines = [f"  {s.file}: {s.reason}" for s in files[:LISTED_IN_ERRORS]]
    if len(files) > LISTED_IN_ERRORS:
        more = len(files) - LISTED_IN_ERRORS
        lines.append(f"  ... and {more} more (the trainer/dataset_scan record lists them all)")
    return why + (":\n" + "\n".join(lines) if lines else " (the folder is empty)")


def image_problem(path: Path) -> str | None:
    """Why Pillow cannot decode ``path`` as an image, or None when it can."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open_regular(path) as f:  # a FIFO or device is named, never waited on
            if os.fstat(f.fileno()).st_size == 0:
                return "empty file (0 bytes)"
            with Image.open(f) as img:
                img.load()  # decodes every byte: a truncated file fails here, not in stage 1
    except NotRegularFile as exc:
        return exc.strerror
    except UnidentifiedImageError:
        return "not an image Pillow can read"
    # Pillow reports a damaged file with OSError, SyntaxError, ValueError, EOFError, zlib and
    # struct errors or DecompressionBombError: whichever it is, this file is not usable.
    except Exception as exc:  # noqa: BLE001
        return f"unreadable image ({type(exc).__name__}: {exc})"
    return None


def clip_problem(path: Path) -> str | None:
    """Why PyAV cannot decode a first frame of the clip at ``path``, or None when it can."""
    import av

    try:
        with open_regular(path) as f:  # a FIFO or device is named, never waited on
            if os.fstat(f.fileno()).st_size == 0:
                return "empty file (0 bytes)"
            with av.open(f) as container:
                next(container.decode(video=0))
    except NotRegularFile as exc:
        return exc.strerror
    except StopIteration:
        return "clip has no video frame"
    # FFmpeg's errors, a container without a video stream (IndexError), a damaged header...
    except Exception as exc:  # noqa: BLE001
        return f"unreadable clip ({type(exc).__name__}: {exc})"
    return None


def read_caption(path: Path) -> tuple[str, str | None]:
    """``(caption, warning)`` of a caption file: UTF-8 (a BOM is dropped); otherwise UTF-16 with
    a BOM, cp1252 or Latin-1, with a warning saying which. At most ``MAX_CAPTION_BYTES`` are
    read: a longer file is cut there (at a character's start), with a warning giving its size.

    Raises:
        NotRegularFile: the file is a FIFO, device or socket (an ``OSError``; never opened).
        OSError: the file cannot be read.
    """
    raw, size = read_prefix(path, MAX_CAPTION_BYTES)
    cut = None
    if size > len(raw):
        cut = (
            f"{size} bytes: only the first {len(raw)} are read (the text encoders read a few "
            "hundred tokens); shorten the caption"
        )
    text, warning = _decode(raw, cut is not None)
    return text, "; ".join(w for w in (cut, warning) if w) or None


def _decode(raw: bytes, cut: bool) -> tuple[str, str | None]:
    """``read_caption``'s text and encoding warning of ``raw``; a ``cut`` prefix may end inside
    a UTF-8 character, which is dropped."""
    try:
        return raw.decode("utf-8-sig").strip(), None
    except UnicodeDecodeError as exc:
        if cut and exc.end == len(raw) and exc.reason == "unexpected end of data":
            return raw[: exc.start].decode("utf-8-sig").strip(), None
        where = f"byte 0x{raw[exc.start]:02x} at offset {exc.start}"
    if raw[:2] in _UTF16_BOMS:
        encoding = "UTF-16"
        text = raw.decode("utf-16", errors="replace")  # a cut may split a character
    else:
        try:
            encoding, text = "cp1252", raw.decode("cp1252")
        except UnicodeDecodeError:  # bytes cp1252 leaves undefined; Latin-1 maps every byte
            encoding, text = "Latin-1", raw.decode("latin-1")
    text = text.strip()
    return text, f"not UTF-8 ({where}): read as {encoding}: {text[:60]!r}"


def scan_folder(
    folder: str | Path,
    *,
    captions: str = "txt",
    default_caption: str | None = None,
    limit: int | None = None,
    frames: int | None = None,
    on_bad_file: str = "skip",
    videos: bool = False,
) -> Scan:
    """Scan ``folder`` in name order until ``limit`` usable samples (all of it without one).

    With ``frames``, sub-folders are clips of at least ``frames`` images (the first ``frames``,
    by name, are used) and a still image is a clip of identical frames. With ``videos`` (the
    video families), video files (``VIDEO_SUFFIXES``) are samples too, each checked to decode.

    Raises:
        DataError: ``folder`` is not a folder. (A folder without a usable sample is a ``Scan``
            whose ``check()`` raises, so its list can be recorded first.)
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"data.path: {str(folder)!r} is not a folder")
    suffix = "." + captions.lstrip(".")
    scan = Scan(folder=folder, on_bad_file=on_bad_file, videos=videos)
    entries = sorted(folder.iterdir())
    kinds = IMAGE_SUFFIXES + (VIDEO_SUFFIXES if videos else ())
    owners = [e for e in entries if not e.name.startswith(".") and _is_sample(e, frames, kinds)]
    names = {e.name for e in entries}
    # A caption differing only in case (IMG_1.TXT beside IMG_1.JPG, as Windows and cameras
    # write them) is the image's caption; an exact match wins.
    folded = {n.lower(): n for n in sorted(names) if n.lower().endswith(suffix.lower())}
    caption_of = {}
    for e in owners:
        want = e.with_suffix(suffix).name
        caption_of[e] = want if want in names else folded.get(want.lower(), want)
    claimed = set(caption_of.values())
    for entry in entries:
        if limit is not None and len(scan.samples) >= limit:
            break
        name = shown(entry.name) + ("/" if entry.is_dir() else "")
        if entry.name.startswith("."):
            scan.skipped.append(Skipped(name, "hidden file", bad=False))
        elif entry.name.lower().endswith(suffix.lower()) and not entry.is_dir():
            if entry.name not in claimed:
                scan.skipped.append(Skipped(name, "caption without an image", bad=True))
        elif not _is_sample(entry, frames, kinds):
            if entry.is_dir() and videos:
                why = f"a folder: clips are video files ({', '.join(VIDEO_SUFFIXES)})"
            elif entry.is_dir():
                why = "a folder: sub-folders are read only as clips (data.frames)"
            else:
                what = "an image or clip" if videos else "an image"
                why = f"not {what} ({', '.join(kinds)}) or a {suffix} caption"
            scan.skipped.append(Skipped(name, why, bad=False))
        else:
            _add_sample(scan, entry, folder / caption_of[entry], default_caption, frames)
    return scan


def _is_sample(entry: Path, frames: int | None, kinds: tuple[str, ...]) -> bool:
    if entry.is_dir():
        return frames is not None
    return entry.suffix.lower() in kinds


def _add_sample(
    scan: Scan, entry: Path, cap: Path, default_caption: str | None, frames: int | None
) -> None:
    """Checks one image or clip and its caption ``cap``; appends a ``Sample`` or a ``Skipped``."""
    rel = shown(entry.name)
    if entry.is_dir():
        stack = sorted(
            p
            for p in entry.iterdir()
            if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".")
        )
        if len(stack) < (frames or 1):
            why = f"clip has {len(stack)} frames, expected at least {frames}"
            scan.skipped.append(Skipped(rel + "/", why, bad=True))
            return
        files = tuple(stack[:frames])
    else:
        files = (entry,) * (frames or 1)  # a still image is a clip of identical frames
    for frame in dict.fromkeys(files):
        video = frame.suffix.lower() in VIDEO_SUFFIXES
        problem = clip_problem(frame) if video else image_problem(frame)
        if problem is not None:
            name = shown(str(frame.relative_to(scan.folder)))
            scan.skipped.append(Skipped(name, shown(problem), bad=True))
            return
    if cap.exists() and not cap.is_dir():  # a FIFO or device caption is named, not waited on
        try:
            caption, warning = read_caption(cap)
        except OSError as exc:
            why = f"its caption {shown(cap.name)} cannot be read ({exc.strerror or exc})"
            scan.skipped.append(Skipped(rel, why, bad=True))
            return
        if warning is not None:
            scan.warnings.append(ScanWarning(shown(cap.name), warning))
        if not caption:
            scan.warnings.append(
                ScanWarning(shown(cap.name), "empty caption: trains with an empty caption")
            )
    elif default_caption is not None:
        caption = default_caption
        scan.captions_defaulted += 1
    else:
        caption = ""
        why = f"no caption file ({shown(cap.name)}): trains with an empty caption (set data.default_caption)"
        scan.warnings.append(ScanWarning(rel, why))
    scan.samples.append(Sample(files, caption))
