"""NOTE [ Window growth ] (``runtime/stagehand/weights/policy.py``): a window the preset leaves to the
runtime doubles after a steady step in which a use waited on its prefetched block's copy, until
none does; a window the user gives stays. On the CPU no copy is ever in flight at its use; under
the device double (copies run late, in stream order) they are, as on a GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from stagehand.common import ListSink, Telemetry
from stagehand.common.device import ComputeWaits, TransferEvent
from stagehand.strategy.parts import WeightsPart
from stagehand.weights import WeightRuntime
from stagehand.weights.policy import MAX_GROWN_WINDOW, grown_window
from tests.runtime.device_double import SLOW, device_double

from ._train import Wide, config

DEPTH, WIDTH = 8, 64


def test_grown_window_doubles_while_uses_wait_up_to_its_caps():
    assert grown_window(2, 0, 57) == 2  # nothing waited: kept
    assert grown_window(2, 3, 57) == 4
    assert grown_window(4, 1, 57) == 8
    assert grown_window(16, 9, 57) == MAX_GROWN_WINDOW == 32
    assert grown_window(32, 9, 57) == 32
    assert grown_window(4, 2, 6) == 5  # the blocks less one
    assert grown_window(5, 2, 6) == 5
    assert grown_window(3, 1, 1) == 3  # never below the window in force


def _steps(window: int | None, lag: int | None, steps: int = 6, limit_after: int | None = None):
    """``steps`` train-shaped steps of a frozen ``Wide`` whose blocks all stream (low watermark
    0), under the device double with ``lag`` (None: the CPU). ``limit_after``: after that step,
    the user sets the window to 3 as a live limit. Returns the ``stagehand/step`` records."""
    torch.manual_seed(0)
    model = Wide(WIDTH, DEPTH).requires_grad_(False)
    sink = ListSink()
    with device_double(lag) if lag is not None else contextlib.nullcontext():
        runtime = WeightRuntime(
            model,
            config(prefetch_window_blocks=window, pinned_pool_mb=16),
            device="cpu",
            telemetry=Telemetry(sink),
        )
        part = WeightsPart(runtime)
        for step in range(steps):
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))
            runtime.begin_step(step)
            with runtime.managed_forward():
                loss = model(x.requires_grad_()).pow(2).mean()
            with runtime.managed_backward():
                loss.backward()
            runtime.end_step()
            if step == limit_after:
                part.set_limits({**part.get_limits(), "prefetch_window_blocks": 3})
        runtime.close()
    return sink.of("stagehand", "step")


@pytest.mark.sync_device  # the lag is this test's own
@pytest.mark.parametrize("lag", [8, SLOW])
def test_a_derived_window_grows_until_no_use_waits_on_its_copy(lag):
    derived = _steps(None, lag)
    given = _steps(2, lag)
    windows = [r["prefetch_window_blocks"] for r in derived]
    assert windows[:2] == [2, 2]  # the trace step, then the first steady step: it waited
    assert derived[1]["copy_waits"] > 0
    assert windows == sorted(windows) and windows[-1] > 2
    assert windows[-1] == windows[-2]  # settled
    assert derived[-1]["copy_waits"] == 0 and derived[-1]["prefetch_misses"] == 0
    # The user's window stays, and its uses go on waiting.
    assert [r["prefetch_window_blocks"] for r in given] == [2] * len(given)
    assert given[-1]["copy_waits"] > 0
    assert derived[-1]["blocks_loaded"] <= given[-1]["blocks_loaded"]


@pytest.mark.sync_device
def test_on_the_cpu_no_use_waits_and_the_window_stays():
    records = _steps(None, None)
    assert [r["prefetch_window_blocks"] for r in records] == [2] * len(records)
    assert [r["copy_waits"] for r in records] == [0] * len(records)
    assert [r["copy_wait_ms"] for r in records] == [0.0] * len(records)
    assert records[-1]["blocks_loaded"] > 0  # not vacuous: the blocks stream


@pytest.mark.sync_device
def test_a_window_set_as_a_live_limit_stops_the_growth():
    records = _steps(None, SLOW, limit_after=1)
    windows = [r["prefetch_window_blocks"] for r in records]
    assert windows[:2] == [2, 2] and records[1]["copy_waits"] > 0
    assert windows[2:] == [3] * (len(records) - 2)  # the user's, not the grown 4
    assert records[-1]["copy_waits"] > 0


def test_compute_waits_count_a_double_copy_not_run_when_the_compute_waits():
    """``ComputeWaits`` off CUDA: a CPU copy is complete (no wait); a device double's event that
    has not run is a wait, and waiting runs it."""
    waits = ComputeWaits("cpu")
    waits.wait(TransferEvent(None))
    assert waits.collect() == (0, 0.0)
    with device_double(SLOW):
        from stagehand.common.device import TransferStream

        stream = TransferStream("cpu")
        event = stream.record()
        assert not event.done
        waits.wait(event)
        assert event.done
        waits.wait(event)  # done now: no wait
    assert waits.collect() == (1, 0.0)
    assert waits.collect() == (0, 0.0)  # since the last call


class _Clock:
    """A stand-in CUDA device for ``ComputeWaits``' timing path: events record the device time
    when the stream reaches them (``t``), a copy's wait moves it on by the copy's remaining
    time, and the device has reached ``reached`` events so far (``query``)."""

    def __init__(self):
        self.t = 0.0
        self.recorded: list = []
        self.reached = 0

    def event_class(self):
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = None

            def record(self, stream=None):
                self.at = clock.t
                self.index = len(clock.recorded)
                clock.recorded.append(self)

            def query(self):
                return self.index < clock.reached

            def synchronize(self):
                clock.reached = max(clock.reached, self.index + 1)

            def elapsed_time(self, end):
                assert end.query() and self.query(), "elapsed_time of an event not reached"
                return end.at - self.at

        return Event


class _Copy:
    """A copy that ends ``late_ms`` after the compute reaches its use."""

    def __init__(self, clock, late_ms):
        self.clock, self.late_ms = clock, late_ms

    def wait(self, stream=None):
        self.clock.t += self.late_ms


def test_compute_waits_on_cuda_time_the_gap_and_never_read_an_event_not_reached(monkeypatch):
    """The CUDA path with a stand-in device: a use's wait is the time between the events around
    the compute stream's wait; gaps at the noise floor are not waits; ``collect(wait=False)``
    (a step end detected in a forward) reads only the events the device reached and leaves the
    others to the next call, and ``collect()`` waits for the last one."""
    clock = _Clock()
    monkeypatch.setattr(torch.cuda, "Event", clock.event_class())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    waits = ComputeWaits("cuda")
    for late in (0.0, 2.5, 0.05, 1.5):  # ms; 0.05 is under NOISE_MS
        waits.wait(_Copy(clock, late))
    clock.reached = 5  # the device passed the first two uses' events and the third's start
    count, ms = waits.collect(wait=False)
    assert (count, ms) == (1, 2.5)
    count, ms = waits.collect()  # the rest: the host waits for the last event
    assert (count, ms) == (1, 1.5) and clock.reached == len(clock.recorded)
    assert waits.collect() == (0, 0.0)
