"""FLUX.1 (dev / schnell): CLIP pooled output + T5 sequence, 2x2-packed latents, guidance
embeddings on dev. Everything shape-related is ``FluxPipeline``'s own code:
``_get_clip_prompt_embeds`` / ``_get_t5_prompt_embeds`` (what ``encode_prompt`` calls, one
encoder at a time here), ``_pack_latents`` / ``_unpack_latents`` / ``_prepare_latent_image_ids``,
``calculate_shift`` for the dynamic shift, and ``__call__`` for samples.

Latents are ``(vae.encode(x).mean - shift_factor) * scaling_factor`` (the pipeline decodes
``z / scaling_factor + shift_factor``), the same as ``encode.encode_latents`` computes.
"""

from __future__ import annotations

import torch

from workbench.worker.pipelines.base import PatchedLatents, PipelineFamily
from workbench.worker.pipelines.flux_comfy import kohya_flux_state_dict
from workbench.worker.pipelines.folder import read_json


def _clip_pass(pipe, texts, device, max_tokens):
    return {"pooled": pipe._get_clip_prompt_embeds(prompt=texts, device=device)}  # (b, Dp)


def _t5_pass(pipe, texts, device, max_tokens):
    hidden = pipe._get_t5_prompt_embeds(  # it defaults dtype to the absent CLIP's
        prompt=texts, max_sequence_length=max_tokens, device=device, dtype=pipe.text_encoder_2.dtype
    )  # (b, T, D)
    mask = pipe.tokenizer_2(
        texts, padding="max_length", max_length=max_tokens, truncation=True, return_tensors="pt"
    ).attention_mask
    return {"hidden": hidden, "mask": mask}


class FluxPipelineFamily(PatchedLatents, PipelineFamily):
    name, model_class, lora_mixin = "flux", "FluxTransformer2DModel", "FluxLoraLoaderMixin"
    pipeline_class = "FluxPipeline"
    shift_module = "diffusers.pipelines.flux.pipeline_flux"
    tokenizers = ("tokenizer", "tokenizer_2")
    text_passes = (("text_encoder", _clip_pass), ("text_encoder_2", _t5_pass))
    guidance = 1.0
    """Guidance fed to a guidance-distilled transformer while training (Flux-dev LoRA practice)."""
    lora_targets = (
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )
    """diffusers' ``train_dreambooth_lora_flux.py`` targets. The ComfyUI-layout copy is kohya's
    FLUX.1 layout (``flux_comfy.py``), written for a FLUX.1-wide transformer only: diffusers'
    converter has FLUX.1's 3072 built in and could not read it for any other width."""

    def comfy_state_dict(self, state):
        cfg = read_json(self.transformer_dir / "config.json", "the transformer's config")
        width = cfg.get("num_attention_heads", 0) * cfg.get("attention_head_dim", 0)
        return kohya_flux_state_dict(state, width, self.lora_prefix)

    def check_components(self) -> None:
        """The transformer's text and latent inputs must be what the encoders and VAE give."""
        root = self.root
        tcfg = read_json(self.transformer_dir / "config.json", "the transformer's config")
        checks = [
            ("joint_attention_dim", "text_encoder_2", "d_model"),
            ("pooled_projection_dim", "text_encoder", "hidden_size"),
        ]
        problems = []
        for field, comp, key in checks:
            got = read_json(root / comp / "config.json", f"the {comp}'s config").get(key)
            if tcfg.get(field) != got:
                problems.append(
                    f"{field} is {tcfg.get(field)} but {comp}/config.json {key} is {got}"
                )
        latent = read_json(root / "vae" / "config.json", "the VAE's config").get("latent_channels")
        if tcfg.get("in_channels") != 4 * (latent or 0):
            problems.append(
                f"in_channels is {tcfg.get('in_channels')}; expected 4 x vae latent_channels "
                f"({latent}) for 2x2-packed latents"
            )
        self.check_fit(problems)

    def predict(self, model, x_t, sigma, text):
        b, _, h, w = x_t.shape
        return self.predict_packed(
            model,
            x_t,
            sigma,
            encoder_hidden_states=text.hidden,  # (B, T, D) T5
            pooled_projections=text.pooled,  # (B, Dp) CLIP
            img_ids=self.pipeline_cls()._prepare_latent_image_ids(
                b, h // 2, w // 2, x_t.device, x_t.dtype
            ),
            txt_ids=torch.zeros(text.hidden.shape[1], 3, device=x_t.device, dtype=x_t.dtype),
        )  # (B, C, h, w)

    def sample(self, model, text, spec):
        return self.call_pipeline(
            {"transformer": model},
            spec,
            prompt_embeds=text.hidden,
            pooled_prompt_embeds=text.pooled,
            guidance_scale=spec.guidance,
        )
