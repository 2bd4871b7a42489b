"""Seed bugs 3, 5 and 6, saved weight views, and close()."""

import gc
import weakref

import pytest
import torch

from stagehand.common import DeviceMemory, ListSink, SavedTensorRouter, Telemetry
from stagehand.weights import WeightRuntime
from stagehand.weights.hooks import WeightView
from workbench.worker.assets import example_inputs, output_tensor

from ._train import config, make_model, train


def test_close_frees_pool_and_blocks_before_next_stage(tiny_flux):
    """Seed bug 3: the pool is released before the next stage loads."""
    model = make_model("flux", tiny_flux)
    memory = DeviceMemory("cpu")
    runtime = WeightRuntime(model, config(), device="cpu", memory=memory, checkpoint_dir=tiny_flux)
    train(model, runtime, steps=2)
    assert runtime.pool.allocated_bytes > 0 and memory.tracked_bytes("weights") > 0
    slabs = [weakref.ref(slab.buffer) for slab in runtime.pool.slabs]
    runtime.close(restore=False)
    gc.collect()
    assert runtime.pool.allocated_bytes == 0 and all(ref() is None for ref in slabs)
    assert memory.tracked_bytes("weights") == 0
    assert all(b.state.name == "UNLOADED" and b.flat is None for b in runtime.blocks)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-gc", "gc"])
def test_gradient_checkpointing_really_recomputes(tiny_video, checkpointing):
    """Seed bug 5: with checkpointing on, every block's forward runs twice per step."""
    model = make_model("ltx", tiny_video, "lora", checkpointing)
    assert model.is_gradient_checkpointing == checkpointing
    sink = ListSink()
    runtime = WeightRuntime(model, config(), device="cpu", telemetry=Telemetry(sink))
    calls = {b.index: 0 for b in runtime.blocks}
    for block in runtime.blocks:
        block.module.register_forward_pre_hook(
            lambda m, a, i=block.index: calls.__setitem__(i, calls[i] + 1)
        )
    train(model, runtime, steps=2)
    expected = 2 if checkpointing else 1
    assert calls == {b.index: 2 * expected for b in runtime.blocks}
    recomputes = [r for r in sink.of("stagehand", "block") if r.get("direction") == "recompute"]
    assert len(recomputes) == (2 * len(runtime.blocks) if checkpointing else 0)


def test_optimizer_step_runs_with_trainable_params_on_device(tiny_flux):
    """Seed bug 6: trainable block params, grads and optimizer state are on the compute device
    for optimizer.step() and back on their host masters after."""
    model = make_model("flux", tiny_flux, "full")
    memory = DeviceMemory("cpu")
    runtime = WeightRuntime(
        model,
        config(vram_low_watermark_mb=0),
        device="cpu",
        memory=memory,
        checkpoint_dir=tiny_flux,
    )
    slots = [s for b in runtime.blocks for s in b.layout if s.trainable]
    assert slots and all(s.key is None and s.host is not None for s in slots)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with runtime.managed_forward():
        loss = output_tensor(model(**example_inputs(model))).pow(2).mean()
    with runtime.managed_backward():
        loss.backward()
    assert all(s.param.data_ptr() == s.host.data_ptr() for s in slots)  # evicted to host masters
    before = {id(s): s.host.clone() for s in slots}
    tracked = memory.tracked_bytes("weights")
    with runtime.optimizer_context(opt):
        assert memory.tracked_bytes("weights") == tracked + sum(s.nbytes for s in slots)
        for s in slots:
            assert s.param.device == runtime.device and s.param.shape == s.shape
            assert s.param.data_ptr() != s.host.data_ptr() and s.param.grad.device == runtime.device
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert memory.tracked_bytes("weights") == tracked
    for s in slots:
        assert s.param.data_ptr() == s.host.data_ptr()
        assert not torch.equal(s.host, before[id(s)])  # the update landed in the host master
        assert all(v.device.type == "cpu" for v in opt.state[s.param].values())


def test_saved_weight_views_do_not_pin_evicted_blocks(tiny_flux):
    """Autograd's saved ``weight.t()`` views are replaced by handles, so evicting a block after
    its forward really releases it; backward rebuilds the views from the reloaded block."""
    model = make_model("flux", tiny_flux)
    memory = DeviceMemory("cpu")
    runtime = WeightRuntime(
        model,
        config(prefetch_window_blocks=0, vram_low_watermark_mb=0),
        device="cpu",
        memory=memory,
        checkpoint_dir=tiny_flux,
    )
    claimed = []

    def counting(tensor):
        handle = runtime.packer(tensor)
        if handle is not None:
            claimed.append(handle)
        return handle

    flats = []
    with SavedTensorRouter([counting]).hooks():
        loss = output_tensor(model(**example_inputs(model))).pow(2).mean()
    assert len(claimed) >= 4 * len(runtime.blocks) and all(
        isinstance(h, WeightView) for h in claimed
    )
    assert all(b.state.name == "UNLOADED" for b in runtime.blocks)
    assert memory.tracked_bytes("weights") == runtime.resident_bytes  # every block buffer released
    flats = [weakref.ref(b.flat) for b in runtime.blocks if b.flat is not None]
    assert flats == []
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    unpacked = claimed[0].unpack()  # after backward the block is loaded again on demand
    assert unpacked.shape == claimed[0]._size
    runtime.close()


def test_close_restores_an_ordinary_model(tiny_flux):
    model = make_model("flux", tiny_flux)
    reference = make_model("flux", tiny_flux)
    runtime = WeightRuntime(model, config(), device="cpu", checkpoint_dir=tiny_flux)
    train(model, runtime, steps=1)
    train(reference, steps=1)
    runtime.close()
    inputs = example_inputs(model, seed=5)
    with torch.no_grad():
        assert torch.equal(output_tensor(model(**inputs)), output_tensor(reference(**inputs)))
    assert not model.transformer_blocks[0]._forward_pre_hooks


def test_runtimes_without_a_stream_write_the_seeds_jsonl_files(tiny_flux, tmp_path):
    """The default writes JSONL; the activation and Conductor seeds name their files.
    (The runtime tests run in their temp folder: tests/runtime/conftest.py.)"""
    import json
    from pathlib import Path

    from stagehand.activations import ActivationRuntime
    from stagehand.conductor import ConductorRuntime
    from stagehand.config.memory import ActivationStagehandConfig, ConductorConfig
    from stagehand.weights.runtime import TELEMETRY_FILE
    from workbench.bench.activations import lora_model, train_steps

    assert Path.cwd() == tmp_path

    def lines(name):
        return [json.loads(x) for x in (tmp_path / name).read_text().splitlines()]

    model = make_model("flux", tiny_flux)
    runtime = WeightRuntime(model, config(), device="cpu", checkpoint_dir=tiny_flux)
    train(model, runtime, steps=2)
    runtime.close()
    records = lines(TELEMETRY_FILE)
    assert {r["kind"] for r in records} >= {"block", "step"}
    assert [r["seq"] for r in records] == list(range(len(records)))

    spill_all = ActivationStagehandConfig(
        vram_high_watermark_mb=0,
        vram_low_watermark_mb=0,
        pinned_pool_classes_mb=(0.0625, 0.25, 1),
        slabs_per_class=(64, 16, 4),
    )
    acts = ActivationRuntime(spill_all, device="cpu")
    train_steps(lora_model("flux", tiny_flux), 2, acts)
    acts.close()
    steps = [r for r in lines("activation_telemetry.jsonl") if r["kind"] == "step"]
    assert len(steps) == 2 and all(r["activations_spilled"] > 0 for r in steps)

    for enabled in (False, True):
        conductor = ConductorRuntime(ConductorConfig(enabled=enabled))
        conductor.begin_step(0)
        conductor.enter_forward()
        conductor.end_step()
        conductor.shutdown()
    assert [r["step_id"] for r in lines("conductor_telemetry.jsonl")] == [0]  # enabled only


class _LateEvent:
    """A copy still running (as on a CUDA stream) until a host wait: query() is False before."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def wait(self, stream=None):  # a device-side wait: the host goes on at once
        pass

    def synchronize(self):
        self.done = True


def test_evicting_a_prefetch_in_flight_releases_its_slab_before_a_reload(tiny_flux):
    """Copies that outlive the call (CUDA): a prefetch evicted before its use, then loaded again,
    must give its slab back once its copy finished (it was kept, and the pool shrank by a slab
    each time). The eviction waits for the copy on the device, not the host."""
    model = make_model("flux", tiny_flux)
    runtime = WeightRuntime(model, config(), device="cpu", checkpoint_dir=tiny_flux)
    engine = runtime.transfer
    engine.stream.record = _LateEvent
    block = runtime.blocks[2]
    for _ in range(3):
        assert engine.load(block, speculative=True)
        assert runtime.pool.used_bytes > 0  # the copy holds its slab
        event = block.load_event
        engine.evict(block)
        assert runtime.pool.used_bytes > 0 and not event.done  # the host did not wait
        event.done = True  # the device finished the copy
        assert engine.retire()
    assert runtime.pool.used_bytes == 0 and not engine.inflight and engine.host_waits == 0
    engine.load(block, speculative=False)
    engine.ready(block)
    block.load_event.synchronize()
    engine.retire()
    assert runtime.pool.used_bytes == 0
    runtime.close()


@pytest.mark.parametrize("fraction", [0.1, 0.0], ids=["h2d-only", "lora-streamed"])
def test_lora_stays_resident_and_frozen_weights_only_move_to_the_device(tiny_flux, fraction):
    """NOTE [ H2D-only streaming ]: with the default fraction the LoRA adapters are no part of
    any block buffer and never move (same storage after every step), so a step copies only
    frozen bytes to the device and nothing back; at 0 they stream with their blocks."""
    model = make_model("flux", tiny_flux)
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    runtime = WeightRuntime(
        model,
        config(resident_trainable_max_fraction=fraction, vram_low_watermark_mb=0),
        device="cpu",
        checkpoint_dir=tiny_flux,
    )
    streamed = {s.qualname for b in runtime.blocks for s in b.layout}
    frozen = sum(s.nbytes for b in runtime.blocks for s in b.layout if not s.trainable)
    before = {n: p.data_ptr() for n, p in lora.items()}
    train(model, runtime, steps=2)
    if fraction:
        assert not streamed & set(lora)  # no LoRA tensor in a block buffer
        assert {n: p.data_ptr() for n, p in lora.items()} == before  # never moved
        assert runtime.step_metrics()["h2d_bytes"] <= 2 * frozen + 2 * max(
            b.nbytes for b in runtime.blocks
        )
    else:
        assert set(lora) <= streamed
        assert {n: p.data_ptr() for n, p in lora.items()} != before
    runtime.close()


def test_a_read_plan_fills_a_block_as_tensor_by_tensor_reads(tiny_flux):
    """One vectored read per run of tensors contiguous in the file fills the staging buffer with
    the same bytes as one read per tensor; a short read continues where it stopped."""
    from stagehand.weights.sources import SafetensorsCheckpoint, _after

    source = SafetensorsCheckpoint(tiny_flux)
    keys = [k for k in source.entries if k.startswith("transformer_blocks.0.")]
    offsets, offset = [], 0
    for key in keys:
        offsets.append(offset)
        offset += -(-source.entries[key].nbytes // 512) * 512 + 512  # gaps between tensors
    plan = source.plan(list(zip(keys, offsets, strict=True)))
    assert len(plan) < len(keys)  # runs, not one read per tensor
    batched = torch.zeros(offset, dtype=torch.uint8)
    source.read_plan(plan, batched)
    single = torch.zeros(offset, dtype=torch.uint8)
    for key, at in zip(keys, offsets, strict=True):
        source.read_into(key, single[at : at + source.entries[key].nbytes])
    assert torch.equal(batched, single) and batched.any()
    a, b = memoryview(bytearray(3)), memoryview(bytearray(4))
    assert [len(m) for m in _after([a, b], 0)] == [3, 4]
    assert [len(m) for m in _after([a, b], 5)] == [2]
    source.close()


def test_frozen_blocks_skip_saved_tensors_that_require_grad_without_missing_a_weight(tiny_flux):
    """With every block frozen (LoRA resident) the packer answers for a saved tensor that
    requires grad without looking up its storage (``SavedViews.frozen``): over two LoRA steps it
    claims exactly the saved tensors the storage lookup claims. (Under a non-reentrant
    checkpoint the checkpoint's own hooks save the weights, and none reach the packer.)"""
    model = make_model("flux", tiny_flux)
    runtime = WeightRuntime(model, config(), device="cpu", checkpoint_dir=tiny_flux)
    assert runtime.views.frozen  # LoRA adapters are kept out of the block buffers
    views = runtime.views
    claims = {"fast": 0, "lookup": 0, "differ": 0, "grad": 0}

    def both(tensor):
        fast = views.pack(tensor)
        views.frozen = False
        lookup = views.pack(tensor)
        views.frozen = True
        claims["fast"] += fast is not None
        claims["lookup"] += lookup is not None
        claims["differ"] += (fast is None) != (lookup is None)
        claims["grad"] += tensor.requires_grad
        return fast

    runtime.router.packers = [both]
    train(model, runtime, steps=2)
    runtime.close()
    assert claims["lookup"] > 0 and claims["grad"] > 0  # both kinds of saved tensor were seen
    assert claims["differ"] == 0 and claims["fast"] == claims["lookup"]
