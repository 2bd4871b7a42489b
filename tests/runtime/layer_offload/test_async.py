"""``enable_async_offloading`` changes when the offloaded blocks are copied, never which blocks
are offloaded (NOTE [ Layer-order window ] in ``runtime/stagehand/layer_offload/schedule.py``).

At ``layer_offload_fraction`` 0.5, on the denoiser of every family's tiny pipeline folder
(``tests/fixtures``: Flux, SD3, Qwen-Image, Wan, Z-Image, FLUX.2, LTX-2, called through the
trainer's own family adapter, 3 to 8 blocks) and the factory's Flux (4 blocks),
for 3 steps, synchronous and async: each step loads and evicts every offloaded block once in
forward and once in backward, the same counts in both modes, nothing offloaded is left on the
device at a step's end, and losses, gradients and final weights are bit-identical. Async is not
vacuous: its loads are issued ahead of their use (``prefetch``), the synchronous ones never are.
The same holds on SDXL's UNet, which calls its blocks out of registration order (its first step
records the call order, NOTE [ Layer order ]), and on a toy whose call order changes from step
to step.

Before the fix, the window walked past the offloaded blocks left on the device after their use
and round the order into the next step: with 1 offloaded block of 3 async loaded it once and
never evicted it (loads [1, 0, 0], evictions [0, 0, 0] where sync makes [2, 2, 2]).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import diffusers
import pytest
import torch

from stagehand.common import ListSink, Telemetry
from stagehand.strategy import build_strategy
from tests.fixtures.pipelines import build_pipeline
from tests.runtime.device_double import SLOW, device_double
from tests.runtime.exact import (
    Run,
    SharedContextToy,
    assert_exact,
    inputs_for,
    make_model,
    train,
)
from tests.runtime.test_squareq_exactness import PIPELINE_FAMILIES, family_forward
from workbench.worker.pipelines import adapter_for, inspect_pipeline

from ._helpers import layer_offload

pytestmark = pytest.mark.parity  # run again with ATEN_CPU_CAPABILITY=default by ./dev test

STEPS = 3
FRACTION = 0.5
TRANSFORMERS = ["flux-factory", *(f for f in PIPELINE_FAMILIES if f != "sdxl")]
"""Every transformer the fixtures build (Wan 2.2's experts are Wan's class): the factory's Flux
and each pipeline family's; SDXL's denoiser is a UNet (its own tests below)."""


@pytest.fixture(scope="module")
def families(asset_cache, tiny_flux):
    """``name: (class, folder, forward)``: each pipeline family's denoiser, called as the
    trainer calls it (``family_forward``), and the factory's Flux on its example inputs."""
    cache = asset_cache / "trainer-cache"
    out = {"flux-factory": (diffusers.FluxTransformer2DModel, tiny_flux, None)}
    for name in PIPELINE_FAMILIES:
        info = inspect_pipeline(build_pipeline(name, asset_cache))
        family = adapter_for(info, cache, torch.float32)
        folder = family.transformer_dir
        cls = getattr(diffusers, json.loads((folder / "config.json").read_text())["_class_name"])
        out[name] = (cls, folder, family_forward(family))
    return out


@dataclass
class LayerRun:
    """One run under layer offload: its numbers, its telemetry, the resident count and the
    offloaded count, the offloaded blocks left on the device at each step's end, and the most
    offloaded blocks on the device when a layer began."""

    numbers: Run
    sink: ListSink
    n_resident: int
    offloaded: int
    left: list[list[int]]
    on_device_max: int
    steps: int = STEPS

    def per_step(self, event: str) -> list[int]:
        """The offloaded blocks' ``event`` records (``stagehand/block``) of each step; the
        resident blocks' loads at set-up and evictions at ``close`` are not counted."""
        records = self.records(event)
        assert all(r["step"] in range(self.steps) for r in records)
        return [sum(1 for r in records if r["step"] == step) for step in range(self.steps)]

    def ahead_per_step(self) -> list[bool]:
        """Whether every load of the offloaded blocks in each step was issued ahead of its use
        (``prefetch``)."""
        loads = self.records("load")
        return [all(r["prefetch"] for r in loads if r["step"] == s) for s in range(self.steps)]

    def records(self, event: str) -> list[dict]:
        """The offloaded blocks' ``event`` records."""
        return [
            r
            for r in self.sink.of("stagehand", "block")
            if r["event"] == event and r["block"] >= self.n_resident
        ]


def run(families, name: str, async_: bool, steps: int = STEPS) -> LayerRun:
    """``steps`` steps under layer offload at ``FRACTION``, async or not."""
    cls, folder, forward = families[name]
    model = make_model(name, folder, "lora", cls=cls)
    sink = ListSink()
    memory = layer_offload(FRACTION, False, enable_async_offloading=async_)
    strategy = build_strategy(model, memory, device="cpu", telemetry=Telemetry(sink))
    manager = strategy.manager
    n = len(manager.blocks)
    offloaded = n - manager.n_resident
    assert n >= 3 and offloaded == int(FRACTION * n) >= 1, (name, n)
    assert strategy.weights.scheduler.window == (1 if async_ else 0)
    left: list[list[int]] = []
    numbers = train(
        model,
        strategy,
        steps=steps,
        after_step=lambda s: left.append(s.manager.offloaded_on_device()),
        forward=forward,
    )
    held = manager.on_device_max
    return LayerRun(numbers, sink, manager.n_resident, offloaded, left, held, steps)


def assert_same_blocks_moved(families, name: str, steps: int = STEPS) -> tuple[LayerRun, LayerRun]:
    """Sync and async: the per-step loads and evictions (block records and ``stagehand/step``
    counters) equal each other and 2 x the offloaded count, nothing offloaded left at a step's
    end, and the same numbers bit for bit. Returns the two runs."""
    sync = run(families, name, async_=False, steps=steps)
    ahead = run(families, name, async_=True, steps=steps)
    each = [2 * sync.offloaded] * steps  # every offloaded block: once in forward, once in backward
    for event in ("load", "evict"):
        assert sync.per_step(event) == each, (name, event, "sync")
        assert ahead.per_step(event) == sync.per_step(event), (name, event)
    for got in (sync, ahead):
        records = got.sink.of("stagehand", "step")
        assert [r["blocks_loaded"] for r in records] == each, name
        assert [r["blocks_evicted"] for r in records] == each, name
    assert sync.left == ahead.left == [[]] * steps  # no offloaded layer kept past a step's end
    # The block in use, plus the one copied ahead with async.
    assert (sync.on_device_max, ahead.on_device_max) == (1, min(2, sync.offloaded)), name
    assert_exact(sync.numbers, ahead.numbers)
    return sync, ahead


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_async_moves_the_blocks_sync_moves(families, name):
    sync, ahead = assert_same_blocks_moved(families, name)
    # Not vacuous: no sync copy is issued ahead of its use; on the CPU every async one is (under
    # the suite-wide device double a prefetch may give up on a block whose copy back is late).
    assert not any(r["prefetch"] for r in sync.records("load"))
    lagging = bool(os.environ.get("STAGEHAND_TEST_LAG"))
    assert (any if lagging else all)(r["prefetch"] for r in ahead.records("load"))
    # Called in registration order: no step leaves the layer order, none is a trace step.
    assert [r["trace_updated"] for r in ahead.sink.of("stagehand", "step")] == [False] * STEPS


def test_sdxl_unet_trains_under_layer_offload(families):
    """SDXL's UNet passes the text only to a block whose ``has_cross_attention`` is true, an
    attribute the wrapper reads from its block (NOTE [ Transparent wrapper ]): the plain model's
    numbers, each offloaded block loaded and evicted in forward and in backward."""
    cls, folder, forward = families["sdxl"]
    plain = train(make_model("sdxl", folder, "lora", ordinary=True, cls=cls), forward=forward)
    sync = run(families, "sdxl", async_=False)
    assert sync.per_step("load") == sync.per_step("evict") == [2 * sync.offloaded] * STEPS
    assert sync.left == [[]] * STEPS
    assert_exact(plain, sync.numbers)


def test_async_on_the_sdxl_unet_moves_the_blocks_sync_moves(families):
    """The UNet calls ``mid_block``, its last block registered, between the down and up blocks
    (call order 0 1 4 2 3 of ``down_blocks.0, down_blocks.1, up_blocks.0, up_blocks.1,
    mid_block``; 3 and 4 offloaded). The first step copies ``up_blocks.1`` ahead in layer order,
    goes off order at ``mid_block`` and loads the rest at their use; it records the call order,
    which every later step follows with each load issued ahead (NOTE [ Layer order ]). Before,
    the window kept copying in registration order: 8 loads a step where sync makes 4."""
    sync, ahead = assert_same_blocks_moved(families, "sdxl")
    steps = ahead.sink.of("stagehand", "step")
    assert [r["trace_updated"] for r in steps] == [True, False, False]
    prefetched = [
        sum(r["prefetch"] for r in ahead.records("load") if r["step"] == s) for s in range(STEPS)
    ]
    if os.environ.get("STAGEHAND_TEST_LAG"):  # a prefetch may give up on a late copy back
        assert all(prefetched[1:]), prefetched
    else:
        assert prefetched == [1, 4, 4]
        assert ahead.ahead_per_step() == [False, True, True]
    assert not any(r["prefetch"] for r in sync.records("load"))


PATHS = [[0, 1, 2, 3], [0, 1, 3, 2], [0, 1, 3, 2], [0, 1, 2, 3]]
"""The blocks each step of the path test calls, in order: layer order, then another order
twice, then layer order again (a data-dependent path)."""


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """``{"shared": (class, folder, forward)}``: a 4-block ``SharedContextToy`` whose forward
    calls its blocks in ``PATHS[step]``."""
    folder = tmp_path_factory.mktemp("paths")
    torch.manual_seed(5)
    SharedContextToy(dim=16, num_layers=4).save_pretrained(folder, safe_serialization=True)

    def forward(model, step):
        inputs = inputs_for(model, step)
        x, context = inputs["x"], model.proj(inputs["c"])
        for index in PATHS[step]:
            x = model.blocks[index](x, context)
        return x

    return {"shared": (SharedContextToy, folder, forward)}


def test_a_step_off_the_learned_order_teaches_the_next(paths):
    """A step whose calls leave the order loads what sync loads (the copy it issued ahead is
    kept for its use, none is issued after) and its calls are the next step's order: steps 1
    and 3 go off order, steps 0 and 2 load every offloaded block ahead."""
    sync, ahead = assert_same_blocks_moved(paths, "shared", steps=len(PATHS))
    steps = ahead.sink.of("stagehand", "step")
    assert [r["trace_updated"] for r in steps] == [False, True, False, True]
    if not os.environ.get("STAGEHAND_TEST_LAG"):
        assert ahead.ahead_per_step() == [True, False, True, False]
    assert any(r["prefetch"] for r in ahead.records("load") if r["step"] in (1, 3))


@pytest.mark.sync_device  # its own double, not the suite-wide one (STAGEHAND_TEST_LAG)
@pytest.mark.parametrize("lag", [2, SLOW])
def test_async_moves_the_blocks_sync_moves_under_the_device_double(families, lag):
    """Copies run late (the device double): the same counts, the same numbers; copies still
    go ahead of their use (a prefetch may give up on a block whose copy back is in flight,
    and that block loads at its use)."""
    with device_double(lag) as device:
        _, ahead = assert_same_blocks_moved(families, "flux2")
    assert any(r["prefetch"] for r in ahead.records("load"))
    assert device.max_pending > 0
