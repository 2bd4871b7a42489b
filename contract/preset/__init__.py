"""The preset: the JSON a run is configured by, as the server, the worker and the planner read it
(pydantic; no torch).

``schema``: the sections, ``Preset`` and the constants (model types, bounds, ``PRESETS_DIR``);
``errors``: ``PresetError`` and its lines ``JSON.path: found <value>, expected <what>``;
``merge``: overrides merged into a preset (``merge_overrides``: the server's run and tune
configs, the planner's candidate limits). Loading a preset by name, listing the built-in ones
and validating a whole preset with every problem listed are the application's
(``workbench.preset``).
"""

from contract.preset.errors import PresetError, field_error, found_text
from contract.preset.merge import merge_overrides
from contract.preset.schema import *  # noqa: F403  (the sections, Preset and the constants)
from contract.preset.schema import __all__ as _schema_names

__all__ = ["PresetError", "field_error", "found_text", "merge_overrides", *_schema_names]
