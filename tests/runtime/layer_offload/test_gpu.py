"""CUDA-only: host tensors passed as keywords reach the device, and layer offload trains with
the allocator's peak falling as the fraction rises (skipped without CUDA)."""

import gc

import pytest
import torch

from stagehand.layer_offload.checkpoint_layer import OffloadCheckpointLayer
from stagehand.strategy import build_strategy

from ._helpers import layer_offload, make_model, train

pytestmark = pytest.mark.gpu


def test_host_keyword_tensors_are_moved_to_the_device():
    seen = {}

    class Probe(torch.nn.Module):
        def forward(self, x, *, context, pair):
            seen.update(x=x.device, context=context.device, pair=pair[0].device)
            return x + context.sum() + pair[0].sum()

    wrapper = OffloadCheckpointLayer(
        Probe(),
        0,
        device=torch.device("cuda"),
        before_layer=lambda i, r: None,
        after_layer=lambda i, r: None,
        non_blocking=True,
    )
    x = torch.ones(2, 3, device="cuda", requires_grad=True)
    out = wrapper(x, context=torch.ones(4).pin_memory(), pair=(torch.ones(2), None))
    out.sum().backward()
    assert {d.type for d in seen.values()} == {"cuda"}
    assert torch.equal(x.grad, torch.ones(2, 3, device="cuda"))
    assert wrapper.pageable_copies == 1  # pair[0]; the pinned context is not counted


def test_layer_offload_makes_no_pageable_copy_when_the_activation_pool_misses(tiny_flux):
    """Every checkpoint input spills; a pool of one 1 MB slab misses nearly all of them, and a
    miss's buffer is page-locked like the pool: no copy of the step is pageable."""
    model = make_model("flux", tiny_flux)
    small_pool = {"pinned_pool_classes_mb": [1], "slabs_per_class": [1]}
    memory = layer_offload(
        0.9,
        True,
        enable_async_offloading=True,
        stagehand={"activation_stagehand": small_pool},
    )
    strategy = build_strategy(model, memory, device="cuda")
    counters = []
    train(
        model,
        strategy,
        steps=2,
        latent_hw=(64, 64),
        on_backward=lambda step: counters.append(strategy.counters()),
    )
    assert strategy.activations.pool.misses > 0
    for c in counters:
        assert c["tensors_spilled"] > 0 and c["pageable_copies"] == 0, c
    strategy.close()


def test_cuda_layer_offload_trains_and_frees_the_offloaded_blocks(tiny_flux):
    """Layer offload trains on CUDA as the plain model does, and the device holds the offloaded
    blocks' bytes less once the strategy is built (allocator figures, 512-byte rounding)."""
    reference = train(make_model("flux", tiny_flux).cuda(), latent_hw=(64, 64))
    placed = {}
    for fraction in (0.0, 0.5, 0.9):
        gc.collect()  # the last fraction's model and strategy (reference cycles) off the device
        model = make_model("flux", tiny_flux)
        memory = layer_offload(fraction, True, enable_async_offloading=True)
        before = torch.cuda.memory_allocated()
        strategy = build_strategy(model, memory, device="cuda")
        offloaded = sum(b.nbytes for b in strategy.weights.blocks if not b.resident)
        placed[fraction] = (torch.cuda.memory_allocated() - before, offloaded)
        losses, grads = train(model, strategy, latent_hw=(64, 64))
        assert losses == pytest.approx(reference[0], rel=1e-5)
        for name, grad in grads[-1].items():
            torch.testing.assert_close(grad, reference[1][-1][name], rtol=1e-4, atol=1e-6)
        assert strategy.manager.offloaded_on_device() == []
        strategy.close()
        del model, strategy
    full = placed[0.0][0]
    for fraction in (0.5, 0.9):
        on_device, offloaded = placed[fraction]
        assert offloaded > 0 and on_device <= full - offloaded, placed
