"""Where the workbench's package data lies: the built-in presets (``presets/*.json``) and the
dashboard (``frontend/``: ``index.html``, ``js/``, ``css/``).

Both live at the repository's top level and reach the package through the links
``backend/workbench/presets`` and ``backend/workbench/frontend`` (a wheel holds copies), so
``importlib.resources`` finds them the same way from a checkout, an editable install and an
installed wheel; nothing looks for the repository root.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def package_dir(name: str) -> Path:
    """The folder ``name`` of the installed ``workbench`` package (a plain folder: the package is
    never imported from a zip)."""
    return Path(str(files("workbench") / name))


PRESETS_DIR = package_dir("presets")
"""The built-in presets, one ``NAME.json`` each."""
FRONTEND_DIR = package_dir("frontend")
"""The dashboard's static files (``index.html`` and what it loads)."""
