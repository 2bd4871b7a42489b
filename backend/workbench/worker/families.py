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
from pathlib import Path
from typing import Any

import torch

from workbench.contract.preset import FAMILIES as FAMILY_NAMES
from workbench.worker.diffusers_classes import diffusers_class
from workbench.worker.encode import encode_texts
from workbench.worker.schedules import (
    NUM_TRAIN_TIMESTEPS,
    ddim_sample,
    ddpm_scheduler,
    euler_sigmas,
    flow_pair,
    sample_sigmas,
)


@dataclass(frozen=True)
class Text:
    """Cached text conditioning for a batch."""

    hidden: torch.Tensor  # (B, T, D) last hidden state: encoder_hidden_states
    mask: torch.Tensor  # (B, T) 1 for tokens, 0 for padding
    pooled: torch.Tensor  # (B, D) mean over the unpadded tokens: pooled_projections


@dataclass(frozen=True)
class SampleSpec:
    """What ``Family.sample`` draws: one image (a clip's first frame) per text row."""

    latent_shape: tuple[int, ...]  # (C, h, w) or (C, F, h, w): one sample's latents
    steps: int  # sampler steps (Euler / DDIM / the pipeline's scheduler)
    seed: int  # the CPU generator's seed of the initial noise
    device: torch.device
    dtype: torch.dtype  # the model's compute dtype
    guidance: float  # a pipeline's guidance_scale where it applies
    vae_dir: Path | None = None  # a factory family's VAE folder (a pipeline uses its own)
    prediction_type: str = "epsilon"  # a DDPM family's target (epsilon / v_prediction)


class Family:
    """The one family protocol: every family implements all of it, the factory families (this
    module: tiny models built from a spec, the run's own VAE and MiniLM text encoder) and the
    pipeline families (``workbench.worker.pipelines``: a diffusers pipeline folder, bound by ``bind``).
    The worker asks a family, never which kind it is.

    Shapes: latents are (B, C, h, w) for images and (B, C, F, h, w) for clips (F latent frames),
    in the normalised space the family trains in (VAE mean, shifted and scaled as its pipeline
    inverts); text rows are a ``Text`` of U prompts; sigmas are flow-matching noise levels in
    [0, 1] (0 clean, 1 noise) and timesteps are integer DDPM steps in [0, 1000).
    """

    name = ""
    model_class = ""
    lora_mixin = ""
    video = False
    """Whether the transformer takes (B, C, F, h, w) clips (the factory LTX takes stacked frames)."""
    clips = False
    """Whether the data are clips encoded whole by a 3D video VAE (``data.frames`` is frames per
    clip, chosen from the clips when unset: ``temporal_ratio``); otherwise images, each frame
    through a 2D VAE."""
    objective = "flow"
    """``flow`` (velocity, sigma in [0, 1]) or ``ddpm`` (noise prediction, integer timesteps)."""
    lora_targets: tuple[str, ...] | None = None
    """LoRA target module names when the preset names none; None keeps the preset's default."""
    info: Any = None
    """The inspected pipeline folder (``folder.PipelineInfo``) a bound family trains from."""

    # -- set-up ------------------------------------------------------------------------------
    def own_folders(self, preset: Any) -> tuple[Path, Path] | None:
        """``(denoiser folder, VAE folder)`` when the family brings its own (a pipeline
        folder: its text encoders are its components), else None: the run's model, VAE and
        text encoder folders come from the preset (``setup.resolve_assets``)."""
        return None

    def report(self, telemetry: Any, progress: Any) -> None:
        """Record what the family trains from (a pipeline folder's ``trainer/pipeline``)."""

    def check_caption_tokens(self, tokens: int) -> None:
        """Raise ``ValueError`` when ``data.max_caption_tokens`` does not fit the text stack."""

    def check_frames(self, frames: int | None) -> None:
        """Raise ``ValueError`` when ``data.frames`` (pixel frames per clip) does not fit the
        family's video VAE (only asked of ``clips`` families)."""

    def temporal_ratio(self) -> int:
        """Pixel frames per latent frame after the first (a video VAE's temporal compression;
        1 where there is none)."""
        return 1

    # -- stage 1 -----------------------------------------------------------------------------
    def latent_key(self, frames: int | None) -> dict[str, Any]:
        """What the latent cache's key adds for this family (a pipeline family's name and
        ``data.frames``; nothing for a factory family, whose VAE folder says it all)."""
        return {}

    def load_vae(self, vae_path: Path) -> Any:
        """The VAE of ``vae_path`` in fp32 on the CPU, in eval mode."""
        from diffusers import AutoencoderKL

        return AutoencoderKL.from_pretrained(vae_path, torch_dtype=torch.float32).eval()

    def encode_pixels(self, vae: Any, pixels: torch.Tensor) -> torch.Tensor:
        """(n, 3, H, W) in [-1, 1] -> normalised latents (n, C, h, w): the mean of the latent
        distribution, ``(z - shift_factor) * scaling_factor`` (what the pipeline inverts); a
        ``clips`` family's (1, 3, F, H, W) -> (1, C, F', h, w)."""
        shift = float(getattr(vae.config, "shift_factor", None) or 0.0)
        return (vae.encode(pixels).latent_dist.mean - shift) * vae.config.scaling_factor

    def encode_texts(
        self, texts: list[str], encoder_dir: Path | None, **kwargs: Any
    ) -> dict[str, torch.Tensor] | None:
        """Stage 1's text cache for ``texts`` (U unique strings, in order): ``hidden``
        (U, T, D) float32, ``mask`` (U, T) int64 (1 token, 0 padding), ``pooled`` (U, Dp)
        (U, 0 where the family has none); None when a stop request arrived. A factory family
        runs the MiniLM-style encoder in ``encoder_dir`` (``encode.encode_texts``); ``kwargs``
        are ``encode.run_encoder``'s (memory, dtype, device, telemetry, cache_dir, max_tokens,
        progress, should_stop)."""

        kwargs.pop("dtype", None)  # MiniLM runs in fp32 whatever the model's dtype
        return encode_texts(texts, encoder_dir, **kwargs)

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
        return diffusers_class(self.model_class)

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

    def lora_metadata(self) -> dict[str, str]:
        """Extra safetensors metadata of the saved LoRA (a pipeline's base model and family)."""
        return {}

    def comfy_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The LoRA ``state`` in ComfyUI's key layout, or None when no such copy is written."""
        return None

    # -- samples ---------------------------------------------------------------------------
    def inference_strategy(
        self, model: torch.nn.Module, memory: Any, device: torch.device, telemetry: Any
    ) -> Any:
        """The strategy that streams ``model`` for samples drawn outside training (built here,
        closed by the caller), or None when ``model`` is simply moved onto ``device`` (a
        factory model is small)."""
        model.to(device)
        return None

    def sample(self, model: torch.nn.Module, text: Text, spec: SampleSpec) -> list[Any]:
        """One PIL image per row of ``text`` (U prompts), from noise of ``spec.latent_shape``
        drawn on the CPU from ``spec.seed``. Here (factory families): ``spec.steps`` Euler
        steps of the flow ODE from sigma 1 (noise) to 0, or, for the DDPM objective, DDIM steps
        (eta 0) on the training schedule with ``spec.prediction_type``; decoded by the VAE in
        ``spec.vae_dir`` (a clip's first frame). A factory sampler has no CFG
        (``spec.guidance`` is the pipelines')."""
        from PIL import Image

        n, device, dtype = text.hidden.shape[0], spec.device, spec.dtype
        g = torch.Generator().manual_seed(spec.seed)
        x = torch.randn(n, *spec.latent_shape, generator=g).to(device, dtype)  # (n, C, [F,] h, w)
        if self.objective == "ddpm":
            x = ddim_sample(self, model, x, text, spec.steps, spec.prediction_type)
        else:
            sigmas = euler_sigmas(spec.steps)  # (steps + 1,)
            for i in range(spec.steps):
                s = torch.full((n,), float(sigmas[i]), device=device, dtype=dtype)
                v = self.predict(model, x, s, text)
                x = x + (sigmas[i + 1] - sigmas[i]) * v  # dx/ds = noise - x0 = v
        vae = self.load_vae(spec.vae_dir).to(device)
        shift = float(getattr(vae.config, "shift_factor", None) or 0.0)
        z = x.float()
        if z.dim() == 5:
            z = z[:, :, 0]  # first frame of each clip: (n, C, h, w)
        images = vae.decode(z / vae.config.scaling_factor + shift).sample  # (n, 3, H, W)
        out = []
        for img in images:
            arr = ((img.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu()
            out.append(Image.fromarray(arr.numpy()))
        return out


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
    f.name: f for f in (FluxFamily(), SD3Family(), LTXFamily(), UNetFamily())
}
"""The factory families' adapters by name. The names are listed once, in the contract
(``workbench.contract.preset.FAMILIES``, which presets are validated and the page is served against); each
adapter names the one it implements, and the import fails if the two disagree."""
if tuple(FAMILIES) != FAMILY_NAMES:
    raise ImportError(
        f"workbench.worker.families: adapters {tuple(FAMILIES)} do not match workbench.contract.preset.FAMILIES "
        f"{FAMILY_NAMES}"
    )


def family(name: str) -> Family:
    """The adapter for ``name`` (``flux`` | ``sd3`` | ``ltx`` | ``unet``); ``KeyError`` lists
    the known."""
    if name not in FAMILIES:
        raise KeyError(f"no trainer adapter for family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]
