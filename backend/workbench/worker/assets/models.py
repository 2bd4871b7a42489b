"""Random-initialised diffusion transformers (and a VAE) built from small configs.

Nothing comes from a model hub: each model is constructed from the config kwargs in
:data:`MODEL_SPECS` right after ``torch.manual_seed(SEED)`` (fp32), then written with
``save_pretrained(..., safe_serialization=True, max_shard_size=...)`` so that the folder
holds several ``diffusion_pytorch_model-0000i-of-0000n.safetensors`` shards plus
``diffusion_pytorch_model.safetensors.index.json`` -- the same layout as a real checkpoint,
which is what the weight-streaming runtime reads.

Text conditioning is sized for the text encoder we ship (all-MiniLM-L6-v2, hidden 384):
``joint_attention_dim`` / ``caption_channels`` and ``pooled_projection_dim`` are 384.
Latents come from the VAE with ``latent_channels=4`` and an 8x spatial downscale:

* ``flux``: packed 2x2 latent patches, ``in_channels=16`` (= 4 * 2 * 2); ``out_channels``
  defaults to ``in_channels`` so the output is the packed (B, tokens, 16) velocity.
* ``sd3``: ``in_channels=4``, ``patch_size=2``, latents (B, 4, H, W).
* ``ltx``: ``in_channels=4``, ``patch_size=1``, video latents flattened to (B, F*H*W, 4).
* ``unet``: UNet2DConditionModel (SD 1.x layout: cross-attention down/up blocks, a plain
  last down / first up block), ``in_channels=out_channels=4``, latents (B, 4, H, W) with H, W
  divisible by 2 ** (len(block_out_channels) - 1); ``cross_attention_dim=384``.
* ``vae``: AutoencoderKL, 4 down blocks (8x), ``latent_channels=4``.
"""

from __future__ import annotations

import importlib
import math
import os
from pathlib import Path
from typing import Any

import torch

from workbench.contract.preset import FAMILIES, SIZES

from .cache import AssetError, build_once, cache_root, library_version
from .digits import build_digits

SEED = 0
ARCHS = (*FAMILIES, "vae")
"""What the factory builds: a transformer of each family (``workbench.contract.preset.FAMILIES``) and the VAE."""
#: sizes that :func:`build_all` builds; ``large`` (>= 1 GB fp32) is on demand only.
DEFAULT_SIZES = ("tiny", "small")

#: arch -> diffusers class name
MODEL_CLASSES: dict[str, str] = {
    "flux": "FluxTransformer2DModel",
    "sd3": "SD3Transformer2DModel",
    "ltx": "LTXVideoTransformer3DModel",
    "unet": "UNet2DConditionModel",
    "vae": "AutoencoderKL",
}

#: size -> how many shards to aim for (the shard size is total bytes / this)
TARGET_SHARDS: dict[str, int] = {"tiny": 4, "small": 6, "large": 8}

TEXT_DIM = 384  # all-MiniLM-L6-v2 hidden size
LATENT_CHANNELS = 4


def _flux(dim: int, heads: int, double: int, single: int) -> dict[str, Any]:
    head_dim = dim // heads
    side = head_dim * 3 // 8
    return {
        "patch_size": 1,
        "in_channels": LATENT_CHANNELS * 4,
        "out_channels": None,
        "num_layers": double,
        "num_single_layers": single,
        "attention_head_dim": head_dim,
        "num_attention_heads": heads,
        "joint_attention_dim": TEXT_DIM,
        "pooled_projection_dim": TEXT_DIM,
        "guidance_embeds": True,
        "axes_dims_rope": (head_dim - 2 * side, side, side),
    }


def _sd3(dim: int, heads: int, layers: int) -> dict[str, Any]:
    return {
        "sample_size": 32,
        "patch_size": 2,
        "in_channels": LATENT_CHANNELS,
        "out_channels": LATENT_CHANNELS,
        "num_layers": layers,
        "attention_head_dim": dim // heads,
        "num_attention_heads": heads,
        "joint_attention_dim": TEXT_DIM,
        "caption_projection_dim": dim,
        "pooled_projection_dim": TEXT_DIM,
        "pos_embed_max_size": 64,
    }


def _ltx(dim: int, heads: int, layers: int) -> dict[str, Any]:
    return {
        "in_channels": LATENT_CHANNELS,
        "out_channels": LATENT_CHANNELS,
        "patch_size": 1,
        "patch_size_t": 1,
        "num_attention_heads": heads,
        "attention_head_dim": dim // heads,
        "cross_attention_dim": dim,
        "num_layers": layers,
        "caption_channels": TEXT_DIM,
    }


def _unet(channels: tuple[int, ...], layers_per_block: int, heads: int) -> dict[str, Any]:
    # SD 1.x layout: cross-attention in every down/up block but the lowest-resolution pair.
    n = len(channels)
    return {
        "sample_size": 8,
        "in_channels": LATENT_CHANNELS,
        "out_channels": LATENT_CHANNELS,
        "down_block_types": ("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
        "block_out_channels": channels,
        "layers_per_block": layers_per_block,
        "cross_attention_dim": TEXT_DIM,
        "attention_head_dim": heads,  # diffusers' UNet name for the number of heads
        "norm_num_groups": 8,
    }


def _vae(channels: tuple[int, ...], layers_per_block: int, groups: int) -> dict[str, Any]:
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ("DownEncoderBlock2D",) * len(channels),
        "up_block_types": ("UpDecoderBlock2D",) * len(channels),
        "block_out_channels": channels,
        "layers_per_block": layers_per_block,
        "latent_channels": LATENT_CHANNELS,
        "norm_num_groups": groups,
        "sample_size": 64,
    }


#: (arch, size) -> config kwargs for the diffusers class in MODEL_CLASSES[arch]
MODEL_SPECS: dict[tuple[str, str], dict[str, Any]] = {
    ("flux", "tiny"): _flux(64, 2, 2, 2),
    ("flux", "small"): _flux(384, 6, 3, 6),  # ~30M params, ~120 MB
    ("flux", "large"): _flux(1024, 8, 4, 8),  # ~284M params, ~1.13 GB
    ("sd3", "tiny"): _sd3(64, 2, 2),
    ("sd3", "small"): _sd3(384, 6, 6),  # ~31M params, ~124 MB
    ("sd3", "large"): _sd3(1024, 16, 8),  # ~294M params, ~1.18 GB
    ("ltx", "tiny"): _ltx(64, 2, 2),
    ("ltx", "small"): _ltx(384, 6, 12),  # ~30M params, ~119 MB
    ("ltx", "large"): _ltx(1024, 16, 16),  # ~278M params, ~1.11 GB
    ("unet", "tiny"): _unet((32, 64), 2, 2),
    ("unet", "small"): _unet((96, 192, 288), 2, 8),  # ~29M params, ~116 MB
    ("unet", "large"): _unet((192, 384, 768, 768), 2, 8),  # ~308M params, ~1.23 GB
    ("vae", "tiny"): _vae((8, 16, 16, 16), 1, 8),
    ("vae", "small"): _vae((32, 64, 128, 128), 2, 32),
    ("vae", "large"): _vae((128, 256, 512, 512), 2, 32),
}


def check_spec(arch: str, size: str) -> dict[str, Any]:
    """Return the config kwargs for (arch, size) or raise AssetError listing valid choices."""
    if arch not in ARCHS:
        raise AssetError(f"unknown arch {arch!r}; valid archs: {', '.join(ARCHS)}")
    if size not in SIZES:
        raise AssetError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")
    return MODEL_SPECS[(arch, size)]


def model_class(arch: str) -> type:
    """The diffusers class for an arch (``flux`` -> FluxTransformer2DModel, ...)."""
    if arch not in MODEL_CLASSES:
        raise AssetError(f"unknown arch {arch!r}; valid archs: {', '.join(ARCHS)}")
    return getattr(importlib.import_module("diffusers"), MODEL_CLASSES[arch])


def instantiate(arch: str, size: str, seed: int = SEED) -> torch.nn.Module:
    """Construct the random-initialised fp32 model in memory (no disk)."""
    config = check_spec(arch, size)
    cls = model_class(arch)
    torch.manual_seed(seed)
    model = cls(**config)
    return model.eval()  # parameters are fp32 (torch default dtype)


def model_dir(arch: str, size: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where (arch, size) lives (built or not)."""
    check_spec(arch, size)
    return cache_root(cache_dir, create=False) / "models" / f"{arch}-{size}"


def _shard_size(model: torch.nn.Module, size: str) -> int:
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return max(1, math.ceil(total / TARGET_SHARDS[size]))


def model_spec(arch: str, size: str) -> dict[str, Any]:
    """What the (arch, size) folder is built from; its hash is the folder's ``.complete``."""
    config = check_spec(arch, size)  # an unknown arch or size: AssetError naming the choices
    return {
        "arch": arch,
        "size": size,
        "class": MODEL_CLASSES[arch],
        "config": config,
        "seed": SEED,
        "target_shards": TARGET_SHARDS[size],
        "diffusers": library_version("diffusers"),
        "format": 1,
    }


def build_model(arch: str, size: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Build (once) the (arch, size) model into the cache and return its folder.

    The folder is a normal diffusers model folder: ``cls.from_pretrained(folder)`` loads it.
    A second call with the same spec is a no-op (``.complete`` marker).
    """
    root = cache_root(cache_dir)
    final = root / "models" / f"{arch}-{size}"
    spec = model_spec(arch, size)

    def _build(tmp: Path) -> None:
        model = instantiate(arch, size)
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=_shard_size(model, size))

    return build_once(final, spec, _build)


def build_all(
    cache_dir: str | os.PathLike | None = None, sizes: tuple[str, ...] = DEFAULT_SIZES
) -> dict[str, Path]:
    """Build every arch (incl. vae) in ``sizes`` (tiny + small by default) plus the digits
    image folder. Returns ``{"flux-tiny": Path, ..., "digits": Path}``."""

    out: dict[str, Path] = {}
    for size in sizes:
        for arch in ARCHS:
            out[f"{arch}-{size}"] = build_model(arch, size, cache_dir)
    out["digits"] = build_digits(cache_dir)
    return out
