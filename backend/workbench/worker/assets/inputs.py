"""Example forward inputs for the models the factory builds.

``latent_hw`` is always the *VAE latent* height/width (pixels / 8), so the same
``latent_hw`` means the same image size for every arch:

* FluxTransformer2DModel (2x2 packing): tokens = (H/2) * (W/2)

  - ``hidden_states``          (B, tokens, in_channels=16)   packed latents
  - ``encoder_hidden_states``  (B, text_len, joint_attention_dim=384)
  - ``pooled_projections``     (B, pooled_projection_dim=384)
  - ``timestep``               (B,) float in [0, 1] (the model scales by 1000)
  - ``img_ids``                (tokens, 3) float: (0, row, col)
  - ``txt_ids``                (text_len, 3) zeros
  - ``guidance``               (B,) float, only when ``config.guidance_embeds``
  - output ``.sample``         (B, tokens, in_channels)

* SD3Transformer2DModel (patch_size 2 inside the model):

  - ``hidden_states``          (B, 4, H, W)
  - ``encoder_hidden_states``  (B, text_len, 384)
  - ``pooled_projections``     (B, 384)
  - ``timestep``               (B,) float in [0, 1000]
  - output ``.sample``         (B, 4, H, W)

* LTXVideoTransformer3DModel (patch_size 1): tokens = frames * H * W

  - ``hidden_states``          (B, tokens, 4)   flattened (F, H, W) video latents
  - ``encoder_hidden_states``  (B, text_len, caption_channels=384)
  - ``timestep``               (B,) float in [0, 1000]
  - ``encoder_attention_mask`` (B, text_len) ones
  - ``num_frames``, ``height``, ``width``: ints = frames, H, W
  - output ``.sample``         (B, tokens, 4)

* UNet2DConditionModel (SD 1.x style):

  - ``sample``                 (B, 4, H, W)
  - ``timestep``               (B,) int64 in [0, 1000) (DDPM training timesteps)
  - ``encoder_hidden_states``  (B, text_len, cross_attention_dim=384)
  - output ``.sample``         (B, 4, H, W)

* AutoencoderKL: ``sample`` (B, 3, 8H, 8W) in [-1, 1]; output ``.sample`` same shape.

Every tensor has ``requires_grad=False``; LoRA training gets gradients through the
adapter parameters only.
"""

from __future__ import annotations

from typing import Any

import torch


def _base(model: torch.nn.Module) -> torch.nn.Module:
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    return get_base() if callable(get_base) else model


def _kind(model: torch.nn.Module) -> str:
    names = {c.__name__ for c in type(_base(model)).__mro__}
    for name, kind in (
        ("FluxTransformer2DModel", "flux"),
        ("SD3Transformer2DModel", "sd3"),
        ("LTXVideoTransformer3DModel", "ltx"),
        ("UNet2DConditionModel", "unet"),
        ("AutoencoderKL", "vae"),
    ):
        if name in names:
            return kind
    raise TypeError(f"example_inputs: unsupported model class {type(model).__name__}")


def example_inputs(
    model: torch.nn.Module,
    batch_size: int = 1,
    seed: int = 0,
    latent_hw: tuple[int, int] = (8, 8),
    text_len: int = 8,
    frames: int = 2,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Keyword arguments for one ``model(**kwargs)`` forward (see the module docstring for
    shapes). Device/dtype default to the model's first parameter. Deterministic in ``seed``.
    """
    base = _base(model)
    kind = _kind(base)
    cfg = base.config
    p = next(base.parameters())
    device = torch.device(device) if device is not None else p.device
    dtype = dtype or p.dtype
    g = torch.Generator().manual_seed(seed)
    h, w = latent_hw
    B = batch_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g).to(device=device, dtype=dtype)

    if kind == "vae":
        return {"sample": (rand(B, cfg.in_channels, 8 * h, 8 * w) * 2 - 1)}

    if kind == "unet":
        return {
            "sample": randn(B, cfg.in_channels, h, w),
            "timestep": torch.randint(0, 1000, (B,), generator=g).to(device),
            "encoder_hidden_states": randn(B, text_len, cfg.cross_attention_dim),
        }

    text = randn(B, text_len, getattr(cfg, "joint_attention_dim", None) or cfg.caption_channels)

    if kind == "flux":
        if h % 2 or w % 2:
            raise ValueError(f"flux packs 2x2 latent patches; latent_hw {latent_hw} must be even")
        hp, wp = h // 2, w // 2
        ids = torch.zeros(hp, wp, 3)
        ids[..., 1] = torch.arange(hp)[:, None]
        ids[..., 2] = torch.arange(wp)[None, :]
        kwargs: dict[str, Any] = {
            "hidden_states": randn(B, hp * wp, cfg.in_channels),
            "encoder_hidden_states": text,
            "pooled_projections": randn(B, cfg.pooled_projection_dim),
            "timestep": rand(B),
            "img_ids": ids.reshape(hp * wp, 3).to(device=device, dtype=dtype),
            "txt_ids": torch.zeros(text_len, 3, device=device, dtype=dtype),
        }
        if cfg.guidance_embeds:
            kwargs["guidance"] = torch.full((B,), 3.5, device=device, dtype=dtype)
        return kwargs

    if kind == "sd3":
        return {
            "hidden_states": randn(B, cfg.in_channels, h, w),
            "encoder_hidden_states": text,
            "pooled_projections": randn(B, cfg.pooled_projection_dim),
            "timestep": rand(B) * 1000,
        }

    # ltx
    return {
        "hidden_states": randn(B, frames * h * w, cfg.in_channels),
        "encoder_hidden_states": text,
        "timestep": rand(B) * 1000,
        "encoder_attention_mask": torch.ones(B, text_len, device=device, dtype=dtype),
        "num_frames": frames,
        "height": h,
        "width": w,
    }


def output_tensor(out: Any) -> torch.Tensor:
    """The main tensor of a model output: ``.sample`` of a diffusers output object, the
    first element of a tuple (``return_dict=False``), or the tensor itself."""
    if isinstance(out, torch.Tensor):
        return out
    sample = getattr(out, "sample", None)
    if isinstance(sample, torch.Tensor):
        return sample
    if isinstance(out, (tuple, list)) and out:
        return output_tensor(out[0])
    if isinstance(out, dict) and "sample" in out:
        return out["sample"]
    raise TypeError(f"output_tensor: cannot extract a tensor from {type(out).__name__}")
