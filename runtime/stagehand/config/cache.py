"""The workbench's cache folder: the demo assets, the stage-1 caches and SquareQ's 8-bit images
live there. The server (``workbench.services.settings``, the demo build's status file) and the worker (the
model factory, ``stagehand.squareq.store``) must find the same folder, so its rule is written
once, here: ``$STAGEHAND_WORKBENCH_CACHE``, else ``~/.cache/stagehand-workbench``.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "STAGEHAND_WORKBENCH_CACHE"
DEFAULT_CACHE = Path("~/.cache/stagehand-workbench")


def cache_dir(explicit: str | os.PathLike | None = None) -> Path:
    """``explicit``, else ``$STAGEHAND_WORKBENCH_CACHE``, else ``~/.cache/stagehand-workbench``
    (absolute; not created)."""
    if explicit is not None:
        root = Path(explicit)
    elif os.environ.get(ENV_VAR):
        root = Path(os.environ[ENV_VAR])
    else:
        root = DEFAULT_CACHE
    return root.expanduser().absolute()
