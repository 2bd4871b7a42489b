"""The inventory measures each distinct operation once (``workbench.plan.op_counter``), and its
figures are those of the pass that measures every call (``OpCounter(cache=False)``, the
planner's pass before issue 58): field by field, for the families whose blocks repeat.

Flux has two lists of blocks of two classes (double and single stream), LTX-2 a video and an
audio stream in every block, Wan one list, SDXL a UNet whose down, mid and up blocks are of
different classes and widths, fed inputs of different shapes; each is the tiny pipeline of its
family (``tests/fixtures/pipelines.py``) planned through the family's own call, as
``workbench plan`` runs it. A model with LTX-2's real widths shows what the cache saves: its
first block measures its operations, the next only the two whose input now carries a
gradient, the rest nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workbench.plan.inventory import add_lora, inventory, meta_model
from workbench.plan.op_counter import OpCounter

FAMILIES = ["flux", "ltx2", "wan", "sdxl", "qwenimage", "sd3"]


def _family_inventory(folder, family: str, cache: bool, known: dict | None = None):
    """A fresh model and call of the ``family`` pipeline at ``folder`` (a backward leaves
    gradients on the adapter, so each pass gets its own), measured with ``cache``, reusing the
    signatures in ``known`` (default: a fresh dict, so that no test before it counts)."""
    from tests.plan.test_families import _preset
    from workbench.plan.plan import preset_family, preset_inputs, preset_model
    from workbench.worker.preset import validate_preset

    preset = validate_preset(_preset(folder, family))
    fam = preset_family(preset)
    model = preset_model(preset, fam)
    inputs = preset_inputs(model, preset, None, fam)
    ops = OpCounter(cache=cache, known={} if known is None else known)
    return inventory(model, inputs, ops=ops), ops


def _assert_same(cached, uncached) -> None:
    for f in dataclasses.fields(uncached):
        if f.name == "blocks":
            continue
        assert getattr(cached, f.name) == getattr(uncached, f.name), f.name
    assert len(cached.blocks) == len(uncached.blocks)
    for a, b in zip(cached.blocks, uncached.blocks, strict=True):
        assert dataclasses.asdict(a) == dataclasses.asdict(b), a.name
    assert cached == uncached


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_inventory_equals_the_uncached_one(asset_cache, family):
    from tests.fixtures.pipelines import build_pipeline

    folder = build_pipeline(family, asset_cache)
    cached, ops = _family_inventory(folder, family, cache=True)
    uncached, every = _family_inventory(folder, family, cache=False)
    _assert_same(cached, uncached)
    assert not every.reused and sum(ops.measured.values()) < sum(every.measured.values())
    assert sum(ops.measured.values()) + sum(ops.reused.values()) == sum(every.measured.values())


def _ltx2(layers: int, cache: bool):
    """LTX-2 at its real widths with ``layers`` blocks, a LoRA on every block linear, fed as
    ``workbench.plan.reference.ltx2_plan`` feeds it (128 px, 9 frames, 64 caption tokens)."""
    from types import SimpleNamespace

    from workbench.plan.reference import LTX2_CONFIG, ltx2_block_linears
    from workbench.worker.pipelines.ltx2 import LTX2PipelineFamily

    config = {**LTX2_CONFIG, "num_layers": layers}
    model = meta_model("LTX2VideoTransformer3DModel", config, torch.bfloat16)
    add_lora(model, 32, ltx2_block_linears(model))
    meta = {"device": "meta", "dtype": torch.bfloat16}
    x_t = torch.empty(1, config["in_channels"], 2, 4, 4, **meta)
    text = SimpleNamespace(
        hidden=torch.empty(1, 64, 2 * config["caption_channels"], **meta),
        mask=torch.ones(1, 64, **meta),
    )
    family = LTX2PipelineFamily()
    inputs = family.transformer_kwargs(model, x_t, torch.empty(1, **meta), text, 8)
    ops = OpCounter(cache=cache, known={})
    return inventory(model, inputs, ops=ops), ops


def test_repeated_blocks_are_measured_once():
    """Four identical LTX-2 blocks: the first measures each distinct operation of its forward
    (its video and audio attentions and LoRA linears repeat signatures within it too), the
    second the two residual adds whose input first carries a gradient (a signature holds
    ``requires_grad``), the other two nothing; the figures are the uncached pass's."""
    cached, ops = _ltx2(4, cache=True)
    uncached, every = _ltx2(4, cache=False)
    _assert_same(cached, uncached)
    per_block = [ops.measured.get(i, 0) for i in range(4)]
    assert 0 < per_block[0] < every.measured[0]
    assert per_block[1:] == [2, 0, 0]
    calls = [ops.measured.get(i, 0) + ops.reused.get(i, 0) for i in range(4)]
    assert calls == [every.measured[i] for i in range(4)]


@pytest.mark.parametrize("family", ["flux", "sdxl"])
def test_a_model_planned_again_measures_nothing(asset_cache, family):
    """What a counter measured is kept for the next one (by default for the process,
    ``op_counter.KNOWN``): the family planned again, a fresh model and call, reuses every call
    and gives the first pass's inventory, field by field."""
    from tests.fixtures.pipelines import build_pipeline
    from workbench.plan import op_counter

    assert OpCounter()._known is op_counter.KNOWN
    folder = build_pipeline(family, asset_cache)
    known: dict = {}
    first, ops = _family_inventory(folder, family, cache=True, known=known)
    again, reusing = _family_inventory(folder, family, cache=True, known=known)
    _assert_same(again, first)
    assert sum(ops.measured.values()) > 0 and sum(reusing.measured.values()) == 0
    assert sum(reusing.reused.values()) == sum(ops.measured.values()) + sum(ops.reused.values())
