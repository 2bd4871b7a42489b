"""StagehandStrategy end to end on CPU: tiny Flux + peft LoRA, the three runtimes composed."""

import itertools

import pytest
import torch

from stagehand.common.telemetry import ListSink, Telemetry
from stagehand.config.memory import MemoryConfig
from stagehand.strategy import build_strategy
from stagehand.strategy.base import COUNTERS
from stagehand.strategy.composed import StagehandStrategy
from tests.runtime import exact
from workbench.worker.assets import example_inputs, output_tensor

# Sized to the tiny Flux (8 blocks of ~0.43 MB, ~0.4 MB resident): prefetch happens (high
# watermark 2 MB), activations spill (0.1 MB), the Conductor's caps are never the limit.
MEMORY = {
    "strategy": "stagehand",
    "stagehand": {
        "pinned_pool_mb": 8,
        "pinned_slab_mb": 1,
        "vram_high_watermark_mb": 2,
        "vram_low_watermark_mb": 1,
        "prefetch_window_blocks": 2,
        "activation_stagehand": {
            "vram_high_watermark_mb": 0.1,
            "vram_low_watermark_mb": 0.05,
            "pinned_pool_classes_mb": [1, 4],
            "slabs_per_class": [8, 2],
            "min_spill_bytes": 1024,
        },
        "conductor_config": {
            "enabled": True,
            "vram_soft_cap_mb": 16,
            "vram_hard_cap_mb": 20,
            "pinned_budget_mb": 64,
        },
    },
}


def lora_flux(path):
    """Tiny Flux + LoRA with non-zero ``lora_B``, weights in ordinary storage."""
    return exact.make_model("flux", path, "lora", ordinary=True)


def run(model, strategy, steps=3, limits=None):
    """``steps`` training steps; returns each step's LoRA gradients (read after BACKWARD)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    grads, phases = [], []
    for step in range(steps):
        if limits and step in limits:
            strategy.set_limits(limits[step], request_id=f"req-{step}")
        inputs = example_inputs(model, seed=step)
        with strategy.step(step):
            with strategy.forward():
                loss = output_tensor(model(**inputs)).pow(2).mean()
            with strategy.backward():
                loss.backward()
            # After the phase: gradients of evicted blocks may still be arriving inside it.
            grads.append(
                {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
            )
            with strategy.optimizer(optimizer):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        phases.append((dict(strategy.phase_ms), strategy.step_ms))
    return grads, phases


@pytest.fixture(scope="module")
def baseline(tiny_flux):
    model = lora_flux(tiny_flux)
    strategy = build_strategy(model, {"strategy": "none"}, device="cpu")
    grads, _ = run(model, strategy)
    return grads


def assert_same_grads(expected, got):
    assert len(expected) == len(got)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (step, name)
    assert all(g.abs().sum() > 0 for g in expected[-1].values())


@pytest.mark.parity
def test_three_runtimes_match_plain_gradients_and_share_one_stream(tiny_flux, baseline):
    memory = MemoryConfig.model_validate(MEMORY)
    memory.stagehand.conductor_config.debug_event_trace = True
    model, sink = lora_flux(tiny_flux), ListSink()
    strategy = build_strategy(
        model, memory, device="cpu", telemetry=Telemetry(sink), checkpoint_dir=tiny_flux
    )
    assert isinstance(strategy, StagehandStrategy)
    assert strategy.weights and strategy.activations and strategy.conductor
    grads, phases = run(model, strategy)
    strategy.close()
    assert_same_grads(baseline, grads)

    seqs = [r["seq"] for r in sink.records]
    assert seqs == sorted(set(seqs))  # strictly increasing
    sources = {r["source"] for r in sink.records}
    assert {"stagehand", "activation_stagehand", "conductor"} <= sources
    for source in ("stagehand", "activation_stagehand", "conductor"):
        assert [r["step"] for r in sink.of(source, "step")] == [0, 1, 2], source
    # every runtime really worked, the weight runtime's prefetch through Conductor slots
    weights = sink.of("stagehand", "step")
    assert sum(r["prefetch_hits"] for r in weights) > 0
    assert all(r["activations_spilled"] > 0 for r in sink.of("activation_stagehand", "step"))
    conductor = sink.of("conductor", "step")
    assert all(r["grant_count"] > 0 for r in conductor)
    # both runtimes took PCIe slots from the Conductor, and gave every one back
    slots = [r for r in sink.of("conductor", "event") if r["event"].startswith("slot_")]
    acquired = {(r["direction"], r["slot"]) for r in slots if r["event"] == "slot_acquire"}
    released = {(r["direction"], r["slot"]) for r in slots if r["event"] == "slot_release"}
    assert {d for d, _ in acquired} == {"h2d", "d2h"}
    assert acquired == released
    assert conductor[-1]["pinned_granted_mb"] == 8 + 8 * 1 + 2 * 4  # both pools reserved
    assert set(conductor[-1]["runtime_snapshots"]) == {"stagehand", "activation_stagehand"}

    for phase_ms, step_ms in phases:
        assert {"step_begin", "forward", "backward", "optimizer"} == set(phase_ms)
        # The phases lie inside the step (the loop's own work between them is the rest: a
        # ratio would depend on the machine's load).
        assert all(ms > 0 for ms in phase_ms.values()) and sum(phase_ms.values()) <= step_ms
    # the model is plain again after close: the same forward without any runtime
    inputs = example_inputs(model, seed=0)
    with torch.no_grad():
        assert torch.isfinite(output_tensor(model(**inputs))).all()


def test_live_watermark_change_applies_at_the_next_step_and_is_recorded(tiny_flux, baseline):
    model, sink = lora_flux(tiny_flux), ListSink()
    strategy = build_strategy(
        model, MEMORY, device="cpu", telemetry=Telemetry(sink), checkpoint_dir=tiny_flux
    )
    limits = {1: {"vram_high_watermark_mb": 3.0, "vram_low_watermark_mb": 1.5}}
    # an activation watermark far above usage: no more spills from step 2 on
    limits[2] = {"activation_vram_high_watermark_mb": 500, "activation_vram_low_watermark_mb": 400}
    grads, _ = run(model, strategy, limits=limits)
    strategy.close()
    assert_same_grads(baseline, grads)  # changing limits never changes the math

    applied = sink.of("strategy", "limits_applied")
    assert [(r["step"], r["phase"], r["request_id"]) for r in applied] == [
        (1, "step_begin", "req-1"),
        (2, "step_begin", "req-2"),
    ]
    # Each knob changes only itself: the weight watermarks leave the spill watermarks alone.
    assert applied[0]["changed"] == {
        "vram_high_watermark_mb": [2.0, 3.0],
        "vram_low_watermark_mb": [1.0, 1.5],
    }
    assert applied[1]["changed"] == {
        "activation_vram_high_watermark_mb": [0.1, 500],
        "activation_vram_low_watermark_mb": [0.05, 400],
    }
    weights = sink.of("stagehand", "step")
    assert [(r["vram_high_watermark_mb"], r["vram_low_watermark_mb"]) for r in weights] == [
        (2.0, 1.0),
        (3.0, 1.5),
        (3.0, 1.5),
    ]
    # the request is acknowledged before any record of the step it applies to
    first_of_step1 = min(r["seq"] for r in sink.records if r["step"] == 1)
    assert applied[0]["seq"] == first_of_step1
    spilled = [r["activations_spilled"] for r in sink.of("activation_stagehand", "step")]
    assert spilled[0] > 0 and spilled[1] > 0 and spilled[2] == 0


def test_live_knobs_survive_the_conductor_and_bad_limits_are_refused(tiny_flux):
    model = lora_flux(tiny_flux)
    strategy = build_strategy(model, MEMORY, device="cpu", checkpoint_dir=tiny_flux)
    strategy.set_limits({"prefetch_window_blocks": 3, "max_inflight_d2h": 2})
    with pytest.raises(ValueError, match=r"vram_low_watermark_mb \(5.0\) must not be above"):
        strategy.set_limits({"vram_low_watermark_mb": 5.0})  # current high is 2
    with pytest.raises(ValueError, match="vram_low_watermark_mb"):
        strategy.set_limits({"vram_high_watermark_mb": 1.0, "vram_low_watermark_mb": 2.0})
    run(model, strategy, steps=1)
    assert strategy.limits()["prefetch_window_blocks"] == 3
    assert strategy.limits()["max_inflight_d2h"] == 2
    weights, activations = strategy.weights, strategy.activations
    strategy.close()  # the Conductor capped them in force; the user's values were never written
    assert weights.scheduler.prefetch_window == 3
    assert activations.transfer.max_d2h == 2


@pytest.mark.sync_device  # no copy in flight right after the error
def test_an_error_mid_forward_leaves_the_strategy_usable(tiny_flux, baseline):
    model = lora_flux(tiny_flux)
    strategy = build_strategy(model, MEMORY, device="cpu", checkpoint_dir=tiny_flux)
    with pytest.raises(RuntimeError, match="data loader died"):
        with strategy.step(0), strategy.forward():
            output_tensor(model(**example_inputs(model, seed=0))).sum()
            raise RuntimeError("data loader died")
    assert strategy.conductor.transfer.inflight("h2d") == 0
    assert strategy.conductor.transfer.inflight("d2h") == 0
    assert strategy.conductor.phase.name == "STEP_END"
    grads, _ = run(model, strategy, steps=1)
    strategy.close()
    assert_same_grads(baseline[:1], grads)


# weights, activations, conductor: each on or off
COMBOS = [c for c in itertools.product([True, False], repeat=3) if c != (True, True, True)]


@pytest.mark.parity
@pytest.mark.parametrize(("weights", "activations", "conductor"), COMBOS)
def test_each_runtime_on_or_off(tiny_flux, baseline, weights, activations, conductor):
    memory = MemoryConfig.model_validate(MEMORY).stagehand
    memory.activation_stagehand.enabled = activations
    memory.conductor_config.enabled = conductor
    memory.weight_streaming = weights
    model, sink = lora_flux(tiny_flux), ListSink()
    strategy = StagehandStrategy(
        model,
        memory,
        device="cpu",
        telemetry=Telemetry(sink),
        checkpoint_dir=tiny_flux,
    )
    grads, _ = run(model, strategy, steps=2)
    strategy.close()
    assert_same_grads(baseline[:2], grads)
    sources = {r["source"] for r in sink.records if r["kind"] == "step"}
    expected = {
        name
        for name, on in (
            ("stagehand", weights),
            ("activation_stagehand", activations),
            ("conductor", conductor),
        )
        if on
    }
    assert sources == expected
    if not weights:
        with pytest.raises(ValueError, match="prefetch_window_blocks: no runtime"):
            strategy.set_limits({"prefetch_window_blocks": 1})


def test_inference_mode_streams_weights_without_activation_runtime(tiny_flux):
    plain = lora_flux(tiny_flux).eval()
    inputs = example_inputs(plain, seed=3)
    with torch.no_grad():
        expected = output_tensor(plain(**inputs))
    model, sink = lora_flux(tiny_flux).eval(), ListSink()
    strategy = build_strategy(
        model,
        MEMORY,
        device="cpu",
        telemetry=Telemetry(sink),
        checkpoint_dir=tiny_flux,
        mode="inference",
    )
    assert strategy.activations is None and strategy.weights is not None
    with torch.inference_mode(), strategy.step(0), strategy.forward():
        out = output_tensor(model(**inputs))
    strategy.close()
    assert torch.equal(out, expected)
    assert [r["step"] for r in sink.of("stagehand", "step")] == [0]
    assert sink.of("conductor", "step")[0]["phase_durations"].keys() == {"forward"}


def test_pinned_budget_too_small_for_the_pools_is_refused_at_build(tiny_flux):
    memory = MemoryConfig.model_validate(MEMORY)
    memory.stagehand.conductor_config.pinned_budget_mb = 10  # weight pool alone is 8 MB
    with pytest.raises(ValueError, match="pinned_budget_mb"):
        build_strategy(lora_flux(tiny_flux), memory, device="cpu", checkpoint_dir=tiny_flux)


def test_optimizer_phase_without_the_optimizer_is_refused_when_streaming(tiny_flux):
    """Trainable parameters of streamed blocks move to the device with their optimizer state:
    ``strategy.optimizer()`` without the optimizer says so, before the phase begins. The plain
    model and activation spill alone need none."""
    model = lora_flux(tiny_flux)
    memory = MemoryConfig.model_validate(MEMORY)
    memory.stagehand.resident_trainable_max_fraction = 0  # the LoRA streams with its blocks
    strategy = build_strategy(model, memory, device="cpu", checkpoint_dir=tiny_flux)
    with strategy.step(0):
        with pytest.raises(TypeError, match=r"strategy.optimizer\(optimizer\) needs the optimizer"):
            strategy.optimizer()
        assert strategy.phase.value == "step_begin"  # nothing was entered
    strategy.close()
    spill_only = {"stagehand": {"weight_streaming": False, "activation_stagehand": {}}}
    resident_lora = {"stagehand": {"file_backed": True}}  # H2D-only: nothing to move
    for memory in ({"strategy": "none"}, spill_only, resident_lora):
        strategy = build_strategy(lora_flux(tiny_flux), memory, device="cpu")
        with strategy.step(0):
            with strategy.forward():
                pass
            with strategy.backward():
                pass
            with strategy.optimizer():
                pass
        if memory is not resident_lora:
            assert strategy.counters() == dict.fromkeys(COUNTERS, 0)
        strategy.close()


def test_layer_offload_refuses_weight_streaming_off(tiny_flux):
    memory = {
        "strategy": "layer_offload",
        "layer_offload_fraction": 0.5,
        "stagehand": {"weight_streaming": False},
    }
    with pytest.raises(ValueError, match="memory.stagehand.weight_streaming is false"):
        build_strategy(lora_flux(tiny_flux), memory, device="cpu")


@pytest.mark.gpu
def test_three_runtimes_match_plain_gradients_on_cuda(tiny_flux):
    results = []
    for memory in ({"strategy": "none"}, MEMORY):
        model = lora_flux(tiny_flux)
        if memory["strategy"] == "none":
            model.to("cuda")
        strategy = build_strategy(model, memory, device="cuda", checkpoint_dir=tiny_flux)
        grads, _ = run(model, strategy)
        strategy.close()
        results.append(grads)
    assert_same_grads(*results)
