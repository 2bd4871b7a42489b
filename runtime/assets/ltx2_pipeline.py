"""A tiny random-weight ``LTX2Pipeline`` (LTX-2) from small configs of the real classes.

Components, as ``Lightricks/LTX-2``'s diffusers folder holds them: Gemma 3
(``Gemma3ForConditionalGeneration``, its vision tower one block) with a ``GemmaTokenizer`` built
offline, ``LTX2TextConnectors`` (the video and audio text connectors, with learnable registers),
``LTX2VideoTransformer3DModel``, the video VAE ``AutoencoderKLLTX2Video`` (8x spatial, 2x
temporal here; 32x / 8x in LTX-2), the audio VAE ``AutoencoderKLLTX2Audio`` and its
``LTX2Vocoder``, and ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting.

Sizes are ones the defaults would not give: 3 Gemma 3 layers (so the connectors' input is
4 x 20 wide), connectors 20 wide with 8 registers, 3 transformer blocks, latent channels 4 with
non-zero ``latents_mean`` / ``latents_std``, audio latents 2 channels x 2 mel bins.

Pitfalls (transformers 5, diffusers 0.42): ``GemmaTokenizer`` adds ``<bos>`` only with
``add_bos_token=True``; the audio VAE's ``base_channels`` must be latent channels x mel bins / 4
and its sizes divisible by 32 (``resolution``); diffusers models load in fp32 while the Gemma
encoder keeps its stored dtype, so loaders pass ``dtype=``.
"""

from __future__ import annotations

import torch

WORD_MARK = "\u2581"
"""Gemma's normalizer turns spaces into this mark; every word is a token with it in front."""


def gemma_tokenizer(words: list[str]):
    """``GemmaTokenizer`` over ``words``: ``<pad> <eos> <bos> <unk> <mask>`` first (Gemma's
    ids 0-4), then characters, then each word with and without the word mark as one token."""
    from transformers import GemmaTokenizer

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    merges: list[tuple[str, str]] = []

    def add(token: str) -> None:
        vocab.setdefault(token, len(vocab))

    for c in sorted(set("".join(words)) | {WORD_MARK}):
        add(c)
    for word in words:
        pieces = list(word)
        while len(pieces) > 1:  # merge left to right: "digit" is one token
            pair = (pieces[0], pieces[1])
            if pair not in merges:
                merges.append(pair)
            add(pair[0] + pair[1])
            pieces = [pair[0] + pair[1], *pieces[2:]]
        if (WORD_MARK, word) not in merges:
            merges.append((WORD_MARK, word))
        add(WORD_MARK + word)
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, model_max_length=1024)


def ltx2_pipeline(words: list[str], seed: int = 0):
    """The tiny ``LTX2Pipeline`` (see the module doc)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tok = gemma_tokenizer(words)
    n = len(tok)  # the image special tokens come after the tokenizer's ids
    torch.manual_seed(seed)
    gemma = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config={
                "vocab_size": n + 3,
                "hidden_size": 20,
                "intermediate_size": 36,
                "num_hidden_layers": 3,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 10,
                "query_pre_attn_scalar": 10,
                "max_position_embeddings": 512,
                "sliding_window": 16,
            },
            vision_config={
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 28,
                "patch_size": 14,
            },
            mm_tokens_per_image=4,
            boi_token_index=n,
            eoi_token_index=n + 1,
            image_token_index=n + 2,
        )
    )
    connectors = LTX2TextConnectors(
        caption_channels=20,  # Gemma hidden size
        text_proj_in_factor=4,  # Gemma's 3 layers + its embeddings: the hidden states stacked
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=10,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=10,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
    )
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4,  # video latent channels (patch 1)
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,  # audio latent channels 2 x latent mel bins 2
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=3,
        qk_norm="rms_norm_across_heads",
        vae_scale_factors=(2, 8, 8),  # the VAE's (temporal, spatial, spatial)
        caption_channels=20,  # the connectors' width
        rope_double_precision=False,
        rope_type="split",
    )
    vae = AutoencoderKLLTX2Video(
        latent_channels=4,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatiotemporal",),
        upsample_type=("spatiotemporal",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        patch_size=4,  # 4 x 2 = 8x spatial, 2x temporal
        encoder_causal=True,
        decoder_causal=False,
    )
    vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.3, 0.05]))
    vae.latents_std.copy_(torch.tensor([1.5, 0.8, 2.0, 1.1]))
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,  # latent channels 2 x mel bins 8 / 4
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        mel_bins=8,
    )
    vocoder = LTX2Vocoder(
        in_channels=2 * 8,  # audio VAE output channels x mel bins
        hidden_channels=16,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=16000,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_image_seq_len=64,
        max_image_seq_len=1024,
        base_shift=0.95,
        max_shift=2.05,
    )
    return LTX2Pipeline(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=gemma,
        tokenizer=tok,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
