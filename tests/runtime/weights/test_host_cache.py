"""The host cache (``host_cache.py``) and reads shared by the reader threads (``readers.py``):
a frozen block is read from its file once and copied from its image after; module-backed frozen
blocks load from one image of their masters; training stays bit-identical; blocks that do not
fit, trainable blocks and a failed page-lock fall back to streaming through the slabs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from stagehand.common import ListSink, Telemetry
from stagehand.config.memory import MB
from stagehand.strategy import build_strategy
from stagehand.weights import host_cache
from stagehand.weights.host_cache import HostCache, cache_budget, ram_margin
from stagehand.weights.readers import Readers
from stagehand.weights.sources import SafetensorsCheckpoint, split_plan
from tests.runtime import exact
from tests.runtime.test_exactness import memory_section


def _run(path, method="lora", file_backed=True, **stagehand):
    model = exact.make_model("flux", path, method, "non-reentrant")
    memory = memory_section("stream-file" if file_backed else "stream-module", True)
    memory["stagehand"].update(stagehand)
    sink = ListSink()
    built = build_strategy(
        model, memory, device="cpu", checkpoint_dir=path, telemetry=Telemetry(sink)
    )
    return model, built, sink


def _reference(path, method="lora"):
    model = exact.make_model("flux", path, method, "non-reentrant", ordinary=True)
    return exact.train(model, build_strategy(model, {"strategy": "none"}, device="cpu"))


def test_frozen_blocks_are_read_once_then_copied_from_the_cache(tiny_flux):
    expected = _reference(tiny_flux)
    model, built, sink = _run(tiny_flux, host_cache_mb=64)
    runtime = built.weights
    tensors = sum(len(s.layout) for s in runtime.blocks)
    got = exact.train(model, built)
    exact.assert_exact(expected, got)
    steps = sink.of("stagehand", "step")
    # Step 0 reads every block once (into its image); later steps read nothing.
    assert steps[0]["file_reads"] == tensors and steps[0]["host_cache_hits"] > 0
    for record in steps[1:]:
        assert record["file_reads"] == 0 and record["file_read_bytes"] == 0
        assert record["host_cache_hits"] == record["blocks_loaded"] > 0
        assert record["file_reads_avoided"] >= record["blocks_loaded"]
    last = steps[-1]
    nbytes = sum(b.nbytes for b in runtime.blocks)
    assert last["host_cache_mb"] == pytest.approx(nbytes / MB)
    assert last["weights_mode"] == "host-cache" and last["host_cache_refused_blocks"] == 0
    assert runtime.pool.allocated_bytes == 0  # no slab was ever needed
    # pinned_mb counts the images beside the pool; the Conductor's budget holds the pool only.
    assert built.pinned_bytes() == runtime.pool.pool_bytes + nbytes
    built.close()


def test_blocks_that_do_not_fit_stream_from_the_file(tiny_flux):
    expected = _reference(tiny_flux)
    model, built, sink = _run(tiny_flux, host_cache_mb=1)
    runtime = built.weights
    sizes = sorted(b.nbytes for b in runtime.blocks)
    assert sum(sizes) > MB > sizes[0]  # some fit, not all
    got = exact.train(model, built)
    exact.assert_exact(expected, got)
    last = sink.of("stagehand", "step")[-1]
    assert last["weights_mode"] == "host-cache-partial"
    assert 0 < last["host_cache_mb"] <= 1 and last["host_cache_refused_blocks"] > 0
    assert last["host_cache_hits"] > 0 and last["file_reads"] > 0  # both paths in one step
    built.close()


def test_module_backed_frozen_blocks_load_from_one_image_of_their_masters(tiny_flux):
    expected = _reference(tiny_flux)
    model, built, sink = _run(tiny_flux, file_backed=False, host_cache_mb=64)
    runtime = built.weights
    cache = runtime.cache
    for block in runtime.blocks:  # the masters moved into the image: views of it, not copies
        image = cache.images[block.index].buffer
        start, end = image.data_ptr(), image.data_ptr() + image.numel()
        assert all(start <= s.host.data_ptr() < end for s in block.layout)
    got = exact.train(model, built)
    exact.assert_exact(expected, got)
    for record in sink.of("stagehand", "step"):
        assert record["host_cache_hits"] == record["blocks_loaded"] > 0
        assert record["file_reads_avoided"] == 0 and record["host_cache_mb"] == 0
    assert record["weights_mode"] == "module-backed"
    assert record["host_cache_registered_mb"] > 0
    assert runtime.pool.allocated_bytes == 0  # no staging copy through a slab
    nbytes = sum(b.nbytes for b in runtime.blocks)
    assert built.pinned_bytes() == runtime.pool.pool_bytes + nbytes
    built.close()


def test_trainable_blocks_are_never_cached(tiny_flux):
    expected = _reference(tiny_flux, "full")
    model, built, sink = _run(tiny_flux, "full", host_cache_mb=64)
    got = exact.train(model, built)
    exact.assert_exact(expected, got)
    last = sink.of("stagehand", "step")[-1]
    assert last["host_cache_hits"] == 0 and last["host_cache_mb"] == 0
    assert last["weights_mode"] == "module-backed"  # full fine-tune: every weight trainable
    assert built.weights.cache.images == {}
    built.close()


def test_cache_budget_and_margin(monkeypatch):
    total, available = 128 * 1024 * MB, 120 * 1024 * MB
    monkeypatch.setattr(host_cache, "host_ram", lambda: (available, total))
    assert ram_margin(total) == 32 * 1024 * MB and ram_margin(16 * 1024 * MB) == 8 * 1024 * MB
    assert cache_budget(None, cuda=True) == available - 32 * 1024 * MB
    assert cache_budget(None, cuda=False) == 0  # a CPU device's memory is the host's
    assert cache_budget(0, cuda=True) == 0 and cache_budget(100, cuda=False) == 100 * MB


def test_a_block_refused_when_ram_would_fall_under_the_margin(tiny_flux, monkeypatch):
    model, built, sink = _run(tiny_flux, host_cache_mb=64)
    monkeypatch.setattr(host_cache, "host_ram", lambda: (16 * 1024 * MB, 64 * 1024 * MB))
    exact.train(model, built, steps=2)
    last = sink.of("stagehand", "step")[-1]
    assert last["host_cache_mb"] == 0 and last["host_cache_hits"] == 0
    assert last["host_cache_refused_blocks"] == len(built.weights.blocks)
    assert last["file_reads"] > 0  # streamed from the files instead
    built.close()


def test_a_failed_page_lock_stops_caching_and_keeps_the_masters(tiny_flux):
    """On a machine without CUDA, page-locking fails as it does under a pinned-memory cap."""
    model, built, _ = _run(tiny_flux, file_backed=False, host_cache_mb=0)
    block = built.weights.blocks[0]
    masters = [s.host for s in block.layout]
    cache = HostCache(64 * MB, pin=True)
    assert not cache.register(block)
    assert "page-locking" in cache.refusal
    assert [s.host for s in block.layout] == masters and cache.images == {}
    assert cache.reserve(block) is None  # stopped for the run
    built.close()


def test_split_plan_parts_read_what_the_whole_plan_reads(tmp_path):
    tensors = {f"t{i}": torch.randn(1000 + 37 * i) for i in range(6)}
    save_file(tensors, tmp_path / "model.safetensors")
    source = SafetensorsCheckpoint(tmp_path)
    offsets, pos = [], 0
    for key in tensors:
        offsets.append((key, pos))
        pos += -(-source.entries[key].nbytes // 512) * 512
    runs = source.plan(offsets)
    whole = torch.zeros(pos, dtype=torch.uint8)
    source.read_plan(runs, whole)
    assert source.reads == 6
    parts = split_plan(runs, 4, min_bytes=1000)
    assert len(parts) == 4
    sizes = [sum(end - start for _, start, end, _ in part) for part in parts]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == sum(end - start for _, start, end, _ in runs)
    for part in parts:  # every run's pieces fill exactly its file range
        for _, start, end, pieces in part:
            assert sum(n for _, n in pieces) == end - start
    got = torch.zeros_like(whole)
    readers = Readers(4)
    future = readers.stage(
        [lambda part=part: source.read_plan(part, got, count=False) for part in parts],
        lambda: "copied",
    )
    assert future.result() == "copied"
    readers.shutdown()
    assert torch.equal(got, whole)
    assert source.reads == 6  # parts count bytes only
    assert split_plan(runs, 4, min_bytes=10**9) == [runs]  # small: one part


def test_a_failed_part_fails_the_block_and_skips_its_copy():
    readers = Readers(2)
    finished = []

    def bad():
        raise OSError("short read")

    future = readers.stage([lambda: None, bad], lambda: finished.append(1))
    with pytest.raises(OSError, match="short read"):
        future.result()
    readers.shutdown()
    assert finished == []
