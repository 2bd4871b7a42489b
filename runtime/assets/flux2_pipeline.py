"""A tiny random-weight ``Flux2KleinPipeline`` (FLUX.2 [klein]) from small configs of the real
classes: ``Qwen3ForCausalLM`` (the pipeline stacks its hidden states 9, 18 and 27, so it has 28
layers, each tiny) with the Qwen tokenizer of ``pipelines.py`` and Qwen3's chat template,
``Flux2Transformer2DModel`` (3 double-stream + 5 single-stream blocks), ``AutoencoderKLFlux2``
with 4 latent channels, a 4x downscale and non-trivial batch-norm statistics (the latents the
transformer sees are 2x2-patchified and normalised by them), and
``FlowMatchEulerDiscreteScheduler`` with dynamic shifting, as FLUX.2 ships it.

FLUX.2 [dev] (``Flux2Pipeline``) uses a Mistral 3 text encoder with a Pixtral processor; it has
no fixture (and no adapter) here.
"""

from __future__ import annotations

import torch

from .tiny_tokenizers import QWEN3_CHAT_TEMPLATE, SEED, qwen_tokenizer

TEXT_LAYERS = 28
"""Qwen3 layers: ``Flux2KleinPipeline.encode_prompt`` reads hidden states 9, 18 and 27."""


def flux2_klein_pipeline(seed: int = SEED):
    """The tiny ``Flux2KleinPipeline`` (see the module doc): Qwen3 hidden 12 (the transformer's
    ``joint_attention_dim`` is 3 x 12), transformer 2 heads x 8, rope axes (2, 2, 2, 2)."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = qwen_tokenizer()
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    torch.manual_seed(seed)
    encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tok),
            hidden_size=12,
            intermediate_size=20,
            num_hidden_layers=TEXT_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=6,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        )
    )
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels x 2x2 patches
        num_layers=3,
        num_single_layers=5,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=36,  # 3 stacked Qwen3 hidden states x 12
        timestep_guidance_channels=16,
        axes_dims_rope=(2, 2, 2, 2),
        guidance_embeds=False,  # klein is not guidance-distilled
    )
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
    )
    g = torch.Generator().manual_seed(seed)
    vae.bn.running_mean.copy_(torch.randn(16, generator=g) * 0.2)
    vae.bn.running_var.copy_(torch.rand(16, generator=g) + 0.5)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        base_shift=0.5,
        max_shift=1.15,
    )
    return Flux2KleinPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=encoder,
        tokenizer=tok,
        transformer=transformer,
        is_distilled=True,
    )
