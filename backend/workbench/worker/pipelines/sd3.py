"""SD 3 / 3.5: CLIP-L and CLIP-G (penultimate hidden states and projected pooled outputs) + T5,
``SD3Transformer2DModel`` on unpacked (B, C, h, w) latents (it patches them itself), flow
matching with the scheduler's static shift (or, with ``use_dynamic_shifting``, the pipeline's
``calculate_shift`` of (h/p) x (w/p) tokens). The text is ``StableDiffusion3Pipeline``'s own
code: ``_get_clip_prompt_embeds`` (``clip_model_index`` 0 and 1) and ``_get_t5_prompt_embeds``,
one encoder at a time here; ``join_text`` then does what ``encode_prompt`` does with them::

    hidden = cat([pad(cat([clip_l, clip_g], -1), to T5 width), t5], tokens)   (U, 77 + T, D)
    pooled = cat([pooled_l, pooled_g], -1)                                      (U, Dl + Dg)

The transformer takes no text mask (the pipeline attends to every padded token): the cached
mask is all ones. Latents are ``(z - shift_factor) * scaling_factor``; the transformer is given
``sigma * 1000`` as the pipeline gives it the scheduler's timestep, and predicts the velocity.
"""

from __future__ import annotations

import torch

from workbench.worker.pipelines.base import PipelineFamily
from workbench.worker.pipelines.folder import read_json


def _clip_pass(index: int):
    def clip_pass(pipe, texts, device, max_tokens):
        encoder = pipe.text_encoder_2 if index else pipe.text_encoder
        # _get_clip_prompt_embeds casts to text_encoder's dtype, absent while CLIP-G runs alone.
        first, pipe.text_encoder = pipe.text_encoder, encoder
        try:
            hidden, pooled = pipe._get_clip_prompt_embeds(
                prompt=texts, device=device, clip_model_index=index
            )  # (b, 77, Dc), (b, Dp)
        finally:
            pipe.text_encoder = first
        return {f"clip{index}_hidden": hidden, f"clip{index}_pooled": pooled}

    return clip_pass


def _t5_pass(pipe, texts, device, max_tokens):
    hidden = pipe._get_t5_prompt_embeds(
        prompt=texts, max_sequence_length=max_tokens, device=device, dtype=pipe.text_encoder_3.dtype
    )  # (b, T, D)
    return {"t5_hidden": hidden}


class SD3PipelineFamily(PipelineFamily):
    name, model_class, lora_mixin = "sd3", "SD3Transformer2DModel", "SD3LoraLoaderMixin"
    pipeline_class = "StableDiffusion3Pipeline"
    shift_module = "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3"
    shift_defaults = (256, 4096, 0.5, 1.16)  # the SD3 pipeline's own max_shift
    tokenizers = ("tokenizer", "tokenizer_2", "tokenizer_3")
    text_passes = (
        ("text_encoder", _clip_pass(0)),
        ("text_encoder_2", _clip_pass(1)),
        ("text_encoder_3", _t5_pass),
    )
    lora_targets = (
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    )
    """diffusers' ``train_dreambooth_lora_sd3.py`` targets. No ComfyUI-layout copy: ComfyUI's
    SD3 names fuse q/k/v (``joint_blocks.N.x_block.attn.qkv``) and ``SD3LoraLoaderMixin`` has
    no converter from them; ComfyUI reads this diffusers-layout file as it is."""

    def join_text(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``encode_prompt``'s combination of the three encoders' outputs (module doc)."""
        clip = torch.cat([parts["clip0_hidden"], parts["clip1_hidden"]], dim=-1)  # (U, 77, Dl+Dg)
        t5 = parts["t5_hidden"]  # (U, T, D)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        hidden = torch.cat([clip, t5], dim=-2)  # (U, 77 + T, D)
        return {
            "hidden": hidden,
            "mask": torch.ones(hidden.shape[:2], dtype=torch.int64),
            "pooled": torch.cat([parts["clip0_pooled"], parts["clip1_pooled"]], dim=-1),
        }

    def check_components(self) -> None:
        """The transformer's text and latent inputs must be what the encoders and VAE give.

        Raises:
            PipelineFolderError: naming ``transformer/config.json`` and each field that does
                not fit (``joint_attention_dim``, ``pooled_projection_dim``, ``in_channels``).
        """
        cfg = {
            n: read_json(self.root / n / "config.json", f"the {n}'s config")
            for n in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")
        }
        tcfg = read_json(self.transformer_dir / "config.json", "the transformer's config")
        problems = []
        d_model = cfg["text_encoder_3"].get("d_model")
        if tcfg.get("joint_attention_dim") != d_model:
            problems.append(
                f"joint_attention_dim is {tcfg.get('joint_attention_dim')} but "
                f"text_encoder_3/config.json d_model is {d_model}"
            )
        clip_width = sum(cfg[n].get("hidden_size", 0) for n in ("text_encoder", "text_encoder_2"))
        if d_model is not None and clip_width > d_model:
            problems.append(
                f"the CLIP hidden sizes add up to {clip_width}, wider than text_encoder_3 d_model "
                f"{d_model} (encode_prompt pads them to it)"
            )
        pooled = sum(cfg[n].get("projection_dim", 0) for n in ("text_encoder", "text_encoder_2"))
        if tcfg.get("pooled_projection_dim") != pooled:
            problems.append(
                f"pooled_projection_dim is {tcfg.get('pooled_projection_dim')}; expected "
                f"text_encoder + text_encoder_2 projection_dim ({pooled})"
            )
        latent = cfg["vae"].get("latent_channels")
        if tcfg.get("in_channels") != latent:
            problems.append(
                f"in_channels is {tcfg.get('in_channels')}; expected vae latent_channels ({latent})"
            )
        self.check_fit(problems)

    def check_latents(self, shape: tuple[int, ...]) -> None:
        """Raise ``ValueError`` when latent h or w is not a multiple of the patch size."""
        p = read_json(self.transformer_dir / "config.json", "the transformer's config").get(
            "patch_size", 2
        )
        if shape[-1] % p or shape[-2] % p:
            raise ValueError(
                f"sd3 patches latents {p}x{p}: latent h, w {tuple(shape[-2:])} must be multiples "
                f"of {p}"
            )

    def image_seq_len(self, latent_shape: tuple[int, ...]) -> int:
        """(h/p) x (w/p) tokens, as ``__call__`` counts them for ``mu``."""
        p = read_json(self.transformer_dir / "config.json", "the transformer's config").get(
            "patch_size", 2
        )
        return (latent_shape[-2] // p) * (latent_shape[-1] // p)

    def predict(self, model, x_t, sigma, text):
        return model(
            hidden_states=x_t,  # (B, C, h, w)
            timestep=sigma * 1000,  # the scheduler's timestep, sigma x num_train_timesteps
            encoder_hidden_states=text.hidden,  # (B, 77 + T, D)
            pooled_projections=text.pooled,  # (B, Dl + Dg)
            return_dict=False,
        )[0]  # (B, C, h, w) velocity

    def sample(self, model, text, spec):
        return self.sample_pooled({"transformer": model}, text, spec)
