"""Tiny random-weight diffusers pipelines of the real families, in the Hub's folder layout.

Each pipeline is built from small configs of the real classes (``FluxPipeline``: CLIP + T5 +
``FluxTransformer2DModel`` + ``AutoencoderKL`` + ``FlowMatchEulerDiscreteScheduler``), with
tokenizers made offline by the ``tokenizers`` library and wrapped in the tokenizer class the
pipeline expects, then written with ``save_pretrained(max_shard_size=...)`` so the transformer
is sharded with an index, exactly as a downloaded pipeline folder is. Shapes are ones the
defaults would not give (odd layer counts, non-square images): the trainer must read every
size from the configs.

Pitfalls met on the way (transformers 5, diffusers 0.42): CLIP pools at the highest token id
when ``eos_token_id`` is 2, so ``<|endoftext|>`` is the last id; diffusers models load in fp32
while transformers encoders keep the stored dtype, so loaders pass ``dtype=``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .cache import AssetError, build_once, cache_root

SEED = 0
WORDS = (
    "a photo of the digit zero one two three four five six seven eight nine "
    "handwritten white on black small big"
).split()
"""The tiny tokenizers' words: enough for the digits captions and the sample prompts."""

PIPELINES = ("flux",)


def _bpe_vocab(words: list[str], start: list[str], end: list[str]) -> tuple[dict, list]:
    """A byte-level-free BPE vocabulary and merges in which every word of ``words`` is one
    token (``word</w>``), built by merging its characters left to right."""
    vocab: dict[str, int] = {t: i for i, t in enumerate(start)}
    merges: list[tuple[str, str]] = []

    def add(token: str) -> None:
        if token not in vocab:
            vocab[token] = len(vocab)

    for c in sorted(set("".join(words))):
        add(c)
        add(c + "</w>")
    for word in words:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            merged = pieces[0] + pieces[1]
            if (pieces[0], pieces[1]) not in merges:
                merges.append((pieces[0], pieces[1]))
            add(merged)
            pieces = [merged] + pieces[2:]
    for token in end:
        add(token)
    return vocab, merges


def clip_tokenizer(words: list[str] = WORDS):
    """``CLIPTokenizer`` whose ``<|endoftext|>`` is the highest id (CLIP pools there)."""
    from transformers import CLIPTokenizer

    vocab, merges = _bpe_vocab(words, ["<|startoftext|>"], ["<|endoftext|>"])
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def t5_tokenizer(words: list[str] = WORDS):
    """``T5TokenizerFast`` from a unigram vocabulary of ``(piece, score)`` pairs (no extra ids)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(f"\u2581{w}", -1.0) for w in words]
    pieces += [(c, -5.0) for c in sorted(set("".join(words)))]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def flux_pipeline(seed: int = SEED):
    """A ``FluxPipeline`` (dev-style: guidance embeddings) with odd sizes everywhere:
    CLIP 3 layers hidden 20, T5 3 layers d_model 24, transformer 3 double + 5 single blocks,
    VAE 4 latent channels and a 4x downscale (3 blocks)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(seed)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=20,
            intermediate_size=36,
            num_hidden_layers=3,
            num_attention_heads=2,
            max_position_embeddings=77,
            eos_token_id=tok.eos_token_id,
            bos_token_id=tok.bos_token_id,
            pad_token_id=tok.pad_token_id,
            projection_dim=20,
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(tok2),
            d_model=24,
            d_kv=6,
            d_ff=40,
            num_layers=3,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
        )
    )
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels x 2x2 packing
        num_layers=3,
        num_single_layers=5,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=24,  # T5 d_model
        pooled_projection_dim=20,  # CLIP hidden size
        guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=0.37,
        shift_factor=0.11,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_image_seq_len=16,
        max_image_seq_len=256,
        base_shift=0.5,
        max_shift=1.15,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=tok,
        text_encoder_2=t5,
        tokenizer_2=tok2,
        transformer=transformer,
    )


BUILDERS = {"flux": flux_pipeline}


def save_pipeline(pipe, folder: Path) -> None:
    """``save_pretrained`` with shards small enough that the transformer has several."""
    total = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    pipe.save_pretrained(folder, safe_serialization=True, max_shard_size=max(total // 3, 1))


def build_pipeline(family: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The tiny ``family`` pipeline folder under ``<cache>/pipelines/``, built once.

    Raises:
        AssetError: an unknown family (lists the known).
    """
    if family not in BUILDERS:
        raise AssetError(f"no tiny pipeline for family {family!r}; known: {list(BUILDERS)}")
    final = cache_root(cache_dir) / "pipelines" / f"{family}-tiny"
    spec = {"family": family, "seed": SEED, "version": 1}
    return build_once(final, spec, lambda tmp: save_pipeline(BUILDERS[family](), tmp))
