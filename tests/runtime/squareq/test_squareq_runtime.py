"""SquareQ on the weight runtime: the config's errors name the field; the quantized copy is
built once per source and format, atomically, and reused; the host cache holds the 8-bit
images; the ``squareq/step`` record carries the bytes dequantized, the time and (first record
only) the error table."""

import os

import pytest
from pydantic import ValidationError
from safetensors.torch import load_file

from stagehand.common import ListSink, Telemetry
from stagehand.config.memory import MemoryConfig, StagehandConfig
from stagehand.weights import WeightRuntime
from tests.runtime.weights._train import config, make_model, train


def runtime(tiny_flux, cache, fmt="int8", **overrides):
    model = make_model("flux", tiny_flux)
    sink = ListSink()
    rt = WeightRuntime(
        model,
        config(squareq={"format": fmt, "cache_dir": str(cache)}, **overrides),
        device="cpu",
        telemetry=Telemetry(sink),
        checkpoint_dir=tiny_flux,
    )
    return model, rt, sink


def test_config_error_names_the_field():
    with pytest.raises(ValidationError) as info:
        MemoryConfig.model_validate({"stagehand": {"squareq": {"format": "int4"}}})
    (error,) = info.value.errors()
    assert error["loc"] == ("stagehand", "squareq", "format")
    assert "'int8' or 'fp8_e4m3'" in error["msg"]
    assert StagehandConfig().squareq is None  # off when absent


def test_quantized_once_per_source_and_format_then_reused(tiny_flux, tmp_path):
    cache = tmp_path / "sq"
    _, first, _ = runtime(tiny_flux, cache)
    info = first.squareq.info
    assert info["cached"] is False and info["quantize_s"] > 0 and info["quantized_layers"] > 0
    (folder,) = [p for p in cache.iterdir()]
    assert folder.name.startswith("squareq-int8-")  # no temporary folder left
    stamp = os.stat(folder / "blocks.safetensors").st_mtime_ns
    # An ordinary safetensors file (written tensor by tensor, header first).
    stored = load_file(folder / "blocks.safetensors")
    assert len(stored) == len(first.source.entries) and info["bytes"] > 0
    first.close()
    _, second, _ = runtime(tiny_flux, cache)
    assert second.squareq.info["cached"] is True
    assert second.squareq.info["worst_layer"] == info["worst_layer"]
    assert os.stat(folder / "blocks.safetensors").st_mtime_ns == stamp  # not rewritten
    second.close()
    _, fp8, _ = runtime(tiny_flux, cache, fmt="fp8_e4m3")
    assert len(list(cache.iterdir())) == 2  # keyed by the format too
    fp8.close()


def test_host_cache_and_copies_carry_the_images(tiny_flux, tmp_path):
    """With the host cache on (CPU: an explicit budget), the cached images and the bytes
    copied per load are the 8-bit images: <= 0.56x of the compute-dtype blocks."""
    model, rt, sink = runtime(tiny_flux, tmp_path / "sq", host_cache_mb=64)
    blocks = rt.blocks
    train(model, rt, steps=2)
    images = sum(b.staged_bytes for b in blocks)
    plain = sum(b.nbytes for b in blocks)
    assert images <= 0.56 * plain
    assert rt.cache.cached_bytes == images  # every block cached, in 8 bits
    steps = sink.of("stagehand", "step")
    loads = rt.counters()["blocks_loaded"]
    assert loads > 0 and rt.counters()["h2d_bytes"] <= 0.56 * plain * loads / len(blocks)
    records = sink.of("squareq", "step")
    assert len(records) == len(steps) == 2
    first, second = records
    assert first["format"] == "int8" and first["bytes_dequantized"] > 0
    assert first["blocks_dequantized"] > 0 and first["dequant_ms"] > 0
    assert first["worst_layer"].startswith(("transformer_blocks.", "single_transformer_blocks."))
    assert "worst_layer" not in second  # the table is shown once
    each = [b.image.dequantized_bytes for b in blocks]
    n = second["blocks_dequantized"]
    assert n * min(each) <= second["bytes_dequantized"] <= n * max(each)
    rt.close()


def test_conductor_registers_the_squareq_adapter_and_its_staging(tiny_flux, tmp_path):
    """The third adapter: its device staging (one image per copy in flight) is a VRAM
    reservation owned by ``squareq``, and its snapshot is in the Conductor's records."""
    from stagehand.strategy import build_strategy
    from tests.runtime.exact import train as train_exact

    model = make_model("flux", tiny_flux)
    sink = ListSink()
    section = {
        "strategy": "stagehand",
        "stagehand": {
            "pinned_pool_mb": 4,
            "pinned_slab_mb": 1,
            "prefetch_window_blocks": 1,
            "vram_high_watermark_mb": 0,
            "vram_low_watermark_mb": 0,
            "squareq": {"format": "fp8_e4m3", "cache_dir": str(tmp_path / "sq")},
            "conductor_config": {"enabled": True, "pinned_budget_mb": 4096},
        },
    }
    built = build_strategy(
        model, section, device="cpu", telemetry=Telemetry(sink), checkpoint_dir=tiny_flux
    )
    (adapter,) = [a for a in built.conductor.adapters if a.name == "squareq"]
    staging = built.weights.transfer.max_inflight * built.weights.squareq.largest_image
    assert staging > 0 and adapter.staging_bytes() == staging
    assert built.conductor.budget.held_mb("vram", "squareq") == staging / 2**20
    train_exact(model, built, steps=2)
    snapshots = [
        r["runtime_snapshots"]["squareq"] for r in sink.records if "runtime_snapshots" in r
    ]
    assert snapshots and snapshots[-1]["format"] == "fp8_e4m3"
    assert snapshots[-1]["bytes_dequantized"] > 0 and snapshots[-1]["image_ratio"] <= 0.56
    assert built.conductor.budget.held_mb("vram", "squareq") == 0  # released at close
