"""Layer offload copies only page-locked host memory (100 pageable copies per step on
an H100 at FLUX.1-dev size, all of them activation-pool misses). On CPU nothing can be pinned,
so these check the decision: every host buffer a spill copies into is allocated as the pool's
are, page-locked whenever the pool is; ``test_gpu.py`` checks the count on CUDA."""

import torch

import stagehand.activations.pool as pool_module
from stagehand.activations.pool import CPUSpillBackend
from stagehand.strategy import build_strategy

from ._helpers import layer_offload, make_model, train


def recording_host_buffer(calls):
    def host_buffer(nbytes, pin, dtype=torch.uint8):
        buffer = torch.empty(nbytes // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)
        calls.append((buffer.data_ptr(), pin))  # pin_memory raises on CPU: record the request
        return buffer

    return host_buffer


def test_a_pool_miss_is_page_locked_like_the_pool(monkeypatch):
    calls = []
    monkeypatch.setattr(pool_module, "host_buffer", recording_host_buffer(calls))
    pool = CPUSpillBackend((1,), 1, pin=True)
    slab, pooled = pool.acquire(1000)
    miss, missed_pooled = pool.acquire(1000)  # the only slab is out
    assert (pooled, missed_pooled, pool.misses) == (True, False, 1)
    assert [pin for _, pin in calls] == [True, True]  # the class's chunk, then the miss
    assert calls[-1][0] == miss.data_ptr()
    pool.release(miss)
    pool.release(slab)


def test_layer_offload_spills_through_misses_with_no_pageable_copy(tiny_flux, monkeypatch):
    calls = []
    monkeypatch.setattr(pool_module, "host_buffer", recording_host_buffer(calls))
    model = make_model("flux", tiny_flux)
    small_pool = {"pinned_pool_classes_mb": [1], "slabs_per_class": [1]}
    memory = layer_offload(
        0.9, True, enable_async_offloading=True, stagehand={"activation_stagehand": small_pool}
    )
    strategy = build_strategy(model, memory, device="cpu")
    pool = strategy.activations.pool
    counters = []
    train(model, strategy, steps=2, on_backward=lambda step: counters.append(strategy.counters()))
    assert pool.misses > 0  # the misses went through the pool's allocator, with its pin flag
    assert len(calls) >= 1 + pool.misses and {pin for _, pin in calls} == {pool.pin}
    for c in counters:
        assert c["tensors_spilled"] > 0 and c["pageable_copies"] == 0, c
    strategy.close()
