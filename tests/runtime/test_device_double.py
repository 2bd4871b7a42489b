"""Every strategy under a device that lags the host (``device_double.py``): the same numbers as the
plain model, and after every step the bookkeeping a GPU depends on holds:

- every slab that is held belongs to a copy still in flight (no slab leaked, none released early:
  a released slab refilled before its copy ran raises ``CopyRaceError``);
- every Conductor H2D grant outstanding belongs to a copy in flight (no grant leaked);
- once the device finished its work, every slab is free and no grant is outstanding;
- gradients are read after the backward phase (the contract of ``MemoryStrategy``).

Lag 0 is the synchronous CPU the other tests use; lags 1, 2 and 4 run here.
"""

from __future__ import annotations

from functools import partial

import pytest

from stagehand.common import DeviceMemory
from stagehand.strategy import build_strategy
from stagehand.weights import WeightRuntime
from stagehand.weights.pool import Slab

from .device_double import LAGS, Device, device_double
from .exact import assert_exact, build_toy, make_model, train
from .test_exactness import STRATEGIES, memory_section
from .weights._train import config
from .weights._train import train as train_runtime

MODELS = [("shared", "full"), ("dual", "lora"), ("flux", "lora"), ("flux", "full")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_flux):
    root = tmp_path_factory.mktemp("toys")
    return {
        "dual": build_toy("dual", root / "dual"),
        "shared": build_toy("shared", root / "shared"),
        "flux": tiny_flux,
    }


@pytest.fixture(scope="module")
def references(folders):
    cache = {}

    def get(arch, method):
        if (arch, method) not in cache:
            model = make_model(arch, folders[arch], method, "non-reentrant", ordinary=True)
            cache[arch, method] = train(model)
        return cache[arch, method]

    return get


def check_bookkeeping(strategy, clock: Device) -> None:
    weights, conductor = strategy.weights, strategy.conductor
    if weights is not None:
        pool, transfer = weights.pool, weights.transfer
        held = {id(s) for s in pool.slabs if s.holder is not None}
        owned = {id(e.staging) for e in transfer.inflight if isinstance(e.staging, Slab)}
        assert held == owned, "a slab is held without a copy in flight"
        if conductor is not None:
            granted = sum(e.grant is not None for e in transfer.inflight)
            assert conductor.transfer.inflight("h2d") == granted, "an H2D grant leaked"
    clock.drain()  # the device catches up between steps
    if weights is not None:
        transfer.retire()
        assert not transfer.inflight
        assert all(s.holder is None for s in pool.slabs), "a slab is never released"
    if conductor is not None:
        assert conductor.transfer.inflight("h2d") == conductor.transfer.inflight("d2h") == 0


@pytest.mark.parametrize("lag", [lag for lag in LAGS if lag])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("arch", "method"), MODELS, ids=[f"{a}-{m}" for a, m in MODELS])
def test_exact_and_clean_under_a_device_double(folders, references, arch, method, strategy, lag):
    with device_double(lag) as clock:
        model = make_model(arch, folders[arch], method, "non-reentrant")
        memory = memory_section(strategy, True)
        if strategy in ("stream-module", "stream-file"):  # the Conductor's grants too
            memory["stagehand"]["conductor_config"] = {"enabled": True}
            memory["stagehand"]["prefetch_window_blocks"] = 2
        built = build_strategy(model, memory, device="cpu", checkpoint_dir=folders[arch])
        got = train(model, built, after_step=partial(check_bookkeeping, clock=clock))
        assert clock.max_pending >= 1  # copies really were pending behind the host
    assert_exact(references(arch, method), got)
    if built.weights is not None:
        assert not built.weights.pool.slabs  # closed: every slab freed


def test_an_evicted_block_counts_until_its_copy_back_lands(folders):
    """A trainable block's buffer is released at eviction, but its D2H copy
    back to the host masters still reads it: the watermarks' figure (``usage_bytes``) keeps
    counting it until the copy's event completes. And an eviction with nothing
    to copy back (a forward, no gradient yet, weights unchanged) records no D2H event and holds
    nothing (before: an empty event per block, its buffer counted until the event ran, and the
    block's next load waited on it). Step 1's first block, prefetched at step 0's end (its
    weights exposed to the user's code), copies its weights back."""
    with device_double(4) as clock:
        model = make_model("flux", folders["flux"], "full", None)
        memory = DeviceMemory("cpu")
        runtime = WeightRuntime(
            model,
            config(prefetch_window_blocks=1, vram_high_watermark_mb=1000, vram_low_watermark_mb=0),
            device="cpu",
            memory=memory,
        )
        seen: dict[tuple[int, int], tuple[int, int]] = {}

        def after_eviction(block, *_):
            pending = memory.usage_bytes() - memory.tracked_bytes()
            seen.setdefault((runtime.step, block.index), (pending, len(transfer.back.events)))

        transfer = runtime.transfer
        for block in runtime.blocks:  # after the runtime's hook evicted the block
            block.module.register_forward_hook(partial(after_eviction, block))
        train_runtime(model, runtime, steps=2)
        blocks = runtime.blocks
        assert [seen[0, b.index] for b in blocks] == [(0, 0)] * len(blocks)
        first = min(b.index for b in blocks if seen[1, b.index][0])  # the prefetched one
        assert seen[1, first][0] >= blocks[first].nbytes and seen[1, first][1] == 1
        assert all(seen[1, b.index][0] == 0 for b in blocks if b.index != first)
        clock.drain()
        assert memory.pending_bytes() == 0 and memory.usage_bytes() == memory.tracked_bytes()
        runtime.close()
