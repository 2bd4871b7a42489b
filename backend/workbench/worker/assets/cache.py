"""Cache folder handling and the atomic "build once" helper shared by the asset factory.

Layout under the cache root::

    <root>/models/<arch>-<size>/      diffusers model folders (sharded safetensors)
    <root>/data/digits-<size>px/      image folder (PNG + .txt caption pairs)

Every finished folder holds a ``.complete`` marker whose content is a hash of the
spec it was built from; a folder without a matching marker is rebuilt.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stagehand.config.cache import DEFAULT_CACHE, ENV_VAR
from stagehand.config.cache import cache_dir as cache_dir_of
from workbench.worker.asset_status import MARKER

__all__ = [
    "DEFAULT_CACHE",
    "ENV_VAR",
    "MARKER",
    "AssetError",
    "build_once",
    "cache_root",
    "is_complete",
    "library_version",
    "spec_hash",
]


class AssetError(ValueError):
    """Raised for a bad asset request: unknown arch/size, unwritable cache, missing package."""


def cache_root(cache_dir: str | os.PathLike | None = None, *, create: bool = True) -> Path:
    """Return the cache root: ``cache_dir``, else ``$STAGEHAND_WORKBENCH_CACHE``, else
    ``~/.cache/stagehand-workbench``.

    With ``create=True`` (default) the folder is created and checked to be writable;
    failure raises :class:`AssetError` naming the folder and the fix.
    """
    root = cache_dir_of(cache_dir)
    if create:
        _ensure_writable(root)
    return root


def _ensure_writable(folder: Path) -> None:
    probe = folder / f".write-probe-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise AssetError(
            f"cache folder {str(folder)!r} is not writable ({exc.__class__.__name__}: {exc}). "
            f"Set {ENV_VAR}=/some/writable/folder (or pass cache_dir=...) to use another one."
        ) from exc


def library_version(name: str) -> str:
    """The installed version of the library ``name`` (``"diffusers"``), as its ``__version__``
    says, read from its distribution's metadata so that it is not imported: the keys of the
    stages are checked before any stage runs, and importing diffusers costs ~2 CPU-s (its model
    classes ~3 more) that a build stopping at the digits, or finding another build running, never
    needed. Without metadata (a library on ``sys.path`` only), the module's ``__version__``."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return importlib.import_module(name).__version__


def spec_hash(spec: Any) -> str:
    """Stable sha256 of a JSON-serialisable spec."""
    blob = json.dumps(spec, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def is_complete(folder: Path, digest: str) -> bool:
    marker = folder / MARKER
    try:
        return marker.read_text().strip() == digest
    except OSError:
        return False


def build_once(final: Path, spec: Any, build: Callable[[Path], None]) -> Path:
    """Build ``final`` with ``build(tmp_folder)`` unless it already holds a matching marker.

    The build goes into a sibling temp folder; the marker is written only after ``build``
    returns, then the folder is renamed into place (atomic on one filesystem). A stale
    ``final`` (no marker or another spec's marker) is replaced. If another process wins the
    race, its result is kept and ours is discarded.
    """
    digest = spec_hash(spec)
    if is_complete(final, digest):
        return final
    _ensure_writable(final.parent)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        build(tmp)
        (tmp / MARKER).write_text(digest + "\n")
        if final.exists():
            if is_complete(final, digest):  # someone else finished meanwhile
                return final
            stale = final.parent / f".{final.name}.stale-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(final, stale)
            except OSError:
                pass
            else:
                shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if is_complete(final, digest):
                return final
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
