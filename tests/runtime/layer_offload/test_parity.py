"""Training under layer offload equals the plain model bit for bit (fp32, CPU, peft LoRA)."""

import math

import pytest

from stagehand.common import ListSink, Telemetry
from stagehand.config.memory import MB
from stagehand.layer_offload import OffloadCheckpointLayer
from stagehand.strategy import build_strategy

from ._helpers import assert_same_training, layer_offload, make_model, train

pytestmark = pytest.mark.parity  # run again with ATEN_CPU_CAPABILITY=default by ./dev test


@pytest.fixture(scope="module")
def folders(tiny_flux, tiny_sd3):
    return {"flux": tiny_flux, "sd3": tiny_sd3}


@pytest.fixture(scope="module")
def references(folders):
    return {arch: train(make_model(arch, path)) for arch, path in folders.items()}


@pytest.mark.parametrize("offload", [False, True], ids=["keep", "act-offload"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_gradients_match_plain_model(folders, references, arch, fraction, offload):
    model = make_model(arch, folders[arch])
    names = [n for n, _ in model.named_parameters()]
    model_mb = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    sink = ListSink()
    strategy = build_strategy(
        model, layer_offload(fraction, offload), device="cpu", telemetry=Telemetry(sink)
    )
    n = len(strategy.weights.blocks)
    resident = strategy.manager.n_resident
    assert resident == n - int(fraction * n)  # floor: Flux 4 blocks at 0.9 -> 1 resident
    # Installed: every block is wrapped, and parameter names are unchanged (LoRA files).
    wrapped = [m for m in model.modules() if isinstance(m, OffloadCheckpointLayer)]
    assert len(wrapped) == n and [n for n, _ in model.named_parameters()] == names
    assert_same_training(references[arch], train(model, strategy))

    steps = sink.of("stagehand", "step")
    assert [r["blocks_loaded"] for r in steps] == [2 * (n - resident)] * 2  # forward + backward
    assert [r["blocks_evicted"] for r in steps] == [2 * (n - resident)] * 2
    assert strategy.manager.offloaded_on_device() == []  # nothing left after the step
    # The dashboard draws these as lines: low 0 (evict after every layer), high the
    # all-resident weight size (a finite ceiling, never a budget).
    assert {(r["vram_low_watermark_mb"], r["vram_high_watermark_mb"]) for r in steps} == {
        (0.0, math.ceil(model_mb / MB))
    }
    spilled = [r["activations_spilled"] for r in sink.of("activation_stagehand", "step")]
    assert (min(spilled) > 0) if offload else (spilled == [0, 0])
    strategy.close()
    # Closed: the original blocks are back, with ordinary resident weights.
    assert not any(isinstance(m, OffloadCheckpointLayer) for m in model.modules())
    assert all(p.numel() > 0 for p in model.parameters())


def test_async_file_backed_and_conductor_match(folders, references):
    """enable_async_offloading (prefetch window 1), file-backed blocks and a Conductor attached
    through ``memory.stagehand``: the same gradients, the Conductor's adapter unchanged."""
    model = make_model("flux", folders["flux"])
    sink = ListSink()
    memory = layer_offload(
        0.5,
        True,
        enable_async_offloading=True,
        stagehand={
            "file_backed": True,
            "conductor_config": {"enabled": True, "pinned_budget_mb": 4096},
        },
    )
    strategy = build_strategy(
        model,
        memory,
        device="cpu",
        telemetry=Telemetry(sink),
        checkpoint_dir=folders["flux"],
    )
    assert strategy.weights.scheduler.prefetch_window == 1
    frozen = [s for b in strategy.weights.blocks if not b.resident for s in b.layout]
    assert any(s.key is not None for s in frozen)  # streamed from the checkpoint files
    assert_same_training(references["flux"], train(model, strategy))
    loads = [r for r in sink.of("stagehand", "block") if r["event"] == "load"]
    assert any(r["prefetch"] for r in loads)  # the next layer was copied ahead
    conductor = sink.of("conductor", "step")
    assert len(conductor) == 2 and "stagehand" in conductor[-1]["runtime_snapshots"]
    strategy.close()
    # The Conductor capped the window in force, never the setting; its cap is gone now.
    assert strategy.weights.scheduler.window == 1 and strategy.weights.scheduler.window_cap is None


def test_without_checkpointing_matches(folders, references):
    """``gradient_checkpointing: off``: the wrappers only call back; still exact."""
    model = make_model("sd3", folders["sd3"])
    strategy = build_strategy(
        model, layer_offload(0.5, True, gradient_checkpointing="off"), device="cpu"
    )
    assert_same_training(references["sd3"], train(model, strategy))
    strategy.close()
