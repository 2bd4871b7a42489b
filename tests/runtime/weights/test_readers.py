"""Reader threads (``reader_threads``): blocks are read from their safetensors files and copied on
a small thread pool, off the thread that runs the model; training stays bit-identical, a
reader's error reaches the training loop, and the default is no pool on CPU."""

from __future__ import annotations

import threading

import pytest
import torch

from stagehand.strategy import build_strategy
from stagehand.weights.sources import SafetensorsCheckpoint
from tests.runtime import exact
from tests.runtime.test_exactness import memory_section


def _streamed(path, readers: int | None, checkpointing: str | None = "non-reentrant"):
    model = exact.make_model("flux", path, "lora", checkpointing)
    memory = memory_section("stream-file", checkpointing is not None)
    # Room to prefetch (high watermark), evicted after each use (low 0): every step loads.
    memory["stagehand"].update(vram_high_watermark_mb=1000, vram_low_watermark_mb=0)
    if readers is not None:  # every prefetched block to the readers, however small
        memory["stagehand"].update(reader_threads=readers, reader_min_block_mb=0)
    return model, build_strategy(model, memory, device="cpu", checkpoint_dir=path)


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant"], ids=["no-gc", "gc"])
def test_reader_threads_train_exactly_off_the_calling_thread(tiny_flux, monkeypatch, checkpointing):
    reference = exact.make_model("flux", tiny_flux, "lora", checkpointing, ordinary=True)
    expected = exact.train(reference, build_strategy(reference, {"strategy": "none"}, device="cpu"))
    threads: list[str] = []
    read_plan = SafetensorsCheckpoint.read_plan

    def spy(self, runs, dst, count=True):
        threads.append(threading.current_thread().name)
        return read_plan(self, runs, dst, count)

    monkeypatch.setattr(SafetensorsCheckpoint, "read_plan", spy)
    model, built = _streamed(tiny_flux, 2, checkpointing)
    assert built.weights.transfer.readers is not None
    got = exact.train(model, built)
    exact.assert_exact(expected, got)
    # Prefetched blocks are read on the readers, demand loads (the first block of a step, a
    # block evicted before its use) on the calling thread, which waits for them at once.
    counts = built.counters()
    names = {name.split("_")[0] for name in threads}
    assert names == {"stagehand-read", "MainThread"}, names
    on_readers = sum(name.startswith("stagehand-read") for name in threads)
    assert 0 < counts["prefetch_hits"] <= on_readers < len(threads)
    assert built.weights.transfer.readers is None  # shut down at close


def test_a_reader_error_reaches_the_training_loop(tiny_flux, monkeypatch):
    def broken(self, runs, dst, count=True):
        raise OSError("short read from transformer/diffusion_pytorch_model.safetensors")

    model, built = _streamed(tiny_flux, 2)
    read_plan = SafetensorsCheckpoint.read_plan

    def broken_on_readers(self, runs, dst, count=True):
        if threading.current_thread().name.startswith("stagehand-read"):
            broken(self, runs, dst)
        return read_plan(self, runs, dst, count)

    monkeypatch.setattr(SafetensorsCheckpoint, "read_plan", broken_on_readers)
    inputs = exact.inputs_for(model, 0)
    with pytest.raises(OSError, match="short read"), torch.no_grad():
        for step in range(3):  # the first step traces the order; prefetches follow it
            with built.step(step), built.forward():
                model(**inputs)
    weights = built.weights
    weights.transfer.drain()  # failed reads count as finished: their slabs come back
    assert not weights.transfer.inflight
    assert all(slab.holder is None for slab in weights.pool.slabs)
    built.close()
    assert weights.pool.closed


def test_no_reader_threads_on_cpu_by_default(tiny_flux):
    model, built = _streamed(tiny_flux, None)
    assert built.weights.transfer.readers is None
    with torch.no_grad(), built.step(0), built.forward():
        model(**exact.inputs_for(model, 0))
    built.close()


def test_one_block_is_read_by_several_readers(tiny_flux, monkeypatch):
    """One block in flight at a time (1 copy slot), its read cut into parts (``split_plan``):
    the parts go to several reader threads, training is exact, and each tensor read counts
    once however many parts it was cut into."""
    from stagehand.weights import transfer

    monkeypatch.setattr(transfer, "PART_MIN_BYTES", 4096)
    reference = exact.make_model("flux", tiny_flux, "lora", "non-reentrant", ordinary=True)
    expected = exact.train(reference, build_strategy(reference, {"strategy": "none"}, device="cpu"))
    calls: list[tuple[str, int]] = []
    read_plan = SafetensorsCheckpoint.read_plan

    def spy(self, runs, dst, count=True):
        calls.append((threading.current_thread().name, count))
        return read_plan(self, runs, dst, count)

    monkeypatch.setattr(SafetensorsCheckpoint, "read_plan", spy)
    model, built = _streamed(tiny_flux, 4)
    engine = built.weights.transfer
    engine.max_inflight = 1
    finished: list[int] = []
    finish = engine._finish

    def counted(block, *args):
        finished.append(block.index)
        return finish(block, *args)

    engine._finish = counted
    before = built.weights.source.reads  # set-up's reads (resident weights)
    got = exact.train(model, built)
    exact.assert_exact(expected, got)
    readers = {name for name, _ in calls if name.startswith("stagehand-read")}
    assert len(readers) >= 2, readers
    assert all(not count for name, count in calls if name in readers)  # parts count bytes only
    blocks = built.weights.blocks
    assert all(len(b.read_parts) == 4 for b in blocks)
    tensors = {b.index: sum(len(run[3]) for run in b.read_plan) for b in blocks}
    restored = sum(tensors.values())  # ``exact.train`` closes: every tensor read back once
    loads = sum(tensors[i] for i in finished)
    assert built.weights.source.reads - before == loads + restored and loads > 0
    built.close()
