"""Presets: the JSON a run is configured by, validated by pydantic (no torch import here).

The backend imports this module to validate presets and overrides, so it must stay torch-free.

Accepted verbatim (apart from model paths), the blocks printed in the seeds:

- ``shared/seeds/case-study-ltx2-bf16-24gb.md``: ``model_type, training_method,
  model{path, dtype, text_encoder_model_name}, adapter{rank, alpha}, memory{...stagehand...},
  resolution, batch_size, data{frames}``.
- ``shared/seeds/case-study-flux-2048-layer-offload.md``: ``lora_rank, lora_alpha,
  memory{enable_activation_offloading, enable_async_offloading, layer_offload_fraction},
  optimizer{optimizer, weight_decay}, scheduler{scheduler, warmup_steps},
  timestep_distribution, learning_rate, max_steps, train_dtype``.
- ``shared/seeds/activation-stagehand.md``: ``memory.stagehand.activation_stagehand``.
- ``shared/seeds/conductor.md``: ``memory.stagehand.conductor_config``.

The seeds spell the LoRA size two ways (``adapter.rank`` and top-level ``lora_rank``); both are
accepted and resolved into ``Preset.rank`` / ``Preset.alpha``; both set to different values is an
error. ``validate_preset`` raises ``PresetError`` listing every problem as
``JSON.path: found <value>, expected <what>``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from runtime.config import MemoryConfig

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"
"""Built-in presets: ``presets/NAME.json`` at the repository root."""

FAMILIES = ("flux", "sd3", "ltx", "unet")
"""Model families the trainer has adapters for (``runtime/trainer/families.py``)."""

MODEL_TYPES: dict[str, str] = {
    "flux": "flux",
    "flux_dev": "flux",
    "flux_schnell": "flux",
    "sd3": "sd3",
    "sd35": "sd3",
    "ltx": "ltx",
    "ltxv": "ltx",
    "ltx2": "ltx",
    "unet": "unet",
    "sd15": "unet",
    "sd1": "unet",
    "flux1": "flux",
    "qwenimage": "qwenimage",
    "qwen_image": "qwenimage",
    "wan": "wan",
    "zimage": "zimage",
    "sdxl": "sdxl",
    "flux2": "flux2",
}
"""``model_type`` spellings (the seeds' ``ltx2``, ``flux_dev``...) -> family."""

DEFAULT_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
"""LoRA targets when the preset names none: the attention projections (diffusers' scripts)."""

PosInt = Annotated[int, Field(gt=0)]
PosFloat = Annotated[float, Field(gt=0)]


class PresetError(ValueError):
    """A preset is invalid; ``problems`` holds ``{path, found, expected}`` per problem."""

    def __init__(self, problems: list[dict[str, Any]]) -> None:
        self.problems = problems
        lines = [f"{p['path']}: found {p['found']}, expected {p['expected']}" for p in problems]
        super().__init__("invalid preset:\n  " + "\n  ".join(lines))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Strict):
    """Which transformer to train: a diffusers folder (``path``) or a factory model."""

    path: str | None = None
    """Diffusers model folder (sharded safetensors), or a pipeline folder with ``transformer/``
    (and ``vae/``) inside. Checked to exist by ``Preset.check_paths`` when training starts."""
    factory: Literal["flux", "sd3", "ltx", "unet"] | None = None
    """Build the model with ``runtime.assets.build_model(factory, size)`` instead of ``path``."""
    size: Literal["tiny", "small", "large"] = "small"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the frozen weights are loaded in."""
    text_encoder_model_name: str | None = None
    """Text encoder: ``"minilm"`` (or unset) is the bundled all-MiniLM-L6-v2; else a folder."""
    vae_path: str | None = None
    """VAE folder; default ``path/vae`` for a pipeline folder, the factory VAE otherwise."""
    transformer_path: str | None = None
    """A single-file transformer checkpoint (``.safetensors``, loaded with diffusers'
    ``from_single_file``) replacing ``path/transformer``; the rest comes from ``path``."""
    expert: Literal["high_noise", "low_noise"] | None = None
    """Wan 2.2's two experts: which one a run trains (``transformer`` / ``transformer_2``),
    its timesteps drawn from that expert's range of the pipeline's ``boundary_ratio``."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if self.path is None and self.factory is None:
            raise ValueError('one of "path" (a model folder) or "factory" (flux|sd3|ltx|unet)')
        if self.path is not None and self.factory is not None:
            raise ValueError('only one of "path" and "factory", not both')
        return self


class AdapterSection(_Strict):
    """The LTX-2 seed's ``adapter`` block."""

    rank: PosInt | None = None
    alpha: PosFloat | None = None


class LoraSection(_Strict):
    """Which modules get LoRA layers (peft ``target_modules``: name suffixes)."""

    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0


class OptimizerSection(_Strict):
    optimizer: Literal["adamw"] = "adamw"
    weight_decay: Annotated[float, Field(ge=0)] = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: PosFloat = 1e-8


class SchedulerSection(_Strict):
    scheduler: Literal["constant", "cosine"] = "constant"
    warmup_steps: Annotated[int, Field(ge=0)] = 0


class DataSection(_Strict):
    """An image folder with ``.txt`` captions (the common trainer layout), or the digits."""

    path: str | None = None
    """Folder of images + captions; for video, sub-folders of frames."""
    factory: Literal["digits"] | None = None
    """``digits``: the factory's digits folder (``runtime.assets.build_digits``)."""
    captions: str = "txt"
    """Extension of the caption file beside each image (``00001.png`` -> ``00001.txt``)."""
    default_caption: str = ""
    """Caption for an image without a caption file."""
    limit: PosInt | None = None
    """Use only the first ``limit`` samples (sorted by name)."""
    bucketing: bool = False
    """Group images by aspect ratio into buckets of about ``resolution**2`` pixels instead of
    resizing + center-cropping to a square."""
    frames: PosInt | None = None
    """Video models: frames per sample (frame stacks)."""
    max_caption_tokens: PosInt = 32
    """Captions are padded / truncated to this many tokens."""


class SamplesSection(_Strict):
    """Images drawn from fixed prompts at the end of the run (none when ``prompts`` is empty)."""

    prompts: list[str] = Field(default_factory=list)
    steps: PosInt = 8
    """Euler steps of the flow sampler (DDIM steps for the unet family)."""
    seed: int = 0
    every: PosInt | None = None
    """Pipeline families: also sample every ``every`` steps during training (None: at the end)."""
    guidance: PosFloat = 3.5
    """Pipeline families: ``guidance_scale`` of the pipeline's ``__call__`` (FLUX.1-dev's 3.5)."""


class Preset(_Strict):
    """A training run's configuration. Field names follow the seeds (see the module doc)."""

    name: str | None = None
    description: str = ""
    model_type: str = "flux"
    training_method: Literal["lora", "full"] = "lora"
    lora_rank: PosInt | None = None
    lora_alpha: PosFloat | None = None
    adapter: AdapterSection | None = None
    lora: LoraSection = Field(default_factory=LoraSection)
    model: ModelSection
    text_encoder: str | None = None
    """Text encoder folder; overrides ``model.text_encoder_model_name``."""
    memory: MemoryConfig = Field(default_factory=lambda: MemoryConfig(strategy="none"))
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    timestep_distribution: Literal["uniform", "logit_normal"] = "logit_normal"
    logit_mean: float = 0.0
    logit_std: PosFloat = 1.0
    prediction_type: Literal["epsilon", "v_prediction"] = "epsilon"
    """What a UNet (DDPM) family predicts; flow families always predict the velocity."""
    learning_rate: PosFloat = 1e-4
    resolution: Annotated[int, Field(ge=16)] = 512
    batch_size: PosInt = 1
    max_steps: PosInt = 50
    train_dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    grad_clip: PosFloat | None = 1.0
    """Max global grad norm; null disables clipping."""
    checkpoint_every: PosInt | None = None
    """Steps between checkpoints (``DIR/checkpoints/step-N``); null: none."""
    samples: SamplesSection = Field(default_factory=SamplesSection)
    log_every: PosInt = 1
    """Steps between plain progress lines (no terminal)."""
    data: DataSection = Field(default_factory=DataSection)
    validation_every: PosInt | None = None
    """Steps between validation losses on the held-out samples (fixed noise and sigmas)."""
    validation_samples: PosInt = 2
    """Samples held out of training for the validation loss (the last ones, sorted by name)."""

    @model_validator(mode="before")
    @classmethod
    def _infer_strategy(cls, data: Any) -> Any:
        # The Flux 2048 seed sets layer-offload fields without naming the strategy.
        if isinstance(data, dict) and isinstance(data.get("memory"), dict):
            mem = data["memory"]
            if "strategy" not in mem:
                lo = ("layer_offload_fraction", "enable_activation_offloading")
                strategy = "layer_offload" if any(k in mem for k in lo) else None
                if strategy is None:
                    strategy = "stagehand" if "stagehand" in mem else "none"
                data = {**data, "memory": {**mem, "strategy": strategy}}
        return data

    @model_validator(mode="after")
    def _resolve(self) -> Preset:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r}: expected one of {list(MODEL_TYPES)}")
        for field, top, nested in (
            ("rank", self.lora_rank, self.adapter.rank if self.adapter else None),
            ("alpha", self.lora_alpha, self.adapter.alpha if self.adapter else None),
        ):
            if top is not None and nested is not None and float(top) != float(nested):
                raise ValueError(
                    f"lora_{field} ({top}) and adapter.{field} ({nested}) disagree: set one"
                )
        if self.prediction_type != "epsilon" and self.family != "unet":
            raise ValueError(
                f"prediction_type {self.prediction_type!r} applies to the unet family only "
                f"({self.family} trains with flow matching): leave it out or use epsilon"
            )
        if self.data.path is not None and self.data.factory is not None:
            raise ValueError('data: only one of "path" and "factory", not both')
        return self

    # -- resolved values --------------------------------------------------------------------
    @property
    def family(self) -> str:
        """``flux`` | ``sd3`` | ``ltx`` | ``unet``, from ``model_type`` (or the factory arch)."""
        return self.model.factory or MODEL_TYPES[self.model_type]

    @property
    def rank(self) -> int:
        """LoRA rank: ``lora_rank`` or ``adapter.rank``, default 16."""
        nested = self.adapter.rank if self.adapter else None
        return int(self.lora_rank or nested or 16)

    @property
    def alpha(self) -> float:
        """LoRA alpha: ``lora_alpha`` or ``adapter.alpha``, default the rank (scale 1)."""
        nested = self.adapter.alpha if self.adapter else None
        return float(self.lora_alpha or nested or self.rank)

    @property
    def text_encoder_path(self) -> str | None:
        """The text encoder folder, or None for the bundled MiniLM."""
        name = self.text_encoder or self.model.text_encoder_model_name
        return None if name in (None, "", "minilm") else name

    def check_paths(self) -> None:
        """Check that the folders the run reads exist (called when training starts).

        Raises:
            PresetError: naming each missing path (``model.path``, ``text_encoder``, ``data.path``).
        """
        problems = []
        checks = [
            ("model.path", self.model.path),
            ("model.vae_path", self.model.vae_path),
            ("data.path", self.data.path),
            (
                "text_encoder" if self.text_encoder else "model.text_encoder_model_name",
                self.text_encoder_path,
            ),
        ]
        for path, value in checks:
            if value is not None and not Path(value).expanduser().is_dir():
                kind = "a file" if Path(value).expanduser().exists() else "nothing"
                problems.append(
                    {"path": path, "found": f"{value!r} ({kind})", "expected": "an existing folder"}
                )
        if self.data.path is None and self.data.factory is None:
            problems.append(
                {
                    "path": "data",
                    "found": "no path",
                    "expected": 'data.path or data.factory "digits"',
                }
            )
        if problems:
            raise PresetError(problems)


# -- errors ------------------------------------------------------------------------------------
_TYPE_BRANCHES = {"int", "float", "str", "bool", "none", "list", "dict", "tuple", "literal"}


def _json_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
            continue
        text = str(item)
        # Union branches (``int``, ``tuple[int, ...]``, ``function-after[...]``) are not fields.
        if any(c in text for c in "[(-") or text.lower() in _TYPE_BRANCHES:
            continue
        parts.append(("." if parts else "") + text)
    return "".join(parts) or "(top level)"


def _found(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _expected(error: dict[str, Any]) -> str:
    kind, msg = error["type"], error["msg"]
    if kind == "extra_forbidden":
        return "no such field (unknown field)"
    if kind == "missing":
        return "this required field"
    for prefix in ("Input should be ", "Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix) :]
    return msg


def problems_of(exc: ValidationError) -> list[dict[str, Any]]:
    """``[{path, found, expected}]`` for each error of a pydantic ``ValidationError``."""
    seen, out = set(), []
    for err in exc.errors():
        path = _json_path(tuple(err["loc"]))
        found = "nothing" if err["type"] == "missing" else _found(err.get("input"))
        item = (path, found, _expected(err))
        if item not in seen:
            seen.add(item)
            out.append({"path": path, "found": found, "expected": item[2]})
    return out


def validate_preset(data: Any) -> Preset:
    """Validate a preset's JSON object.

    Raises:
        PresetError: listing each problem as ``JSON.path: found <value>, expected <what>``.
    """
    if not isinstance(data, dict):
        raise PresetError([{"path": "(top level)", "found": _found(data), "expected": "an object"}])
    try:
        return Preset.model_validate(data)
    except ValidationError as exc:
        raise PresetError(problems_of(exc)) from None


def list_presets() -> list[str]:
    """Names of the built-in presets, sorted."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_preset(name_or_path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """``(name, raw JSON object)`` of a built-in preset name or a path to a JSON file.

    Raises:
        FileNotFoundError: neither a file nor a built-in preset (lists the built-in names).
        PresetError: the file is not valid JSON.
    """
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        builtin = PRESETS_DIR / f"{name_or_path}.json"
        if not builtin.is_file():
            raise FileNotFoundError(
                f"no preset file {str(name_or_path)!r} and no built-in preset of that name "
                f"(built-in: {', '.join(list_presets())})"
            )
        path = builtin
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PresetError(
            [
                {
                    "path": "(file)",
                    "found": f"{path} line {exc.lineno}",
                    "expected": f"JSON ({exc.msg})",
                }
            ]
        ) from None
    name = data.get("name") if isinstance(data, dict) else None
    return str(name or path.stem), data
