"""Inference mode on the real text encoder (all-MiniLM-L6-v2) and block discovery (seed bug 1)."""

import pytest
import torch
from torch import nn

from stagehand.common import ListSink, Telemetry, own_storage
from stagehand.weights import BlockDiscoveryError, WeightRuntime, find_blocks
from workbench.worker.assets import load_text_encoder

from ._train import config

TEXTS = ["a handwritten digit seven", "the number three, drawn in ink"]


@pytest.fixture(scope="module")
def encoder():
    tokenizer, plain = load_text_encoder()
    own_storage(plain)  # the plain model in ordinary tensors (NOTE [ Exact numbers ])
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = plain(**batch).last_hidden_state  # (B, tokens, 384)
    return tokenizer, batch, expected


@pytest.mark.parametrize("file_backed", [False, True], ids=["module-backed", "file-backed"])
def test_outputs_equal_plain_model_twice(encoder, minilm_dir, file_backed):
    """Seed bug 2: inference eviction must keep module-backed weights; a second forward after
    every block was evicted gives the same output. The 6.8 MB layers exceed the 4 MB slab, so
    they take the direct path, as the seed's Gemma 3 layers do."""
    _, batch, expected = encoder
    _, model = load_text_encoder()
    sink = ListSink()
    runtime = WeightRuntime(
        model,
        config(
            pinned_pool_mb=16, pinned_slab_mb=4, prefetch_window_blocks=0, vram_low_watermark_mb=0
        ),
        device="cpu",
        telemetry=Telemetry(sink),
        mode="inference",
        checkpoint_dir=minilm_dir if file_backed else None,
    )
    assert [b.name for b in runtime.blocks] == [f"encoder.layer.{i}" for i in range(6)]
    assert all((s.key is not None) == file_backed for b in runtime.blocks for s in b.layout)
    for _ in range(2):
        with torch.no_grad(), runtime.managed_forward():
            out = model(**batch).last_hidden_state
        assert torch.equal(out, expected)
        assert all(b.state.name == "UNLOADED" for b in runtime.blocks)
    runtime.end_step()
    steps = sink.of("stagehand", "step")
    assert [r["step"] for r in steps] == [0, 1]  # the second forward was detected as a new step
    assert all(r["blocks_loaded"] == r["blocks_evicted"] == 6 for r in steps)
    if not file_backed:  # module-backed: evicted parameters point at their intact host masters
        for block in runtime.blocks:
            for slot in block.layout:
                assert (
                    slot.param.shape == slot.shape and slot.param.data_ptr() == slot.host.data_ptr()
                )


def test_inference_prefetch_after_trace(encoder):
    _, batch, expected = encoder
    _, model = load_text_encoder()
    sink = ListSink()
    runtime = WeightRuntime(
        model,
        config(pinned_pool_mb=16, pinned_slab_mb=4, prefetch_window_blocks=2),
        device="cpu",
        telemetry=Telemetry(sink),
        mode="inference",
    )
    for _ in range(3):
        with torch.no_grad():
            assert torch.equal(model(**batch).last_hidden_state, expected)
    runtime.end_step()
    steps = sink.of("stagehand", "step")
    assert steps[0]["prefetch_misses"] == 6 and steps[2]["prefetch_misses"] == 0
    assert steps[2]["prefetch_hits"] == 6


class _Gemma3Like(nn.Module):
    """The nesting newer transformers use for Gemma 3: ``model.language_model.layers``."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.language_model = nn.Module()
        self.model.language_model.embed_tokens = bert.embeddings
        self.model.language_model.layers = bert.encoder.layer
        self.lm_head = nn.Linear(384, 16)


def test_nested_text_encoder_layers_are_found():
    """Seed bug 1: blocks nested at ``model.language_model.layers`` are detected."""
    _, bert = load_text_encoder()
    names = [name for name, _ in find_blocks(_Gemma3Like(bert))]
    assert names == [f"model.language_model.layers.{i}" for i in range(6)]


def test_block_pattern_and_no_blocks():
    _, bert = load_text_encoder()
    names = [name for name, _ in find_blocks(bert, r"encoder\.layer\.[0-2]")]
    assert names == ["encoder.layer.0", "encoder.layer.1", "encoder.layer.2"]
    with pytest.raises(BlockDiscoveryError, match="matched no module"):
        find_blocks(bert, r"decoder\.\d+")
    with pytest.raises(BlockDiscoveryError, match="Linear"):
        find_blocks(nn.Linear(4, 4))
