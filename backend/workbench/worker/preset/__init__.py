"""Presets: the JSON a run is configured by, validated by pydantic (no torch import here).

The backend imports this module to validate presets and overrides, so it must stay torch-free.

Accepted verbatim (apart from model paths), the blocks printed in the seeds:

- the LTX-2 bf16 on 24 GB case study: ``model_type, training_method,
  model{path, dtype, text_encoder_model_name}, adapter{rank, alpha}, memory{...stagehand...},
  resolution, batch_size, data{frames}``.
- the Flux 2048 px layer-offload case study: ``lora_rank, lora_alpha,
  memory{enable_activation_offloading, enable_async_offloading, layer_offload_fraction},
  optimizer{optimizer, weight_decay}, scheduler{scheduler, warmup_steps},
  timestep_distribution, learning_rate, max_steps, train_dtype``.
- "Activation Stagehand": ``memory.stagehand.activation_stagehand``.
- "Conductor: Resource Arbitration Across Memory Runtimes": ``memory.stagehand.conductor_config``.

The seeds spell the LoRA size two ways (``adapter.rank`` and top-level ``lora_rank``); both are
accepted and resolved into ``Preset.rank`` / ``Preset.alpha``; both set to different values is an
error. ``validate_preset`` raises ``PresetError`` listing every problem as
``JSON.path: found <value>, expected <what>`` (or, for a rule between fields, the field at fault
and a sentence).

Numbers are strict (JSON numbers only: ``true`` or ``"4"`` is not a number) and finite (no
``NaN``/``Infinity``), and every size has an upper bound that is named in its error.
"""

from workbench.contract.preset.errors import PresetError, field_error
from workbench.contract.preset.schema import *  # noqa: F403  (the sections, Preset and the constants)
from workbench.contract.preset.schema import __all__ as _schema_names
from workbench.worker.preset.load import list_presets, load_preset, problems_of, validate_preset

__all__ = [
    "PresetError",
    "field_error",
    "list_presets",
    "load_preset",
    "problems_of",
    "validate_preset",
    *_schema_names,
]
