"""Wan 2.1 / 2.2 text-to-video: UMT5 sequence (padded with zeros to the token limit, as
``WanPipeline._get_t5_prompt_embeds`` gives it), a 3D causal VAE normalised by
``latents_mean`` / ``latents_std``, the transformer's own 3D patching, the static
``flow_shift`` of the UniPC scheduler Wan ships, and ``__call__`` for samples.

Wan 2.2 A14B has two experts: ``transformer`` denoises the high-noise part
(``t >= boundary_ratio * 1000``, sigma in [b, 1]) and ``transformer_2`` the rest (sigma in
[0, b)), as ``WanPipeline.__call__`` switches between them. A run trains one
(``model.expert``); its sigmas are the shifted draw mapped into that expert's range.

Latents: ``(mean(z) - latents_mean) / latents_std`` per channel (``__call__`` decodes
``z * latents_std + latents_mean``); clips (1, 3, F, H, W) with F = 4k + 1 give
(C, k + 1, h, w); an image is a clip of one frame.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workbench.worker.pipelines.base import PipelineFamily, load_component
from workbench.worker.pipelines.folder import PipelineFolderError, read_json

EXPERTS = {"high_noise": "transformer", "low_noise": "transformer_2"}


def _umt5_pass(pipe, texts, device, max_tokens):
    hidden = pipe._get_t5_prompt_embeds(
        prompt=texts, max_sequence_length=max_tokens, device=device, dtype=pipe.text_encoder.dtype
    )  # (b, T, D), zeros after each prompt's tokens
    mask = pipe.tokenizer(
        texts, padding="max_length", max_length=max_tokens, truncation=True, return_tensors="pt"
    ).attention_mask
    return {"hidden": hidden, "mask": mask}


class WanPipelineFamily(PipelineFamily):
    name, model_class, lora_mixin = "wan", "WanTransformer3DModel", "WanLoraLoaderMixin"
    pipeline_class = "WanPipeline"
    text_dim_field = "text_dim"
    video = True
    tokenizers = ("tokenizer",)
    text_passes = (("text_encoder", _umt5_pass),)
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    """Every linear layer of the attention blocks (what Wan LoRA trainers such as musubi-tuner
    target), in diffusers' names."""
    comfy_prefix = "diffusion_model"
    comfy_renames = (
        ("attn1.to_out.0", "self_attn.o"),
        ("attn2.to_out.0", "cross_attn.o"),
        ("attn1.to_", "self_attn."),
        ("attn2.to_", "cross_attn."),
        ("ffn.net.0.proj", "ffn.0"),
        ("ffn.net.2", "ffn.2"),
    )
    """diffusers -> Wan's original module names (ComfyUI's; diffusers' converter maps back)."""

    def boundary(self) -> float | None:
        return read_json(self.root / "model_index.json", "model_index.json").get("boundary_ratio")

    def expert_component(self, info, expert):
        index = read_json(Path(info.path) / "model_index.json", "model_index.json")
        two = (index.get("transformer_2") or [None])[0] is not None
        if not two:
            return super().expert_component(info, expert)
        if expert not in EXPERTS or index.get("boundary_ratio") is None:
            raise PipelineFolderError(
                f"{Path(info.path) / 'model_index.json'}: two experts (transformer, transformer_2, "
                f"boundary_ratio {index.get('boundary_ratio')}); model.expert is {expert!r}, "
                "expected high_noise or low_noise"
            )
        return EXPERTS[expert]

    def sigma_range(self):
        b = self.boundary() if self.expert else None
        if b is None:
            return 0.0, 1.0
        return (float(b), 1.0) if self.expert == "high_noise" else (0.0, float(b))

    def check_components(self) -> None:
        tcfg = read_json(self.transformer_dir / "config.json", "the transformer's config")
        enc = read_json(self.root / "text_encoder" / "config.json", "the text encoder's config")
        vae = read_json(self.root / "vae" / "config.json", "the VAE's config")
        z = vae.get("z_dim")
        problems = []
        if tcfg.get("text_dim") != enc.get("d_model"):
            problems.append(
                f"text_dim is {tcfg.get('text_dim')} but text_encoder/config.json d_model is "
                f"{enc.get('d_model')}"
            )
        if tcfg.get("in_channels") != z:
            problems.append(f"in_channels is {tcfg.get('in_channels')}; expected vae z_dim ({z})")
        self.check_fit(problems)

    def temporal_ratio(self) -> int:
        """Pixel frames per latent frame after the first (the VAE's ``scale_factor_temporal``)."""
        config = read_json(self.root / "vae" / "config.json", "the VAE's config")
        return int(config.get("scale_factor_temporal", 4))

    def check_frames(self, frames):
        temporal = self.temporal_ratio()
        if frames is None or frames % temporal != 1:
            raise ValueError(
                f"data.frames is {frames}; the Wan VAE compresses {temporal} frames into one after "
                f"the first, so expected {temporal}k + 1 frames (1, {temporal + 1}, "
                f"{2 * temporal + 1}, ...)"
            )

    def encode_pixels(self, vae, pixels):
        cfg = vae.config
        z = vae.encode(pixels).latent_dist.mean  # (n, C, F', h, w)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z)
        std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z)
        return (z - mean) / std

    def check_latents(self, shape):
        if len(shape) != 4:
            raise ValueError(f"wan trains on clips: latents (C, F, h, w) expected, got {shape}")

    def predict(self, model, x_t, sigma, text):
        return model(
            hidden_states=x_t,  # (B, C, F, h, w)
            timestep=sigma * 1000,  # the pipeline passes the scheduler's t = sigma * 1000
            encoder_hidden_states=text.hidden,  # (B, T, D)
            return_dict=False,
        )[0]

    def sample(self, model, text, spec):
        """First frames (PIL) of clips from ``__call__``; an expert run samples with the other
        expert as the folder holds it."""
        vae = self.sample_vae(spec.device)
        parts = {"vae": vae, "text_encoder": None}
        if self.expert is None:
            parts["transformer"] = model
        else:
            other = "transformer_2" if self.expert == "high_noise" else "transformer"
            mine = EXPERTS[self.expert]
            parts[mine] = model
            parts[other] = load_component(self.root, other, spec.dtype).to(spec.device)
        pipe = self.pipeline(**parts)
        pipe.register_to_config(boundary_ratio=self.boundary())
        pipe.set_progress_bar_config(disable=True)
        c, f, h, w = spec.latent_shape
        frames = pipe(
            prompt_embeds=text.hidden,
            height=h * pipe.vae_scale_factor_spatial,
            width=w * pipe.vae_scale_factor_spatial,
            num_frames=(f - 1) * pipe.vae_scale_factor_temporal + 1,
            num_inference_steps=spec.steps,
            guidance_scale=1.0,  # no negative prompt cached: plain conditional sampling
            generator=torch.Generator().manual_seed(spec.seed),
            output_type="pil",
        ).frames
        return [clip[0] for clip in frames]
