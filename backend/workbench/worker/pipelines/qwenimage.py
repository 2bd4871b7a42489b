"""Qwen-Image: Qwen2.5-VL text encoder (last hidden state after the 34 system-template tokens,
with its attention mask), 2x2-packed latents of a Wan-style 3D VAE normalised by
``latents_mean`` / ``latents_std``, dynamic shift from ``calculate_shift``. The shapes are
``QwenImagePipeline``'s own code: ``_get_qwen_prompt_embeds`` (what ``encode_prompt`` calls),
``_pack_latents`` / ``_unpack_latents``, ``img_shapes`` as ``__call__`` builds them, and
``__call__`` for samples.

Latents: ``(mean(z) - latents_mean) / latents_std`` per channel, as
``QwenImageImg2ImgPipeline._encode_vae_image`` normalises (the mode, not a sample, so the cache
is deterministic); ``__call__`` decodes ``z * latents_std + latents_mean``. Images are clips of
one frame for the VAE: (n, 3, 1, H, W) in, (n, C, 1, h, w) out; latents are cached (C, h, w).
"""

from __future__ import annotations

import torch

from workbench.worker.pipelines.base import PatchedLatents, PipelineFamily
from workbench.worker.pipelines.folder import read_json


def _qwen_pass(pipe, texts, device, max_tokens):
    hidden, mask = pipe._get_qwen_prompt_embeds(
        prompt=texts, device=device, dtype=pipe.text_encoder.dtype
    )  # (b, T, D), (b, T): T the longest prompt after the template
    return {"hidden": hidden[:, :max_tokens], "mask": mask[:, :max_tokens]}


class QwenImagePipelineFamily(PatchedLatents, PipelineFamily):
    name, model_class, lora_mixin = (
        "qwenimage",
        "QwenImageTransformer2DModel",
        "QwenImageLoraLoaderMixin",
    )
    pipeline_class = "QwenImagePipeline"
    shift_module = "diffusers.pipelines.qwenimage.pipeline_qwenimage"
    tokenizers = ("tokenizer",)
    text_passes = (("text_encoder", _qwen_pass),)
    comfy_prefix = "diffusion_model"
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    """diffusers' ``train_dreambooth_lora_qwen_image.py`` targets."""
    guidance = 1.0

    def check_components(self) -> None:
        tcfg = read_json(self.transformer_dir / "config.json", "the transformer's config")
        enc = read_json(self.root / "text_encoder" / "config.json", "the text encoder's config")
        hidden = enc.get("text_config", enc).get("hidden_size")
        vae = read_json(self.root / "vae" / "config.json", "the VAE's config")
        z = vae.get("z_dim")
        problems = []
        if tcfg.get("joint_attention_dim") != hidden:
            problems.append(
                f"joint_attention_dim is {tcfg.get('joint_attention_dim')} but "
                f"text_encoder/config.json text_config.hidden_size is {hidden}"
            )
        if tcfg.get("in_channels") != 4 * (z or 0):
            problems.append(
                f"in_channels is {tcfg.get('in_channels')}; expected 4 x vae z_dim ({z})"
            )
        out_channels = tcfg.get("out_channels") or tcfg.get("in_channels")
        if out_channels != z:
            problems.append(f"out_channels is {out_channels}; expected vae z_dim ({z})")
        if len(vae.get("latents_mean") or []) != z or len(vae.get("latents_std") or []) != z:
            problems.append(f"vae latents_mean / latents_std must have z_dim ({z}) entries")
        self.check_fit(problems)

    def encode_pixels(self, vae, pixels):
        cfg = vae.config
        z = vae.encode(pixels[:, :, None]).latent_dist.mean  # (n, C, 1, h, w)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z)
        std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z)
        return ((z - mean) / std)[:, :, 0]  # (n, C, h, w)

    def predict(self, model, x_t, sigma, text):
        b, _, h, w = x_t.shape
        return self.predict_packed(
            model,
            x_t,
            sigma,
            encoder_hidden_states=text.hidden,  # (B, T, D)
            encoder_hidden_states_mask=text.mask,  # (B, T)
            img_shapes=[[(1, h // 2, w // 2)]] * b,
        )[:, :, 0]  # (B, C, h, w)

    def sample(self, model, text, spec):
        return self.call_pipeline(
            {"transformer": model},
            spec,
            prompt_embeds=text.hidden,
            prompt_embeds_mask=text.mask,
            guidance_scale=spec.guidance if model.config.guidance_embeds else None,
            true_cfg_scale=1.0,  # no negative prompt: plain conditional sampling
        )
