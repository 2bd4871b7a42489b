"""CUDA-only: host tensors passed as keywords reach the device, and layer offload trains with
the allocator's peak falling as the fraction rises (skipped without CUDA)."""

import pytest
import torch

from runtime.layer_offload.checkpoint_layer import OffloadCheckpointLayer
from runtime.strategy import build_strategy

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


def test_cuda_layer_offload_trains_and_peak_falls(tiny_flux):
    reference = train(make_model("flux", tiny_flux).cuda(), latent_hw=(64, 64))
    peaks = []
    for fraction in (0.0, 0.5, 0.9):
        model = make_model("flux", tiny_flux)
        memory = layer_offload(fraction, True, enable_async_offloading=True)
        strategy = build_strategy(model, memory, device="cuda")
        losses, grads = train(model, strategy, latent_hw=(64, 64))
        assert losses == pytest.approx(reference[0], rel=1e-5)
        for name, grad in grads[-1].items():
            torch.testing.assert_close(grad, reference[1][-1][name], rtol=1e-4, atol=1e-6)
        assert strategy.manager.offloaded_on_device() == []
        peaks.append(strategy.memory.peak_bytes())
        strategy.close()
    assert peaks[0] > peaks[1] > peaks[2]
