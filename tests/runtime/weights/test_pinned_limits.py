"""Page-locked memory the weight runtime takes: the host cache's images leave
headroom under a pinned-memory cap, ``host_cache_mb: 0`` registers nothing, and a host that
cannot map the memory (``OSError``) is a refusal, not a crash. CUDA's registration is a
recording stand-in (``tests/runtime/common/test_page_lock.py``); the blocks are a tiny Flux's."""

from __future__ import annotations

import mmap

import pytest
import torch

from stagehand.common import host_ram as host_ram_module
from stagehand.config.memory import MB
from stagehand.weights import host_cache
from stagehand.weights.errors import PoolConfigError
from stagehand.weights.host_cache import HostCache, pinned_headroom, weights_mode
from stagehand.weights.pool import PinnedPool
from tests.runtime.common.test_page_lock import FakeCudart

from .test_host_cache import _run

GiB = 1024 * MB


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


@pytest.fixture
def blocks(tiny_flux):
    """Module-backed blocks, masters unregistered (``host_cache_mb: 0`` on CPU)."""
    _, built, _ = _run(tiny_flux, file_backed=False, host_cache_mb=0)
    yield built.weights.blocks
    built.close()


def test_host_cache_mb_0_registers_no_image(cudart, blocks):
    """Before, ``register`` page-locked module-backed frozen blocks whatever the budget (the
    runtime called it on every CUDA run): ``host_cache_mb: 0`` still locked them all."""
    masters = [s.host for s in blocks[0].layout]
    for cache in (HostCache(0, pin=True), HostCache.for_run(0, True, torch.device("cuda"), 0)):
        assert not any(cache.register(block) for block in blocks)
        assert cache.images == {} and cache.locked_bytes == 0
    assert cudart.registered == [] and [s.host for s in blocks[0].layout] == masters
    assert "no block image (host_cache_mb: 0)" in weights_mode(blocks, cache, 0, True)[1]
    auto = HostCache.for_run(None, True, torch.device("cuda"), 0)
    assert auto.registers  # on CUDA, auto (None) registers as before


def test_pinned_cap_is_half_of_ram_on_wsl2_only(tmp_path):
    osrelease = tmp_path / "proc/sys/kernel/osrelease"
    osrelease.parent.mkdir(parents=True)
    assert host_ram_module.pinned_cap(64 * GiB, tmp_path) is None  # unreadable: none known
    osrelease.write_text("5.15.153.1-microsoft-standard-WSL2\n")
    assert host_ram_module.pinned_cap(64 * GiB, tmp_path) == 32 * GiB
    osrelease.write_text("6.1.0-18-amd64\n")
    assert host_ram_module.pinned_cap(64 * GiB, tmp_path) is None


def test_images_leave_pinned_headroom_under_a_cap(monkeypatch, cudart, blocks):
    """Defect 2: on a WSL2 machine of 128 GiB with 120 free, the auto budget was 88 GiB (RAM
    less the margin) though only 64 GiB can be page-locked: the images took all of it and the
    activation pool's later pins failed mid-step. Now they stop at the cap less the pool's
    lock and a quarter of the cap (16 GiB), and the refusal says so."""
    monkeypatch.setattr(host_cache, "host_ram", lambda: (120 * GiB, 128 * GiB))
    monkeypatch.setattr(host_cache, "pinned_cap", lambda total: total // 2)
    assert pinned_headroom(64 * GiB) == 16 * GiB and pinned_headroom(8 * GiB) == 4 * GiB
    cache = HostCache.for_run(None, True, torch.device("cuda"), 2 * GiB)
    assert cache.budget == (64 - 16 - 2) * GiB == cache.pin_limit[0]
    assert (
        "cap 65536 MB (half of RAM)" in cache.pin_limit[1] and "16384 MB kept" in cache.pin_limit[1]
    )
    explicit = HostCache.for_run(100 * 1024, True, torch.device("cuda"), 2 * GiB)
    assert explicit.budget == 100 * GiB and explicit.pin_limit == cache.pin_limit  # locks capped
    monkeypatch.setattr(host_cache, "pinned_cap", lambda total: None)
    assert HostCache.for_run(None, True, torch.device("cuda"), 0).pin_limit is None  # Linux

    first = blocks[0].nbytes
    small = HostCache(64 * MB, pin=True, pin_limit=(first + blocks[1].nbytes - 1, "the rule"))
    assert small.register(blocks[0]) and small.locked_bytes == first
    assert not small.register(blocks[1])
    assert "stop at the rule" in small.refusal and len(cudart.registered) == 1
    small.close()


def test_a_host_that_cannot_map_memory_refuses_instead_of_crashing(monkeypatch, cudart, blocks):
    """Defect 4: ``mmap`` raising ``OSError`` (ENOMEM, strict overcommit) escaped the cache's
    ``reserve``/``register`` (so a load) and the pool's set-up; now the cache stops with the
    reason and the pool names its field, or falls back to pageable memory when allowed."""

    def enomem(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", enomem)
    cache = HostCache(64 * MB, pin=True)
    assert not cache.register(blocks[0])
    assert "Cannot allocate memory" in cache.refusal and cache.reserve(blocks[1]) is None
    with pytest.raises(PoolConfigError, match="pinned_pool_mb.*Cannot allocate memory"):
        PinnedPool(4 * MB, MB, pin=True, timeout_s=1)
    pool = PinnedPool(4 * MB, MB, pin=True, timeout_s=1, allow_pageable=True)
    assert not pool.pin and pool.locked_bytes == 0 and len(pool.slabs) == 4
    pool.close()
    assert cudart.registered == []


def test_an_unpinned_image_the_allocator_refuses_stops_the_cache(monkeypatch, blocks):
    """Without pinning (a CPU run with ``host_cache_mb`` set) PyTorch's allocator raising
    ``RuntimeError`` (out of memory) is the cache's refusal too, not an error out of a load."""

    def out_of_memory(nbytes, pin, dtype=torch.uint8):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(host_cache, "host_buffer", out_of_memory)
    monkeypatch.setattr(host_cache, "host_ram", lambda: (64 * GiB, 128 * GiB))  # RAM is there
    cache = HostCache(64 * MB, pin=False)
    assert cache.reserve(blocks[0]) is None and "can't allocate memory" in cache.refusal
