"""Local model and data factory: random-initialised diffusion transformers from small
configs, a real image set (sklearn digits) and a real text encoder (all-MiniLM-L6-v2),
all built offline into a cache folder (``$STAGEHAND_WORKBENCH_CACHE`` or
``~/.cache/stagehand-workbench``)."""

from .cache import ENV_VAR, AssetError, cache_root
from .digits import build_digits, caption_for, digits_dir
from .inputs import example_inputs, output_tensor
from .models import (
    ARCHS,
    MODEL_CLASSES,
    MODEL_SPECS,
    SIZES,
    build_all,
    build_model,
    instantiate,
    model_class,
    model_dir,
)
from .text_encoder import TEXT_HIDDEN_SIZE, load_text_encoder, minilm_path

__all__ = [
    "ARCHS",
    "ENV_VAR",
    "MODEL_CLASSES",
    "MODEL_SPECS",
    "SIZES",
    "TEXT_HIDDEN_SIZE",
    "AssetError",
    "build_all",
    "build_digits",
    "build_model",
    "cache_root",
    "caption_for",
    "digits_dir",
    "example_inputs",
    "instantiate",
    "load_text_encoder",
    "minilm_path",
    "model_class",
    "model_dir",
    "output_tensor",
]
