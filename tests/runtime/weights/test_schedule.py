"""Trace, prefetch along the traced order in both directions, watermarks, live knobs, Conductor."""

import pytest

from stagehand.common import ListSink, Telemetry
from stagehand.config.memory import MB
from stagehand.weights import WeightRuntime
from tests.runtime import exact

from ._train import config, make_model, train


def _run(tiny_flux, begin_step=True, conductor=None, **overrides):
    model = make_model("flux", tiny_flux)
    sink = ListSink()
    runtime = WeightRuntime(
        model,
        config(**overrides),
        device="cpu",
        telemetry=Telemetry(sink),
        checkpoint_dir=tiny_flux,
    )
    runtime.conductor = conductor
    train(model, runtime, steps=3, begin_step=begin_step)
    runtime.end_step()  # closes the last auto-detected step; no-op after an explicit end_step
    return runtime, sink


@pytest.mark.parametrize("begin_step", [True, False], ids=["explicit-steps", "detected-steps"])
def test_window_one_peak_and_order(tiny_flux, begin_step):
    runtime, sink = _run(tiny_flux, begin_step=begin_step)
    n = len(runtime.blocks)
    biggest = max(b.nbytes for b in runtime.blocks)
    steps = sink.of("stagehand", "step")
    assert [r["step"] for r in steps] == [0, 1, 2]
    for record in steps:
        assert record["vram_source"] == "tracked"
        assert record["vram_peak_mb"] * MB <= runtime.resident_bytes + 2 * biggest
    # after the trace step a second block is on the device while one computes
    assert steps[2]["vram_peak_mb"] * MB > runtime.resident_bytes + biggest
    assert steps[2]["prefetch_misses"] == 0 and steps[2]["prefetch_hits"] >= 2 * n - 2
    for step in (1, 2):
        events = [r for r in sink.of("stagehand", "block") if r["step"] == step]
        enters = [(r["block"], r["direction"]) for r in events if r["event"] == "enter"]
        assert enters == [(i, "forward") for i in range(n)] + [
            (i, "backward") for i in reversed(range(n))
        ]
        # every load is a prefetch issued while another block computed: between the load and
        # the block's use, a different block exits
        loads = [pos for pos, r in enumerate(events) if r["event"] == "load"]
        assert len(loads) >= n - 2
        for pos in loads:
            block = events[pos]["block"]
            assert events[pos]["prefetch"] is True
            use = next(
                (
                    q
                    for q in range(pos + 1, len(events))
                    if events[q]["event"] == "enter" and events[q]["block"] == block
                ),
                None,
            )
            if use is None:  # loaded ahead at the step's end for the next step's first uses
                assert all(r["event"] != "enter" for r in events[pos + 1 :])
                continue
            assert any(r["event"] == "exit" and r["block"] != block for r in events[pos + 1 : use])


def _sizes(tiny_flux) -> tuple[int, int]:
    """(resident bytes, largest block's bytes) of the LoRA model under the runtime."""
    probe = WeightRuntime(make_model("flux", tiny_flux), config(), device="cpu")
    sizes = probe.resident_bytes, max(b.nbytes for b in probe.blocks)
    probe.close()
    return sizes


def test_high_watermark_stops_prefetch(tiny_flux):
    resident, biggest = _sizes(tiny_flux)
    high = (resident + biggest + 100_000) / MB  # room for one block, not for a second
    runtime, sink = _run(tiny_flux, vram_high_watermark_mb=high, vram_low_watermark_mb=high)
    steps = sink.of("stagehand", "step")
    assert runtime.resident_bytes == resident
    assert all(r["vram_peak_mb"] <= high for r in steps)
    assert steps[2]["prefetch_skipped"] > 0


def test_low_watermark_zero_keeps_only_the_window(tiny_flux):
    # Window 1: the last forward block (backward's first) and the last backward block (the
    # next step's first) stay over their turn; every other block moves twice a step.
    runtime, sink = _run(tiny_flux, vram_low_watermark_mb=0)
    last = sink.of("stagehand", "step")[2]
    n = len(runtime.blocks)
    assert last["blocks_evicted"] == 2 * (n - 1) and last["blocks_loaded"] == 2 * (n - 1)
    # At the step's end the next step's first block stayed and the window, reaching past it
    # (NOTE [ Prefetch window ]), loaded its second ahead: both on the device.
    assert last["resident_blocks"] == 2
    assert [b.index for b in runtime.blocks if b.state.name != "UNLOADED"] == [0, 1]


def test_live_window_zero_disables_prefetch(tiny_flux):
    runtime, sink = _run(tiny_flux, prefetch_window_blocks=0)
    assert runtime.snapshot() == {"max_inflight": 2, "prefetch_window": 0}
    assert all(r["prefetch_hits"] == 0 for r in sink.of("stagehand", "step"))
    runtime.scheduler.prefetch_window = 2  # the live knob takes effect on the next use
    runtime.transfer.max_inflight = 1
    assert runtime.snapshot() == {"max_inflight": 1, "prefetch_window": 2}


class _Grant:
    def __init__(self, owner, granted):
        self.owner, self.granted = owner, granted
        self.reason = None if granted else "backward pressure"

    def release(self):
        self.owner.released += 1


class _AlternatingConductor:
    """Grants every other speculative H2D request (the Conductor's grant protocol)."""

    def __init__(self):
        self.requests = self.released = 0

    def request_transfer(self, direction, kind):
        assert (direction, kind) == ("h2d", "speculative")
        self.requests += 1
        return _Grant(self, granted=self.requests % 2 == 0)


@pytest.mark.sync_device  # grants counted released right after training
def test_conductor_denials_skip_prefetch_and_grants_are_released(tiny_flux):
    conductor = _AlternatingConductor()
    runtime, sink = _run(tiny_flux, conductor=conductor)
    steps = sink.of("stagehand", "step")
    granted = conductor.requests // 2
    assert conductor.requests > 0 and conductor.released == granted
    denied = conductor.requests - granted
    # the last request (next step's first block, after the last step record) is not in a record
    assert sum(r["prefetch_skipped"] for r in steps) >= denied - 1 > 0


def test_set_watermarks_validates(tiny_flux):
    model = make_model("flux", tiny_flux)
    runtime = WeightRuntime(model, config(), device="cpu")
    with pytest.raises(ValueError, match="vram_low_watermark_mb"):
        runtime.set_watermarks(100, 200)
    with pytest.raises(ValueError, match="vram_high_watermark_mb"):
        runtime.set_watermarks(-1, 0)
    runtime.set_watermarks(300, 200)
    assert (runtime.high_mb, runtime.low_mb) == (300, 200)


@pytest.mark.sync_device  # the schedule of a device whose copies land at once
def test_tight_watermarks_keep_the_next_needed_block_no_stalls_after_trace(tiny_flux):
    # Room for one block and a half: the window (2) never fits, so which block stays decides
    # whether a use stalls. The block needed next must win over one needed later, both at the
    # end of backward (the next step's first block) and inside backward (make room for it).
    resident, block = _sizes(tiny_flux)
    high = (resident + 1.9 * block) / MB
    low = (resident + 1.5 * block) / MB
    runtime, sink = _run(
        tiny_flux, prefetch_window_blocks=2, vram_high_watermark_mb=high, vram_low_watermark_mb=low
    )
    assert runtime.resident_bytes == resident
    steps = sink.of("stagehand", "step")
    stalls = [r for r in sink.of("stagehand", "block") if r["event"] == "stall"]
    assert {r["step"] for r in stalls} == {0}  # only the trace step loads on demand
    assert all(r["prefetch_hits"] > 0 and r["prefetch_misses"] == 0 for r in steps[1:])
    assert all(r["vram_peak_mb"] <= high for r in steps)


@pytest.mark.parametrize("checkpointing", exact.CHECKPOINTING, ids=str)
def test_backward_holds_one_block_under_every_checkpointing(tmp_path, checkpointing):
    """NOTE [ Backward block boundaries ]: a block's backward ends when the next one begins, also
    under a reentrant checkpoint (each recomputation after a nested backward). Watermarks 0 and
    no prefetch: one block on the device at a time, in the order 2, 1, 0, each evicted before
    the next loads."""
    folder = exact.build_toy("shared", tmp_path / "shared")
    model = exact.make_model("shared", folder, "full", checkpointing)
    sink = ListSink()
    runtime = WeightRuntime(
        model,
        config(prefetch_window_blocks=0, vram_high_watermark_mb=0, vram_low_watermark_mb=0),
        device="cpu",
        telemetry=Telemetry(sink),
    )
    train(model, runtime, steps=2)
    runtime.close()
    moves = [
        (r["event"], r["block"])
        for r in sink.of("stagehand", "block")
        if r["step"] == 1 and r["event"] in ("load", "evict")
    ]
    assert moves == [(e, b) for b in (0, 1, 2, 2, 1, 0) for e in ("load", "evict")]
