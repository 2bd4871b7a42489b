"""Z-Image: Qwen3 text model (its second-to-last hidden state over the chat-templated prompt,
only the prompt's tokens), the Flux-style VAE (``(z - shift_factor) * scaling_factor``), a
single-stream transformer that takes per-sample lists and the reversed time ``1 - sigma``, and
predicts ``x0 - noise`` (``__call__`` negates it into the velocity). Everything shape-related is
``ZImagePipeline``'s own code: ``_encode_prompt``, ``calculate_shift``, ``__call__``.

The cache keeps each prompt's tokens zero-padded to the longest with a mask; ``predict`` gives
the transformer the unpadded list again, as ``_encode_prompt`` returns it.
"""

from __future__ import annotations

import torch

from workbench.worker.pipelines.base import PatchedLatents, PipelineFamily
from workbench.worker.pipelines.folder import read_json


def _qwen3_pass(pipe, texts, device, max_tokens):
    # _encode_prompt rewrites its list in place (the chat template): give it a copy.
    embeds = pipe._encode_prompt(prompt=list(texts), device=device, max_sequence_length=max_tokens)
    longest = max(e.shape[0] for e in embeds)
    hidden = torch.zeros(len(embeds), longest, embeds[0].shape[1], dtype=embeds[0].dtype)
    mask = torch.zeros(len(embeds), longest, dtype=torch.int64)
    for i, e in enumerate(embeds):  # e: (T_i, D), the prompt's own tokens
        hidden[i, : e.shape[0]] = e.cpu()
        mask[i, : e.shape[0]] = 1
    return {"hidden": hidden, "mask": mask}


class ZImagePipelineFamily(PatchedLatents, PipelineFamily):
    name, model_class, lora_mixin = "zimage", "ZImageTransformer2DModel", "ZImageLoraLoaderMixin"
    pipeline_class = "ZImagePipeline"
    shift_module = "diffusers.pipelines.z_image.pipeline_z_image"
    tokenizers = ("tokenizer",)
    text_passes = (("text_encoder", _qwen3_pass),)
    lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )
    """Attention and feed-forward of every block (what Z-Image LoRA trainers target)."""
    comfy_prefix = "diffusion_model"
    text_dim_field = "cap_feat_dim"

    def check_components(self) -> None:
        tcfg = read_json(self.transformer_dir / "config.json", "the transformer's config")
        enc = read_json(self.root / "text_encoder" / "config.json", "the text encoder's config")
        vae = read_json(self.root / "vae" / "config.json", "the VAE's config")
        problems = []
        if tcfg.get("cap_feat_dim") != enc.get("hidden_size"):
            problems.append(
                f"cap_feat_dim is {tcfg.get('cap_feat_dim')} but text_encoder/config.json "
                f"hidden_size is {enc.get('hidden_size')}"
            )
        if tcfg.get("in_channels") != vae.get("latent_channels"):
            problems.append(
                f"in_channels is {tcfg.get('in_channels')}; expected vae latent_channels "
                f"({vae.get('latent_channels')})"
            )
        self.check_fit(problems)

    def predict(self, model, x_t, sigma, text):
        b = x_t.shape[0]
        out = model(
            list(x_t.unsqueeze(2).unbind(0)),  # B x (C, 1, h, w)
            1 - sigma,  # __call__ passes (1000 - t) / 1000
            [text.hidden[i][text.mask[i].bool()] for i in range(b)],  # B x (T_i, D)
            return_dict=False,
        )[0]
        return -torch.stack(out).squeeze(2)  # (B, C, h, w); the model predicts x0 - noise

    def sample(self, model, text, spec):
        embeds = [text.hidden[i][text.mask[i].bool()] for i in range(text.hidden.shape[0])]
        return self.call_pipeline(
            {"transformer": model},
            spec,
            prompt_embeds=embeds,
            guidance_scale=0.0,  # no negative prompt cached: plain conditional (Turbo's setting)
        )
