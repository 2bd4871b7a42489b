"""No host wait in the hot path, under a device the host always runs ahead of (``SLOW``).

The GPU test ``test_h2d_copies_overlap_compute_without_host_syncs`` counted one host wait on an
H200 where the CPU saw none: module-backed frozen blocks (their host masters in one page-locked
image each, as on CUDA) left on the device at a step's end are exposed to the user's code, so
their eviction in the next forward copies their weights back; the step boundary detected at the
forward after that waited on the host for those copies, though only the blocks' next loads read
them (and those wait on the device). The CPU's copies finished at once; the double's do not.
"""

from __future__ import annotations

import torch

from stagehand.common import ListSink, Telemetry
from stagehand.weights import WeightRuntime
from tests.runtime.device_double import SLOW, device_double

from ._train import Wide, config


def test_inference_forwards_never_wait_on_the_host_for_copies_back():
    torch.manual_seed(0)
    model = Wide(width=64).requires_grad_(False)
    x = torch.randn(16, 64)
    with torch.no_grad():
        expected = model(x)
    with device_double(SLOW) as device:
        runtime = WeightRuntime(
            model,
            config(
                pinned_pool_mb=20,
                max_inflight_transfers=20,
                prefetch_window_blocks=2,
                vram_high_watermark_mb=20000,
                vram_low_watermark_mb=0,  # every block streams: none kept after its use
                host_cache_mb=64,  # the masters in one image each, as on CUDA
            ),
            device="cpu",
            telemetry=Telemetry(ListSink()),
            mode="inference",
        )
        with torch.no_grad():
            model(x)  # trace step
            device.drain()
            waits, d2h = runtime.transfer.host_waits, runtime.transfer.back.bytes
            got = model(x)
            model(x)
        assert runtime.transfer.host_waits == waits == 0
        assert device.host_waits == 0
        # Not vacuous: the exposed blocks did copy back, and copies were pending behind the host.
        assert runtime.transfer.back.bytes > d2h
        assert device.max_pending > 0 and runtime.counters()["prefetch_hits"] == 8
        runtime.end_step()  # a step's end the user calls: every copy back is complete after it
        assert not runtime.transfer.back.events
        runtime.close()
    assert torch.equal(got, expected)
