"""Stage 1 with SquareQ: the text encoders stream in 8 bits only with ``text_encoder_squareq``
(off by default); then the encoder's output equals, bit for bit, the same encoder with its
dequantized weights resident (the real MiniLM, file-backed, inference mode)."""

import pytest
import torch

from stagehand.common import ListSink, Telemetry, own_storage
from stagehand.config.memory import MemoryConfig
from stagehand.squareq.runtime import dequantized_in_place
from stagehand.weights import WeightRuntime, find_blocks
from tests.runtime.weights._train import config
from workbench.worker.assets import load_text_encoder

TEXTS = ["a handwritten digit seven", "the number three, drawn in ink"]


def test_text_encoders_stream_in_8_bits_only_when_asked():
    on = {"format": "int8"}
    memory = MemoryConfig.model_validate({"stagehand": {"squareq": on}})
    assert memory.for_text_encoder().stagehand.squareq is None  # off by default
    assert memory.stagehand.squareq is not None  # the transformer's section keeps it
    asked = MemoryConfig.model_validate(
        {"stagehand": {"squareq": on, "text_encoder_squareq": True}}
    )
    assert asked.for_text_encoder().stagehand.squareq.format == "int8"


@pytest.mark.parity
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_text_encoder_in_8_bits_equals_its_dequantized_copy(minilm_dir, tmp_path, fmt):
    tokenizer, plain = load_text_encoder()
    own_storage(plain)
    plain.requires_grad_(False)
    assert dequantized_in_place([m for _, m in find_blocks(plain)], fmt) == 6 * 6  # q k v o i o
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = plain(**batch).last_hidden_state  # (B, tokens, 384)
    _, model = load_text_encoder()
    sink = ListSink()
    runtime = WeightRuntime(
        model,
        config(
            pinned_pool_mb=16,
            pinned_slab_mb=4,
            prefetch_window_blocks=0,
            vram_low_watermark_mb=0,
            squareq={"format": fmt, "cache_dir": str(tmp_path)},
        ),
        device="cpu",
        telemetry=Telemetry(sink),
        mode="inference",
        checkpoint_dir=minilm_dir,
    )
    assert all(b.image is not None for b in runtime.blocks)
    with torch.no_grad(), runtime.managed_forward():
        out = model(**batch).last_hidden_state
    runtime.end_step()
    assert torch.equal(out, expected)
    (record,) = sink.of("squareq", "step")
    assert record["blocks_dequantized"] == 6 and record["quantized_layers"] == 36
    assert record["image_ratio"] < 0.27  # fp32 encoder: 8 bits are about a quarter
    runtime.close()
