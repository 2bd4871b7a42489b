"""Samples of a bf16 run: the transformer's latents reach the fp32 VAE of every family.

FluxPipeline, Flux2Pipeline and StableDiffusion3Pipeline hand the denoiser's latents to
``vae.decode`` in the transformer's dtype (Qwen-Image, Z-Image, Wan and LTX-2 cast them to the
VAE's); the trainer keeps the VAE in fp32, so a ``train_dtype: bfloat16`` run (every 24 GB
family preset) failed at its first samples with "Input type (c10::BFloat16) and bias type
(float) should be the same".
"""

from __future__ import annotations

import pytest
import torch

from workbench.worker.families import SampleSpec, Text
from workbench.worker.pipelines import adapter_for, inspect_pipeline
from workbench.worker.pipelines.base import load_component


@pytest.mark.parametrize("fixture", ["flux_pipeline_dir", "sd3_pipeline_dir"])
def test_bf16_transformer_samples_through_the_fp32_vae(fixture, request, tmp_path):
    root = request.getfixturevalue(fixture)
    info = inspect_pipeline(root)
    family = adapter_for(info, tmp_path, torch.bfloat16)
    model = load_component(root, "transformer", torch.bfloat16).eval()
    cfg = model.config
    width = cfg.joint_attention_dim
    pooled = cfg.pooled_projection_dim
    g = torch.Generator().manual_seed(0)
    text = Text(
        hidden=torch.randn(1, 8, width, generator=g).to(torch.bfloat16),
        mask=torch.ones(1, 8),
        pooled=torch.randn(1, pooled, generator=g).to(torch.bfloat16),
    )
    vae_channels = load_component(root, "vae", torch.float32).config.latent_channels
    spec = SampleSpec(
        (vae_channels, 4, 4),
        steps=1,
        seed=0,
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
        guidance=1.0,
    )
    images = family.sample(model, text, spec)
    assert len(images) == 1
    scale = 2 ** (len(load_component(root, "vae", torch.float32).config.block_out_channels) - 1)
    assert images[0].size == (4 * scale, 4 * scale)
