"""SDXL: two CLIPs (CLIP-L's and CLIP-G's penultimate hidden states side by side, CLIP-G's
projected pooled output), ``UNet2DConditionModel`` with ``text_time`` added conditioning, and
DDPM training on the scheduler folder's own noise schedule (diffusers'
``train_text_to_image_lora_sdxl.py``: ``DDPMScheduler`` from ``scheduler/``)::

    t      ~ U{0, ..., num_train_timesteps - 1}
    x_t    = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise            DDPMScheduler.add_noise
    target = noise  (epsilon)  |  sqrt(abar_t) noise - sqrt(1 - abar_t) x0  (v_prediction)

with ``prediction_type`` as ``scheduler/scheduler_config.json`` says (the preset's
``prediction_type`` is for the factory UNet). The validation loss uses the fixed timesteps
``round(s x (num_train_timesteps - 1))`` for the loop's fixed levels ``s``.

Text: one encoder at a time, each pass the body of ``StableDiffusionXLPipeline.encode_prompt``'s
loop over ``(tokenizer, text_encoder)`` (padding to ``model_max_length``, ``hidden_states[-2]``,
the pooled output from the first encoder whose output 0 is 2-D, i.e. CLIP-G's ``text_embeds``);
``join_text`` concatenates the two hidden states along features as ``encode_prompt`` does. The
UNet's cross-attention takes no mask (the cached mask is all ones).

ComfyUI-layout copy: kohya's names over the original (SGM) UNet, what SDXL LoRAs are
distributed in and ComfyUI loads (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``
with ``.lora_down`` / ``.lora_up`` / ``.alpha``); ``StableDiffusionXLLoraLoaderMixin`` maps them
back with ``_maybe_map_sgm_blocks_to_diffusers`` from the UNet's own ``layers_per_block``::

    down_blocks.i.{resnets,attentions}.j  ->  input_blocks.(1 + i (L + 1) + j).{0,1}
    mid_block.resnets.0 / attentions.0 / resnets.1  ->  middle_block.0 / 1 / 2
    up_blocks.i.{resnets,attentions}.j    ->  output_blocks.(i (L + 1) + j).{0,1}

``add_time_ids`` are the pipeline's ``_get_add_time_ids`` for original size = target size = the
bucket's pixel size and crop (0, 0), what ``__call__`` passes by default (the cache keeps no
original sizes or crop offsets). Latents: ``z * scaling_factor``, or with the VAE's
``latents_mean`` / ``latents_std`` ``(z - mean) * scaling_factor / std`` (what ``__call__``
inverts before decoding).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch

from workbench.worker.pipelines.base import PipelineFamily
from workbench.worker.pipelines.folder import PipelineFolderError, read_json


def _clip_pass(index: int):
    def clip_pass(pipe, texts, device, max_tokens):
        tokenizer = pipe.tokenizer_2 if index else pipe.tokenizer
        encoder = pipe.text_encoder_2 if index else pipe.text_encoder
        ids = tokenizer(
            texts,
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        out = encoder(ids.to(device), output_hidden_states=True)
        parts = {f"clip{index}_hidden": out.hidden_states[-2]}  # (b, 77, Dc)
        if out[0].ndim == 2:  # a projection model: its text_embeds are the pooled output
            parts[f"clip{index}_pooled"] = out[0]  # (b, Dp)
        return parts

    return clip_pass


_STAGE = re.compile(r"(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)")
_MID = {"resnets.0": "0", "attentions.0": "1", "resnets.1": "2"}


def sgm_name(module: str, layers_per_block: int) -> str | None:
    """The original (SGM) UNet's name of the diffusers module ``module`` (module doc), or None
    for a module outside the down, mid and up blocks' resnets and attentions."""
    m = _STAGE.fullmatch(module)
    if m:
        kind, i, part, j, rest = m.groups()
        inner = "0" if part == "resnets" else "1"
        if kind == "down_blocks":
            return f"input_blocks.{1 + int(i) * (layers_per_block + 1) + int(j)}.{inner}.{rest}"
        return f"output_blocks.{int(i) * (layers_per_block + 1) + int(j)}.{inner}.{rest}"
    if module.startswith("mid_block."):
        part, _, rest = module.removeprefix("mid_block.").partition(".")
        part = f"{part}.{rest.partition('.')[0]}"
        if part in _MID:
            return f"middle_block.{_MID[part]}.{rest.partition('.')[2]}"
    return None


class SDXLPipelineFamily(PipelineFamily):
    name, model_class, lora_mixin = (
        "sdxl",
        "UNet2DConditionModel",
        "StableDiffusionXLLoraLoaderMixin",
    )
    pipeline_class = "StableDiffusionXLPipeline"
    text_dim_field = "cross_attention_dim"
    lora_prefix = "unet"
    objective = "ddpm"
    tokenizers = ("tokenizer", "tokenizer_2")
    text_passes = (("text_encoder", _clip_pass(0)), ("text_encoder_2", _clip_pass(1)))
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    """diffusers' ``train_dreambooth_lora_sdxl.py`` targets (every attention of the UNet)."""

    def __init__(self) -> None:
        super().__init__()
        self._ddpm = None

    def expert_component(self, info, expert):
        super().expert_component(info, expert)  # refuses model.expert
        return "unet"

    def join_text(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``encode_prompt``'s combination: hidden (U, 77, Dl + Dg), pooled (U, Dp)."""
        hidden = torch.cat([parts["clip0_hidden"], parts["clip1_hidden"]], dim=-1)
        pooled = parts.get("clip0_pooled", parts.get("clip1_pooled"))
        if pooled is None:
            raise PipelineFolderError(
                f"{self.root}/text_encoder*/config.json: neither text encoder has a projection "
                "(CLIPTextModelWithProjection); SDXL takes its pooled text_embeds"
            )
        return {
            "hidden": hidden,
            "mask": torch.ones(hidden.shape[:2], dtype=torch.int64),
            "pooled": pooled,
        }

    def check_components(self) -> None:
        """The UNet's text, added-conditioning and latent inputs must fit the encoders and VAE.

        Raises:
            PipelineFolderError: naming ``unet/config.json`` and each field that does not fit
                (``cross_attention_dim``, ``addition_embed_type``,
                ``projection_class_embeddings_input_dim``, ``in_channels``).
        """
        enc = [
            read_json(self.root / n / "config.json", f"the {n}'s config")
            for n in ("text_encoder", "text_encoder_2")
        ]
        vae = read_json(self.root / "vae" / "config.json", "the VAE's config")
        ucfg = read_json(self.transformer_dir / "config.json", "the UNet's config")
        problems = []
        width = sum(e.get("hidden_size", 0) for e in enc)
        if ucfg.get("cross_attention_dim") != width:
            problems.append(
                f"cross_attention_dim is {ucfg.get('cross_attention_dim')}; expected "
                f"text_encoder + text_encoder_2 hidden_size ({width})"
            )
        if ucfg.get("addition_embed_type") != "text_time":
            problems.append(
                f"addition_embed_type is {ucfg.get('addition_embed_type')!r}; expected "
                "'text_time' (pooled text and add_time_ids)"
            )
        else:
            added = 6 * (ucfg.get("addition_time_embed_dim") or 0) + enc[1].get("projection_dim", 0)
            if ucfg.get("projection_class_embeddings_input_dim") != added:
                problems.append(
                    "projection_class_embeddings_input_dim is "
                    f"{ucfg.get('projection_class_embeddings_input_dim')}; expected 6 x "
                    "addition_time_embed_dim + text_encoder_2 projection_dim "
                    f"({added})"
                )
        if ucfg.get("in_channels") != vae.get("latent_channels"):
            problems.append(
                f"in_channels is {ucfg.get('in_channels')}; expected vae latent_channels "
                f"({vae.get('latent_channels')})"
            )
        self.check_fit(problems)

    def check_latents(self, shape: tuple[int, ...]) -> None:
        if len(shape) != 3:
            raise ValueError(f"sdxl trains on images: latents (C, h, w) expected, got {shape}")

    def encode_pixels(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """(n, 3, H, W) in [-1, 1] -> (n, C, h, w) normalised as the module doc says."""
        cfg = vae.config
        z = vae.encode(pixels).latent_dist.mean
        mean, std = getattr(cfg, "latents_mean", None), getattr(cfg, "latents_std", None)
        if mean is not None and std is not None:
            c = z.shape[1]
            mean = torch.tensor(mean).view(1, c, 1, 1).to(z)
            std = torch.tensor(std).view(1, c, 1, 1).to(z)
            return (z - mean) * cfg.scaling_factor / std
        return z * cfg.scaling_factor

    # -- training ---------------------------------------------------------------------------
    def noise_schedule(self):
        """``DDPMScheduler`` on the folder's betas and ``prediction_type``.

        Raises:
            PipelineFolderError: a ``prediction_type`` other than epsilon / v_prediction.
        """
        from diffusers import DDPMScheduler

        if self._ddpm is not None:
            return self._ddpm
        sched = DDPMScheduler.from_config(self.scheduler().config)
        if sched.config.prediction_type not in ("epsilon", "v_prediction"):
            raise PipelineFolderError(
                f"{self.root / 'scheduler' / 'scheduler_config.json'}: prediction_type is "
                f"{sched.config.prediction_type!r}; expected epsilon or v_prediction"
            )
        self._ddpm = sched
        return sched

    def _pair(self, sched, x0, noise, t):
        x_t = sched.add_noise(x0, noise, t)  # (B, C, h, w)
        if sched.config.prediction_type == "v_prediction":
            return x_t, t, sched.get_velocity(x0, noise, t)
        return x_t, t, noise

    def training_pair(self, x0, noise, generator, preset):
        """``(x_t, t, target)``: t (B,) int64 uniform over the schedule's timesteps."""
        sched = self.noise_schedule()
        n = sched.config.num_train_timesteps
        t = torch.randint(0, n, (x0.shape[0],), generator=generator).to(x0.device)
        return self._pair(sched, x0, noise, t)

    def check_validation(self) -> None:
        """SDXL's validation loss is DDPM's at fixed timesteps (module doc)."""

    def validation_pair(self, x0, noise, s):
        sched = self.noise_schedule()
        t = round(s * (sched.config.num_train_timesteps - 1))
        return self._pair(sched, x0, noise, torch.full((x0.shape[0],), t, device=x0.device))

    def vae_scale_factor(self) -> int:
        cfg = read_json(self.root / "vae" / "config.json", "the VAE's config")
        return 2 ** (len(cfg.get("block_out_channels", [0] * 4)) - 1)

    def add_time_ids(self, model, b: int, h: int, w: int, pooled_dim: int, x: torch.Tensor):
        """(B, 6) ``_get_add_time_ids`` for an (h, w) latent: (H, W, 0, 0, H, W) in pixels."""
        size = (h * self.vae_scale_factor(), w * self.vae_scale_factor())
        ids = self.pipeline_cls()._get_add_time_ids(
            SimpleNamespace(unet=model), size, (0, 0), size, x.dtype, pooled_dim
        )
        return ids.to(x.device).repeat(b, 1)

    def predict(self, model, x_t, t, text):
        """The predicted noise (or velocity), (B, C, h, w); ``t`` is (B,) integer timesteps."""
        b, _, h, w = x_t.shape
        time_ids = self.add_time_ids(model, b, h, w, text.pooled.shape[-1], x_t)
        return model(
            x_t,  # (B, C, h, w)
            t,
            encoder_hidden_states=text.hidden,  # (B, 77, Dl + Dg)
            added_cond_kwargs={"text_embeds": text.pooled, "time_ids": time_ids},
            return_dict=False,
        )[0]

    def comfy_state_dict(self, state):
        """The LoRA ``state`` (scale folded into ``lora_B``) in kohya's SGM names (module doc),
        ``.alpha`` the rank (scale 1); None when the UNet's ``layers_per_block`` differs per
        level or a module has no SGM name."""
        layers = read_json(self.transformer_dir / "config.json", "the UNet's config").get(
            "layers_per_block"
        )
        if isinstance(layers, list):
            if len(set(layers)) != 1:
                return None
            layers = layers[0]
        out = {}
        for key, value in state.items():
            module, _, part = key.removeprefix(f"{self.lora_prefix}.").rpartition(".lora_")
            name = sgm_name(module, int(layers))
            if name is None:
                return None
            kohya = "lora_unet_" + name.replace(".", "_")
            out[f"{kohya}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = value
            if part.startswith("A"):
                out[f"{kohya}.alpha"] = torch.tensor(float(value.shape[0]))  # the rank
        return out

    def sample(self, model, text, spec):
        return self.sample_pooled({"unet": model}, text, spec)
