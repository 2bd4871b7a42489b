"""The transformer call a plan measures: the trainer's own, on ``meta`` tensors.

A pipeline folder's family adapter (``workbench.worker.pipelines``) says how a training step
turns pixels into latents (``encode_pixels``) and calls its transformer (``predict``). The plan
runs both on ``meta``, so every family the trainer trains is planned with the shapes its runs
see, from configs alone:

- latents: the folder's VAE, built from ``vae/config.json`` on ``meta``, encodes pixels
  (B, 3, H, W), or clips (B, 3, F, H, W) for a video family, at the preset's resolution and
  ``data.frames`` (1 when left out: a folder of images), through the family's
  ``encode_pixels`` (its packing and patchifying included: FLUX.2's (B, 4C, h/2, w/2));
- text: hidden states (B, T, D) with ``D = family.text_dim(model)`` and a full (B, T) mask,
  ``T = data.max_caption_tokens`` (the most a caption gives; a shorter caption costs less),
  and the pooled embedding (B, Dp) of ``pooled_dim``;
- the timestep: (B,) sigmas for a flow family, integer timesteps for a DDPM one.

Z-Image selects each caption's tokens by its mask (``hidden[i][mask[i].bool()]``, a
``nonzero``), which ``meta`` has no kernel for: the call runs under torch's
``meta_nonzero_assume_all_nonzero``, exact here since the mask is full.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from workbench.plan.inventory import PlanInputError
from workbench.worker.families import Text
from workbench.worker.pipelines.folder import read_json

ADD_TIME_IDS = 6
"""Numbers in SDXL's added time ids beside the pooled text: original size, crop origin and
target size (``StableDiffusionXLPipeline._get_add_time_ids``)."""


def pooled_dim(config: Any) -> int:
    """Width of the pooled text embedding a model of ``config`` takes: its
    ``pooled_projection_dim`` (Flux, SD3), the text part of a ``text_time`` UNet's added
    embedding (SDXL: ``projection_class_embeddings_input_dim - 6 x addition_time_embed_dim``),
    else 0 (the trainer's cache then holds a (B, 0) tensor)."""
    width = getattr(config, "pooled_projection_dim", None)
    if width:
        return int(width)
    if getattr(config, "addition_embed_type", None) == "text_time":
        total = config.projection_class_embeddings_input_dim
        return int(total - ADD_TIME_IDS * config.addition_time_embed_dim)
    return 0


def meta_vae(family: Any) -> nn.Module:
    """The folder's VAE on ``meta``: the class ``model_index.json`` names, from its config.

    Raises:
        PlanInputError: the class is not installed or the config does not build it (naming
            ``vae/config.json``).
    """

    root = family.root
    library, class_name = read_json(root / "model_index.json", "model_index.json")["vae"]
    if library not in ("diffusers", "transformers"):
        library = f"diffusers.pipelines.{library}"
    path = root / "vae" / "config.json"
    try:
        cls = getattr(importlib.import_module(library), class_name)
        config = read_json(path, "the VAE's config")
        with torch.device("meta"):
            return cls.from_config(config)
    except Exception as exc:  # the class or its config: name the file, keep the cause
        raise PlanInputError(
            f"model.path: {path}: {class_name} does not build from it on meta "
            f"({type(exc).__name__}: {exc})"
        ) from None


def latent_shape(family: Any, preset: Any, dtype: torch.dtype) -> tuple[int, ...]:
    """(B, C, [F,] h, w): what ``family.encode_pixels`` gives for the preset's batch,
    resolution and frames, computed on ``meta``.

    Raises:
        PlanInputError: ``data.frames`` does not fit the family's VAE, or the VAE does not
            encode on ``meta`` (naming the field or file).
    """
    b, side = preset.batch_size, preset.resolution
    meta = {"device": "meta", "dtype": dtype}
    if family.video:
        frames = preset.data.frames or 1
        try:
            family.check_frames(frames)
        except ValueError as exc:
            raise PlanInputError(str(exc)) from None
        pixels = torch.empty(b, 3, frames, side, side, **meta)
    else:
        pixels = torch.empty(b, 3, side, side, **meta)
    vae = meta_vae(family).to(dtype)
    try:
        with torch.no_grad():
            latents = family.encode_pixels(vae, pixels)
    except Exception as exc:
        raise PlanInputError(
            f"model.path: {family.root / 'vae'} does not encode {tuple(pixels.shape)} pixels "
            f"on meta ({type(exc).__name__}: {exc})"
        ) from None
    try:
        family.check_latents(tuple(latents.shape[1:]))
    except ValueError as exc:
        raise PlanInputError(f"resolution: {exc}") from None
    return tuple(latents.shape)


def family_call(
    family: Any, model: nn.Module, preset: Any, text_len: int | None
) -> Callable[[nn.Module], torch.Tensor]:
    """``call(model) -> prediction``: one training forward of ``model`` as the trainer makes it
    (``family.predict``), on ``meta`` tensors of the preset's shapes (module docstring). The
    shapes are attached as ``call.shapes`` (``latents``, ``text``, ``pooled``: tuples).

    Raises:
        PlanInputError: a field the shapes come from is wrong (named).
    """

    dtype = next(p.dtype for p in model.parameters() if not p.requires_grad)
    shape = latent_shape(family, preset, dtype)
    b = shape[0]
    tokens = text_len or preset.data.max_caption_tokens
    try:
        family.check_caption_tokens(tokens)
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None
    meta = {"device": "meta", "dtype": dtype}
    text = Text(
        hidden=torch.empty(b, tokens, family.text_dim(model), **meta),  # (B, T, D)
        mask=torch.ones(b, tokens, device="meta", dtype=torch.long),  # (B, T) full
        pooled=torch.empty(b, pooled_dim(model.config), **meta),  # (B, Dp)
    )
    if family.objective == "ddpm":
        t = torch.zeros(b, device="meta", dtype=torch.long)  # (B,) timesteps
    else:
        t = torch.empty(b, **meta)  # (B,) sigmas
    x_t = torch.empty(shape, **meta)

    def call(m: nn.Module) -> torch.Tensor:
        from torch.fx.experimental import _config

        with _config.patch(meta_nonzero_assume_all_nonzero=True):
            return family.predict(m, x_t, t, text)

    call.shapes = {  # type: ignore[attr-defined]
        "latents": shape,
        "text": tuple(text.hidden.shape),
        "pooled": tuple(text.pooled.shape),
    }
    return call
