"""Per-family adapters: how latents are packed, how the model is called, which training
objective it has, which LoRA mixin saves the weights. The flow families (Flux, SD3, LTX) train
with flow matching (rectified flow, as they were trained)::

    x_t    = (1 - s) * x0 + s * noise          s in [0, 1] (the sigma)
    target = noise - x0                        the velocity the transformer predicts

The UNet family (SD 1.x-style ``UNet2DConditionModel``) trains with DDPM noise prediction
(Ho et al. 2020; diffusers' ``train_text_to_image.py``)::

    t      ~ U{0, ..., 999}
    x_t    = sqrt(abar_t) * x0 + sqrt(1 - abar_t) * noise     (DDPMScheduler.add_noise)
    target = noise  (epsilon)  or  sqrt(abar_t) * noise - sqrt(1 - abar_t) * x0  (v_prediction)

Latents are VAE latents times the VAE's ``scaling_factor``: images (B, C, h, w), clips
(B, C, F, h, w) with each frame encoded by the 2D VAE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Text:
    """Cached text conditioning for a batch."""

    hidden: torch.Tensor  # (B, T, D) last hidden state: encoder_hidden_states
    mask: torch.Tensor  # (B, T) 1 for tokens, 0 for padding
    pooled: torch.Tensor  # (B, D) mean over the unpadded tokens: pooled_projections


class Family:
    """Base adapter; subclasses implement ``predict``."""

    name = ""
    model_class = ""
    lora_mixin = ""
    video = False
    objective = "flow"
    """``flow`` (velocity, sigma in [0, 1]) or ``ddpm`` (noise prediction, integer timesteps)."""

    def training_pair(
        self, x0: torch.Tensor, noise: torch.Tensor, generator: torch.Generator, preset: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x_t, t, target)`` for one step; ``t`` is what ``predict`` takes (here sigma (B,)
        in ``x0``'s dtype). Draws from ``generator`` only, so a step is a function of its seed."""
        sigma = sample_sigmas(
            x0.shape[0],
            preset.timestep_distribution,
            generator,
            preset.logit_mean,
            preset.logit_std,
        ).to(x0.device)
        x_t, target = flow_pair(x0, noise, sigma)
        return x_t, sigma.to(x0.dtype), target

    def validation_sigmas(self, fixed: tuple[float, ...]) -> tuple[float, ...]:
        """The sigmas of the validation loss (a pipeline expert maps them into its range)."""
        return fixed

    def check_validation(self) -> None:
        """Raise ``ValueError`` when the family has no validation loss (``validation_every``)."""
        if self.objective != "flow":
            raise ValueError(f"validation_every: the {self.name} family has no flow validation")

    def validation_pair(
        self, x0: torch.Tensor, noise: torch.Tensor, s: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x_t, t, target)`` of the validation loss at the fixed noise level ``s`` in (0, 1)
        (flow: the sigma ``s``; ``x0``, ``noise``: (1, C, [F,] h, w)).

        Raises:
            ValueError: the family has no validation loss (a factory DDPM family).
        """
        self.check_validation()
        sigma = torch.full((x0.shape[0],), s, device=x0.device, dtype=x0.dtype)
        x_t, target = flow_pair(x0, noise, sigma)
        return x_t, sigma, target

    def text_dim(self, model: torch.nn.Module) -> int | None:
        """The text hidden size the model takes, or None when it does not say."""
        cfg = model.config
        return getattr(cfg, "joint_attention_dim", None) or getattr(cfg, "caption_channels", None)

    def check_latents(self, shape: tuple[int, ...]) -> None:
        """Raise ``ValueError`` when latents of ``shape`` (C, [F,] h, w) cannot be fed."""

    def predict(
        self, model: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, text: Text
    ) -> torch.Tensor:
        """The predicted velocity, same shape as ``x_t``. ``sigma`` is (B,) in [0, 1]."""
        raise NotImplementedError

    def load_class(self) -> type:
        import diffusers

        return getattr(diffusers, self.model_class)

    lora_prefix = "transformer"
    """Key prefix of the saved LoRA (``transformer.`` / ``unet.``): ``load_lora_adapter``'s prefix."""

    def save_lora(self, folder: str, state_dict: dict[str, torch.Tensor], metadata: Any) -> None:
        """Write ``pytorch_lora_weights.safetensors`` the way the family's pipeline reads it."""
        import diffusers.loaders as loaders

        mixin = getattr(loaders, self.lora_mixin)
        mixin.save_lora_weights(
            folder,
            **{
                f"{self.lora_prefix}_lora_layers": state_dict,
                f"{self.lora_prefix}_lora_adapter_metadata": metadata,
            },
        )


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): Flux's 2x2 latent patches (diffusers' _pack_latents)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(packed: torch.Tensor, c: int, h: int, w: int) -> torch.Tensor:
    """(B, h/2 * w/2, 4C) -> (B, C, h, w), the inverse of ``pack_2x2``."""
    b = packed.shape[0]
    x = packed.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


class FluxFamily(Family):
    name, model_class, lora_mixin = "flux", "FluxTransformer2DModel", "FluxLoraLoaderMixin"
    guidance = 1.0
    """Guidance fed to guidance-distilled models while training (Flux-dev LoRA practice)."""

    def check_latents(self, shape: tuple[int, ...]) -> None:
        if shape[-1] % 2 or shape[-2] % 2:
            raise ValueError(
                f"flux packs 2x2 latent patches: latent h, w {shape[-2:]} must be even"
            )

    def predict(self, model, x_t, sigma, text):
        b, c, h, w = x_t.shape
        ids = torch.zeros(h // 2, w // 2, 3, device=x_t.device, dtype=x_t.dtype)
        ids[..., 1] = torch.arange(h // 2, device=x_t.device)[:, None]
        ids[..., 2] = torch.arange(w // 2, device=x_t.device)[None, :]
        kwargs = {}
        if getattr(model.config, "guidance_embeds", False):
            kwargs["guidance"] = torch.full((b,), self.guidance, device=x_t.device, dtype=x_t.dtype)
        out = model(
            hidden_states=pack_2x2(x_t),  # (B, tokens, 4C)
            encoder_hidden_states=text.hidden,
            pooled_projections=text.pooled,
            timestep=sigma,  # Flux scales [0, 1] by 1000 inside
            img_ids=ids.reshape(-1, 3),
            txt_ids=torch.zeros(text.hidden.shape[1], 3, device=x_t.device, dtype=x_t.dtype),
            return_dict=False,
            **kwargs,
        )[0]
        return unpack_2x2(out, c, h, w)


class SD3Family(Family):
    name, model_class, lora_mixin = "sd3", "SD3Transformer2DModel", "SD3LoraLoaderMixin"

    def check_latents(self, shape: tuple[int, ...]) -> None:
        if shape[-1] % 2 or shape[-2] % 2:
            raise ValueError(f"sd3 patches 2x2 latents: latent h, w {shape[-2:]} must be even")

    def predict(self, model, x_t, sigma, text):
        return model(
            hidden_states=x_t,  # (B, C, h, w)
            encoder_hidden_states=text.hidden,
            pooled_projections=text.pooled,
            timestep=sigma * 1000,
            return_dict=False,
        )[0]


class LTXFamily(Family):
    name, model_class, lora_mixin = "ltx", "LTXVideoTransformer3DModel", "LTXVideoLoraLoaderMixin"
    video = True

    def predict(self, model, x_t, sigma, text):
        if x_t.dim() == 4:  # an image: a clip of one frame
            return self.predict(model, x_t.unsqueeze(2), sigma, text).squeeze(2)
        b, c, f, h, w = x_t.shape
        tokens = x_t.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)  # (B, F*h*w, C)
        out = model(
            hidden_states=tokens,
            encoder_hidden_states=text.hidden,
            timestep=sigma * 1000,
            encoder_attention_mask=text.mask.to(x_t.dtype),
            num_frames=f,
            height=h,
            width=w,
            return_dict=False,
        )[0]
        return out.reshape(b, f, h, w, c).permute(0, 4, 1, 2, 3)


NUM_TRAIN_TIMESTEPS = 1000


def ddpm_scheduler(prediction_type: str = "epsilon"):
    """The SD 1.x training noise schedule: 1000 steps, ``scaled_linear`` betas 0.00085..0.012."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        num_train_timesteps=NUM_TRAIN_TIMESTEPS,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type=prediction_type,
        clip_sample=False,
    )


class UNetFamily(Family):
    """SD 1.x-style ``UNet2DConditionModel``: DDPM noise prediction, MiniLM last hidden state as
    ``encoder_hidden_states``. ``timestep_distribution`` does not apply (t is uniform)."""

    name, model_class, lora_mixin = "unet", "UNet2DConditionModel", "StableDiffusionLoraLoaderMixin"
    lora_prefix = "unet"
    objective = "ddpm"

    def check_latents(self, shape: tuple[int, ...]) -> None:
        if len(shape) != 3:
            raise ValueError(f"unet trains on images: latents (C, h, w) expected, got {shape}")

    def training_pair(self, x0, noise, generator, preset):
        """``(x_t, t, target)``: t (B,) int64 uniform in [0, 1000), x_t from ``add_noise``, the
        target ``noise`` (epsilon) or ``get_velocity`` (``preset.prediction_type``)."""
        prediction = getattr(preset, "prediction_type", "epsilon")
        sched = ddpm_scheduler(prediction)
        t = torch.randint(0, NUM_TRAIN_TIMESTEPS, (x0.shape[0],), generator=generator)
        t = t.to(x0.device)
        x_t = sched.add_noise(x0, noise, t)  # (B, C, h, w)
        if prediction == "v_prediction":
            return x_t, t, sched.get_velocity(x0, noise, t)
        if prediction != "epsilon":
            raise ValueError(f"prediction_type {prediction!r}: expected epsilon or v_prediction")
        return x_t, t, noise

    def text_dim(self, model):
        return getattr(model.config, "cross_attention_dim", None)

    def predict(self, model, x_t, t, text):
        """The predicted noise (or velocity), (B, C, h, w); ``t`` is (B,) integer timesteps."""
        return model(
            sample=x_t,  # (B, C, h, w)
            timestep=t,
            encoder_hidden_states=text.hidden,  # (B, T, 384)
            return_dict=False,
        )[0]


FAMILIES: dict[str, Family] = {
    "flux": FluxFamily(),
    "sd3": SD3Family(),
    "ltx": LTXFamily(),
    "unet": UNetFamily(),
}


def family(name: str) -> Family:
    """The adapter for ``name`` (``flux`` | ``sd3`` | ``ltx`` | ``unet``); ``KeyError`` lists
    the known."""
    if name not in FAMILIES:
        raise KeyError(f"no trainer adapter for family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def sample_sigmas(
    n: int, distribution: str, generator: torch.Generator, mean: float = 0.0, std: float = 1.0
) -> torch.Tensor:
    """(n,) sigmas in (0, 1): ``uniform`` or ``logit_normal`` (SD3 paper, sigmoid(N(mean, std)))."""
    if distribution == "uniform":
        return torch.rand(n, generator=generator)
    if distribution == "logit_normal":
        return torch.sigmoid(torch.randn(n, generator=generator) * std + mean)
    raise ValueError(f"timestep_distribution {distribution!r}: expected uniform or logit_normal")


def euler_sigmas(steps: int) -> torch.Tensor:
    """(steps + 1,) the sigmas of the flow sampler's Euler steps, 1 (noise) down to 0: the model
    is evaluated at the first ``steps`` of them (1, 1 - 1/steps, ..., 1/steps)."""
    return torch.linspace(1.0, 0.0, steps + 1)


def flow_pair(
    x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, target)`` of rectified flow: x_t = (1 - s) x0 + s noise, target = noise - x0."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise, noise - x0
