"""The preset schema: every section of a run's JSON as a strict pydantic model (``Preset``),
with its bounds and the rules between fields. Torch-free. See ``backend/workbench/worker/preset/__init__.py``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from stagehand.config.memory import MemoryConfig
from workbench.contract.package_data import package_dir
from workbench.contract.preset.errors import PresetError, field_error, field_errors, found_text

__all__ = [
    "AdapterSection",
    "BOUND_TO",
    "CAPTION_SUFFIX",
    "DEFAULT_TARGET_MODULES",
    "DataSection",
    "FAMILIES",
    "LoraSection",
    "MAX_RANK",
    "MAX_STEPS",
    "MODEL_TYPES",
    "ModelSection",
    "OptimizerSection",
    "PRESETS_DIR",
    "Preset",
    "SIZES",
    "SamplesSection",
    "SchedulerSection",
    "background_rgb",
]

PRESETS_DIR = package_dir("presets")
"""Built-in presets: ``presets/NAME.json`` (``workbench.contract.package_data``)."""

FAMILIES = ("flux", "sd3", "ltx", "unet")
"""Model families the trainer has adapters for (``backend/workbench/worker/families.py``), and the architectures
the asset factory builds (``model.factory``)."""

SIZES = ("tiny", "small", "large")
"""The asset factory's model sizes (``model.size``; ``workbench.worker.assets.models``)."""

MODEL_TYPES: dict[str, str] = {
    "flux": "flux",
    "flux_dev": "flux",
    "flux_schnell": "flux",
    "sd3": "sd3",
    "sd35": "sd3",
    "ltx": "ltx",
    "ltxv": "ltx",
    "ltx2": "ltx2",
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

MAX_STEPS = 10_000_000
"""Steps of any kind (training, warmup, between checkpoints): ~4 months at 1 step/s."""
MAX_RANK = 1024
"""LoRA rank: past this a LoRA of a 12-19B model is as large as a full fine-tune."""
Steps = Annotated[int, Field(gt=0, le=MAX_STEPS)]
Rank = Annotated[int, Field(gt=0, le=MAX_RANK)]
Alpha = Annotated[float, Field(gt=0, le=4 * MAX_RANK)]
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]
"""Seeds every generator takes (numpy's are 32-bit)."""
FolderPath = Annotated[str, Field(min_length=1, max_length=4096)]
"""A folder on the worker's machine (4096: Linux's PATH_MAX)."""
Text = Annotated[str, Field(max_length=2000)]
CAPTION_SUFFIX = re.compile(r"^\.?[A-Za-z0-9][A-Za-z0-9_-]{0,15}$")
"""``data.captions``: a file extension (``txt``, ``.caption``), never a path."""


BOUND_TO = "bound_to"
"""``json_schema_extra`` key naming the folder field (``model.path``, ``data.path``) a field is
bound to: the field describes the preset's own model or data (its factory, the factory's size, a
caption length chosen for its captions, the prompts its samples are drawn from), so a run that
names its own folder where the preset named none drops it (``workbench.contract.preset.overrides``)."""
_MODEL_BOUND = {BOUND_TO: "model.path"}
_DATA_BOUND = {BOUND_TO: "data.path"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Strict):
    """Which transformer to train: a diffusers folder (``path``) or a factory model."""

    path: FolderPath | None = None
    """Diffusers model folder (sharded safetensors), or a pipeline folder with ``transformer/``
    (and ``vae/``) inside. Checked to exist by ``Preset.check_paths`` when training starts."""
    factory: Literal[FAMILIES] | None = Field(  # type: ignore[valid-type]
        None, json_schema_extra=_MODEL_BOUND
    )
    """Build the model with ``workbench.worker.assets.build_model(factory, size)`` instead of ``path``."""
    size: Literal[SIZES] = Field("small", json_schema_extra=_MODEL_BOUND)  # type: ignore[valid-type]
    pretrained: Literal["digits"] | None = Field(None, json_schema_extra=_MODEL_BOUND)
    """``digits``: the factory ``flux`` model and its VAE trained on the digits when the assets
    are built (``workbench.worker.demo``: the demo's samples are digits, not noise); None: the
    random-initialised factory model and VAE."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the frozen weights are loaded in."""
    text_encoder_model_name: FolderPath | None = None
    """Text encoder: ``"minilm"`` (or unset) is the bundled all-MiniLM-L6-v2; else a folder."""
    vae_path: FolderPath | None = None
    """VAE folder; default ``path/vae`` for a pipeline folder, the factory VAE otherwise."""
    transformer_path: str | None = None
    """A single-file transformer checkpoint (``.safetensors``, loaded with diffusers'
    ``from_single_file``) replacing ``path/transformer``; the rest comes from ``path``."""
    cudnn_sdp: Literal["auto", "on", "off"] = "auto"
    """cuDNN's fused attention (an SDPA backend) on CUDA: ``auto`` turns it off where PyTorch
    makes it the default and it crashed a FLUX.1-dev LoRA step (torch >= 2.11 on sm90/sm100),
    ``on`` leaves PyTorch's choice, ``off`` turns it off (NOTE [ cuDNN SDPA guard ] in
    ``runtime/stagehand/common/attention.py``). Applied once at the run's start, recorded in
    ``trainer/run_started``."""
    expert: Literal["high_noise", "low_noise"] | None = None
    """Wan 2.2's two experts: which one a run trains (``transformer`` / ``transformer_2``),
    its timesteps drawn from that expert's range of the pipeline's ``boundary_ratio``."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if self.path is None and self.factory is None:
            raise ValueError('one of "path" (a model folder) or "factory" (flux|sd3|ltx|unet)')
        problems = []
        if self.path is not None and self.factory is not None:
            sentence = 'only one of "path" and "factory", not both: null removes "factory"'
            problems.append(("factory", self.factory, sentence))
        if self.pretrained is not None and self.factory != "flux":
            sentence = (
                f'pretrained "{self.pretrained}" is built for model.factory "flux", got factory '
                f'{self.factory!r}: null removes "pretrained"'
            )
            problems.append(("pretrained", self.pretrained, sentence))
        if problems:
            raise field_errors("ModelSection", problems)
        return self


class AdapterSection(_Strict):
    """The LTX-2 seed's ``adapter`` block."""

    rank: Rank | None = None
    alpha: Alpha | None = None


class LoraSection(_Strict):
    """Which modules get LoRA layers (peft ``target_modules``: name suffixes)."""

    target_modules: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=200)]], Field(max_length=256)
    ] = Field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0


class OptimizerSection(_Strict):
    optimizer: Literal["adamw"] = "adamw"
    weight_decay: Annotated[float, Field(ge=0, le=1)] = 0.01
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (
        0.9,
        0.999,
    )
    eps: Annotated[float, Field(gt=0, le=1)] = 1e-8


class SchedulerSection(_Strict):
    scheduler: Literal["constant", "cosine"] = "constant"
    warmup_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 0


class DataSection(_Strict):
    """An image folder with ``.txt`` captions (the common trainer layout), or the digits.

    The folder is scanned before stage 1 (``backend/workbench/worker/scan.py``): files that cannot be
    used are listed with their reason, and ``on_bad_file`` says whether the run goes on.
    """

    path: FolderPath | None = None
    """Folder of images + captions; for video, sub-folders of frames."""
    factory: Literal["digits"] | None = Field(None, json_schema_extra=_DATA_BOUND)
    """``digits``: the factory's digits folder (``workbench.worker.assets.build_digits``)."""
    captions: str = "txt"
    """Extension of the caption file beside each image (``00001.png`` -> ``00001.txt``)."""
    default_caption: Text | None = None
    """Caption for an image without a caption file; unset, such an image trains with an empty
    caption and the scan warns about it."""
    on_bad_file: Literal["skip", "fail"] = "skip"
    """What a file the scan cannot use (unreadable image, caption without image) does: ``skip``
    leaves it out (listed in the scan), ``fail`` fails the run before any model loads."""
    background: str = "white"
    """Colour transparent pixels are composited onto (a CSS name or ``#rrggbb``)."""
    limit: Annotated[int, Field(gt=0, le=MAX_STEPS)] | None = Field(
        None, json_schema_extra=_DATA_BOUND
    )
    """Use only the first ``limit`` samples (sorted by name)."""
    bucketing: bool = False
    """Group images by aspect ratio into buckets of about ``resolution**2`` pixels instead of
    resizing + center-cropping to a square."""
    frames: Annotated[int, Field(gt=0, le=1024)] | None = Field(None, json_schema_extra=_DATA_BOUND)
    """Video models: frames per sample (frame stacks)."""
    max_caption_tokens: Annotated[int, Field(gt=0, le=4096)] = Field(
        32, json_schema_extra=_DATA_BOUND
    )
    """Captions are padded / truncated to this many tokens."""

    @field_validator("captions")
    @classmethod
    def _suffix(cls, value: str) -> str:
        if not CAPTION_SUFFIX.match(value):
            raise ValueError(
                "a file extension of 1-16 letters, digits, '_' or '-' (txt, .caption), not a path"
            )
        return value

    @field_validator("background")
    @classmethod
    def _colour(cls, value: str) -> str:
        background_rgb(value)
        return value

    @model_validator(mode="after")
    def _one_source(self) -> DataSection:
        if self.path is not None and self.factory is not None:
            raise field_error(
                "DataSection",
                "factory",
                self.factory,
                'only one of "path" and "factory", not both: null removes "factory"',
            )
        return self

    @property
    def background_rgb(self) -> tuple[int, int, int]:
        """``background`` as 8-bit ``(r, g, b)``."""
        return background_rgb(self.background)


def background_rgb(colour: str) -> tuple[int, int, int]:
    """``(r, g, b)`` of a colour name or ``#rrggbb``; raises ``ValueError`` naming what is taken."""
    from PIL import ImageColor

    try:
        rgb = ImageColor.getrgb(colour)
    except ValueError:
        raise ValueError("a colour name (white, black) or #rrggbb") from None
    return rgb[0], rgb[1], rgb[2]


class SamplesSection(_Strict):
    """Images drawn from fixed prompts at the end of the run (none when ``prompts`` is empty)."""

    prompts: Annotated[list[Text], Field(max_length=64)] = Field(
        default_factory=list, json_schema_extra=_DATA_BOUND
    )
    steps: Annotated[int, Field(gt=0, le=1000)] = 8
    """Euler steps of the flow sampler (DDIM steps for the unet family)."""
    seed: Seed = 0
    every: Steps | None = None
    """Also sample every ``every`` steps during training (None: at the end only), through the
    training strategy; the run page shows them as a grid with a step slider."""
    guidance: Annotated[float, Field(gt=0, le=100)] = 3.5
    """Pipeline families: ``guidance_scale`` of the pipeline's ``__call__`` (FLUX.1-dev's 3.5)."""


class Preset(_Strict):
    """A training run's configuration. Field names follow the seeds (see the module doc)."""

    name: Annotated[str, Field(max_length=100)] | None = None
    description: Text = ""
    model_type: str = "flux"
    training_method: Literal["lora", "full"] = "lora"
    lora_rank: Rank | None = None
    lora_alpha: Alpha | None = None
    adapter: AdapterSection | None = None
    lora: LoraSection = Field(default_factory=LoraSection)
    model: ModelSection
    text_encoder: FolderPath | None = None
    """Text encoder folder; overrides ``model.text_encoder_model_name``."""
    memory: MemoryConfig = Field(default_factory=lambda: MemoryConfig(strategy="none"))
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    timestep_distribution: Literal["uniform", "logit_normal"] = "logit_normal"
    logit_mean: Annotated[float, Field(ge=-10, le=10)] = 0.0
    """Mean of the logit-normal timestep density (SD3 uses 0; |mean| > 10 is all one end)."""
    logit_std: Annotated[float, Field(gt=0, le=10)] = 1.0
    prediction_type: Literal["epsilon", "v_prediction"] = "epsilon"
    """What a UNet (DDPM) family predicts; flow families always predict the velocity."""
    learning_rate: Annotated[float, Field(gt=0, le=1)] = 1e-4
    resolution: Annotated[int, Field(ge=16, le=4096)] = 512
    """Pixels per side (the Flux 2048 seed trains at 2048)."""
    batch_size: Annotated[int, Field(gt=0, le=256)] = 1
    max_steps: Steps = 50
    train_dtype: Literal["float32", "bfloat16"] = "float32"
    seed: Seed = 0
    grad_clip: Annotated[float, Field(gt=0, le=1e6)] | None = 1.0
    """Max global grad norm; null disables clipping."""
    checkpoint_every: Steps | None = None
    """Steps between checkpoints (``DIR/checkpoints/step-N``); null: none."""
    samples: SamplesSection = Field(default_factory=SamplesSection)
    log_every: Steps = 1
    """Steps between plain progress lines (no terminal)."""
    data: DataSection = Field(default_factory=DataSection)
    validation_every: Steps | None = None
    """Steps between validation losses on the held-out samples (fixed noise and sigmas)."""
    validation_samples: Annotated[int, Field(gt=0, le=1000)] = 2
    """Samples held out of training for the validation loss (the last ones, sorted by name)."""

    @field_validator("model_type")
    @classmethod
    def _model_type(cls, value: str) -> str:
        if value not in MODEL_TYPES:
            raise ValueError(f"one of {', '.join(MODEL_TYPES)}")
        return value

    @model_validator(mode="after")
    def _resolve(self) -> Preset:
        problems = []  # every rule broken, not the first: a form shows each beside its field
        for field, top, nested in (
            ("rank", self.lora_rank, self.adapter.rank if self.adapter else None),
            ("alpha", self.lora_alpha, self.adapter.alpha if self.adapter else None),
        ):
            if top is not None and nested is not None and float(top) != float(nested):
                sentence = (
                    f"lora_{field} ({top}) and adapter.{field} ({nested}) disagree: set one "
                    "(null removes the other)"
                )
                problems.append((f"lora_{field}", top, sentence))
        if self.prediction_type != "epsilon" and self.family != "unet":
            sentence = (
                f"prediction_type {self.prediction_type!r} applies to the unet family only "
                f"({self.family} trains with flow matching): leave it out or use epsilon"
            )
            problems.append(("prediction_type", self.prediction_type, sentence))
        if problems:
            raise field_errors("Preset", problems)
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

    def folders(self) -> list[tuple[str, str]]:
        """``(JSON path, value)`` of every folder the run reads that the preset names."""
        encoder = "text_encoder" if self.text_encoder else "model.text_encoder_model_name"
        named = [
            ("model.path", self.model.path),
            ("model.vae_path", self.model.vae_path),
            ("data.path", self.data.path),
            (encoder, self.text_encoder_path),
        ]
        return [(path, value) for path, value in named if value is not None]

    def check_paths(self, absolute: bool = False) -> None:
        """Check that the folders the run reads exist (called when training starts, and by the
        API before a run is queued). With ``absolute`` (the API), a relative path is refused:
        the worker does not run in the caller's folder, so it would read another one.

        Raises:
            PresetError: naming each missing path (``model.path``, ``text_encoder``, ``data.path``).
        """
        problems = []
        for path, value in self.folders():
            if absolute and not Path(value).expanduser().is_absolute():
                problems.append(
                    {
                        "path": path,
                        "found": found_text(value),
                        "expected": "an absolute folder path (/... or ~/...): the worker does "
                        "not run in this folder",
                    }
                )
                continue
            try:
                folder = Path(value).expanduser()
                kind = "a folder" if folder.is_dir() else "a file" if folder.exists() else None
            except (OSError, ValueError) as exc:  # NUL byte, name too long
                problems.append(
                    {"path": path, "found": found_text(value), "expected": f"a folder path ({exc})"}
                )
                continue
            if kind != "a folder":
                problems.append(
                    {
                        "path": path,
                        "found": f"{value!r} ({kind or 'nothing'})",
                        "expected": "an existing folder",
                    }
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
