"""The preset: the JSON a run is configured by, as the server, the worker and the planner read it
(pydantic; no torch).

``schema``: the sections, ``Preset`` and the constants (model types, bounds, ``PRESETS_DIR``);
``errors``: ``PresetError`` and its lines ``JSON.path: found <value>, expected <what>``;
``merge``: dicts merged deep (``merge_overrides``: the planner's candidate limits, a tune's
trials); ``overrides``: a run's overrides applied to its preset (``apply_overrides``: the
server's run, scan and tune configs; a folder drops the preset's ``bound_fields``, null removes a
key). Loading a preset by name, listing the built-in ones
and validating a whole preset with every problem listed are the application's
(``workbench.worker.preset``).
"""

from workbench.contract.preset.errors import PresetError, field_error, field_errors, found_text
from workbench.contract.preset.merge import merge_overrides
from workbench.contract.preset.overrides import apply_overrides, bound_fields
from workbench.contract.preset.schema import *  # noqa: F403  (the sections, Preset and the constants)
from workbench.contract.preset.schema import __all__ as _schema_names

__all__ = [
    "PresetError",
    "apply_overrides",
    "bound_fields",
    "field_error",
    "field_errors",
    "found_text",
    "merge_overrides",
    *_schema_names,
]
