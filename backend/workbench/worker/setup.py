"""Set-up of a run before its stages: which family adapter, which folders, which samples are
held out, which LoRA targets, and the checks that refuse a run before anything is written
(dtype the device cannot run, text encoder that does not fit the model)."""

from __future__ import annotations

from pathlib import Path

import torch

from workbench.contract.preset import Preset
from workbench.worker import assets, loop, pipelines
from workbench.worker.assets import cache_root
from workbench.worker.demo import demo_spec
from workbench.worker.demo_stages import build_demo
from workbench.worker.families import Family
from workbench.worker.pipelines import PipelineFamily


def pipeline_family(preset: Preset, device: torch.device) -> PipelineFamily | None:
    """The family adapter bound to ``model.path`` when it is a diffusers pipeline folder (its
    ``model_index.json`` decides the family), else None (a factory or single model folder).

    Raises:
        PipelineFolderError: the folder, a component or ``model_type`` is wrong (named).
        ValueError: ``model.dtype`` cannot run on ``device``.
    """

    if not pipelines.is_pipeline_folder(preset.model.path):
        return None
    info = pipelines.inspect_preset(preset)
    check_dtype(preset.model.dtype, device)
    check_dtype(preset.train_dtype, device)
    cache = cache_root() / "trainer-cache"
    memory = preset.memory
    # Module-backed blocks hold what from_pretrained read: only file-backed ones stream as stored.
    squareq = memory.squareq_format() is not None and memory.stagehand.file_backed
    return pipelines.adapter_for(
        info,
        cache,
        loop.DTYPES[preset.model.dtype],
        expert=preset.model.expert,
        prequantized=squareq,
    )


def family_targets(preset: Preset, fam) -> Preset:
    """``preset`` with the family's LoRA targets (``Family.lora_targets``: what a pipeline
    family's community trainers target) when ``lora.target_modules`` is unset; an explicit
    list, a family without its own targets or none (None) keep the preset's."""
    targets = fam.lora_targets if fam is not None else None
    if targets is None or "target_modules" in preset.lora.model_fields_set:
        return preset
    lora = preset.lora.model_copy(update={"target_modules": list(targets)})
    return preset.model_copy(update={"lora": lora})


def check_dtype(name: str, device: torch.device) -> None:
    """Raise ``ValueError`` for a dtype the device cannot train in (names the field)."""
    if device.type == "cpu" and name == "float16":
        raise ValueError(
            "model.dtype / train_dtype: float16 on the CPU is not supported (many CPU kernels "
            "have no float16 version); expected float32 or bfloat16"
        )
    if device.type == "cuda" and name == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"model.dtype / train_dtype: bfloat16 on {torch.cuda.get_device_name(device)} is not "
            "supported; expected float32 or float16"
        )


def held_out_samples(preset: Preset, n: int) -> list[int]:
    """The last ``validation_samples`` sample indices when ``validation_every`` is set.

    Raises:
        ValueError: holding them out would leave no training sample.
    """
    if not preset.validation_every:
        return []
    k = preset.validation_samples
    if k >= n:
        raise ValueError(
            f"validation_samples: {k} held out of {n} samples leaves none to train on; "
            f"expected fewer than {n}"
        )
    return list(range(n - k, n))


def resolve_assets(preset: Preset, fam=None, log=None) -> tuple[Path, Path, Path | None, Path]:
    """``(transformer / unet folder, VAE folder, text encoder folder, data folder)``; factory models,
    the demo's trained ones (``model.pretrained``, ``log`` gets its build's lines) and the digits
    are built into the cache on first use. A family ``fam`` with folders of its own
    (``Family.own_folders``: a pipeline folder) gives them (its text encoders are its
    components: None).

    Raises:
        FileNotFoundError: a pipeline folder without ``vae/`` and no ``model.vae_path``.
    """

    m = preset.model
    own = fam.own_folders(preset) if fam is not None else None
    if own is not None:
        return *own, None, data_folder(preset)
    if m.factory and m.pretrained == "digits":
        demo = build_demo(spec=demo_spec(m.size), log=log)
        model_dir = demo / "transformer"
        vae_dir = Path(m.vae_path) if m.vae_path else demo / "vae"
    elif m.factory:
        model_dir = assets.build_model(m.factory, m.size)
        vae_dir = Path(m.vae_path) if m.vae_path else assets.build_model("vae", m.size)
    else:
        root = Path(m.path).expanduser()
        model_dir = denoiser_folder(root)
        vae_dir = Path(m.vae_path) if m.vae_path else root / "vae"
        if not vae_dir.is_dir():
            raise FileNotFoundError(
                f"model.vae_path: no VAE folder (looked for {vae_dir}); set model.vae_path"
            )
    encoder = Path(preset.text_encoder_path) if preset.text_encoder_path else assets.minilm_path()
    return model_dir, vae_dir, encoder, data_folder(preset)


def denoiser_folder(root: Path) -> Path:
    """The denoiser's folder of ``model.path`` outside a pipeline family: a pipeline folder
    keeps it in transformer/ (DiT) or unet/ (SD 1.x), else ``root`` is the model folder."""
    subs = [root / sub for sub in ("transformer", "unet") if (root / sub).is_dir()]
    return subs[0] if subs else root


def data_folder(preset: Preset) -> Path:
    """``data.path``, or the digits folder built for ``resolution``."""

    if preset.data.factory == "digits":
        return assets.build_digits(size=preset.resolution)
    return Path(preset.data.path).expanduser()


def check_text_dim(model: torch.nn.Module, dim: int, fam=None) -> None:
    """Raise ``ValueError`` when the text encoder's hidden size is not what the model takes
    (``joint_attention_dim`` / ``caption_channels``; a UNet's ``cross_attention_dim``)."""
    want = (fam or Family()).text_dim(model)
    if want is not None and int(want) != int(dim):
        raise ValueError(
            f"text_encoder: hidden size {dim} does not match the model's text input {want} "
            "(joint_attention_dim / caption_channels / cross_attention_dim); use the model's "
            "own text encoder"
        )
