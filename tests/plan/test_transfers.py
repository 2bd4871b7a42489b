"""What a planned step moves: H2D bytes and block loads against the runtime's counters, where
each load's bytes come from (host cache, page cache, disk), residency, the bound, the table."""

from __future__ import annotations

import copy
import json

import pytest

from stagehand.common.telemetry import Telemetry
from stagehand.config.memory import MB
from stagehand.strategy import build_strategy
from workbench.cli.plan import main
from workbench.plan import plan_model, profile
from workbench.plan.inventory import add_lora, folder_model
from workbench.plan.table import table
from workbench.plan.workload import LORA_RANK, LORA_TARGETS, load_model, train_steps
from workbench.worker.assets import example_inputs
from workbench.worker.preset import load_preset

LATENT = (8, 8)


def _meta(folder):
    model = folder_model(folder)
    add_lora(model, LORA_RANK, LORA_TARGETS)
    return model, example_inputs(model, batch_size=1, seed=0, latent_hw=LATENT, device="meta")


def _stream(folder, blocks_room: float, **extra) -> dict:
    """Weight streaming with room for ``blocks_room`` of the largest block above the resident
    bytes (high watermark; low one block below)."""
    inv = plan_model(*_meta(folder), {"strategy": "none"}, profile("rtx4090")).inventory
    block = max(b.nbytes for b in inv.blocks) / MB
    resident = inv.resident_bytes / MB
    return {
        "strategy": "stagehand",
        "gradient_checkpointing": False,
        "stagehand": {
            "pinned_pool_mb": 8,
            "pinned_slab_mb": 1,
            "vram_high_watermark_mb": round(resident + blocks_room * block, 4),
            "vram_low_watermark_mb": round(resident + (blocks_room - 1) * block, 4),
            "prefetch_window_blocks": 2,
            "block_events": False,
            **extra,
        },
    }


@pytest.mark.sync_device
def test_h2d_bytes_per_step_within_5_percent_of_the_counters(tiny_flux):
    memory = _stream(tiny_flux, 2.5)
    model = load_model(tiny_flux, "flux")
    strategy = build_strategy(
        model, copy.deepcopy(memory), device="cpu", telemetry=Telemetry(), checkpoint_dir=tiny_flux
    )
    inputs = example_inputs(model, batch_size=1, seed=0, latent_hw=LATENT)
    try:
        train_steps(strategy, model, inputs, warmup=2, steps=1)
        counters = strategy.counters()
    finally:
        strategy.close()
    plan = plan_model(*_meta(tiny_flux), memory, profile("cpu"))
    t = plan.to_dict()["transfers"]
    assert counters["h2d_bytes"] > 0 and counters["blocks_loaded"] == t["block_loads_per_step"]
    assert abs(t["h2d_bytes_per_step"] / counters["h2d_bytes"] - 1) <= 0.05
    n = len(plan.inventory.blocks)
    assert t["resident_blocks"] + t["streamed_blocks"] == n and t["streamed_blocks"] > 0
    assert t["loads_by_source"] == {"tracked": counters["blocks_loaded"]}


def test_loads_come_from_where_the_runtime_reads_them(tiny_flux):
    """On a GPU profile: with the host cache (on by default there) the trace step reads every
    block from its file once (a reload in its backward copies the image made) and the steady
    step copies from the images; without it every load
    is read through the readers first, at the page cache's rate or ``disk_gbps``."""
    model, inputs = _meta(tiny_flux)
    gpu = profile("rtx4090", h2d_gbps=0.01, read_gbps=0.005)  # slow links: copies show
    cached = plan_model(model, inputs, _stream(tiny_flux, 2.5), gpu)
    loads = cached.steady.blocks_loaded
    first, n = cached.steps[0], len(cached.inventory.blocks)
    assert first.loads_by_source == {"page_cache": n, "host_cache": first.blocks_loaded - n}
    assert cached.steady.loads_by_source == {"host_cache": loads}
    assert cached.to_dict()["transfers"]["source_mode"] == "host_cache"
    assert cached.steady.read_bytes == 0
    off = plan_model(model, inputs, _stream(tiny_flux, 2.5, host_cache_mb=0), gpu)
    assert off.steady.loads_by_source == {"page_cache": loads}
    s = off.steady
    assert s.read_bytes == s.h2d_bytes
    # Reads and copies pipeline: the step takes at least its reads at the read rate.
    assert s.step_ms >= s.read_bytes / (0.005 * 1e9) * 1e3 > cached.steady.step_ms
    disk = plan_model(
        model,
        inputs,
        _stream(tiny_flux, 2.5, host_cache_mb=0),
        profile("rtx4090", h2d_gbps=0.01, read_gbps=0.005, disk_gbps=0.001),
    )
    assert disk.steady.loads_by_source == {"disk": loads}
    assert disk.steady.step_ms >= s.read_bytes / (0.001 * 1e9) * 1e3 > s.step_ms
    module = plan_model(model, inputs, _stream(tiny_flux, 2.5, file_backed=False), gpu)
    assert module.steps[0].loads_by_source == {"host_cache": module.steps[0].blocks_loaded}


def test_layer_offload_residency_and_bound(tiny_flux):
    """Layer offload at 0.5 keeps the first half of the blocks: the plan says how many and
    how many bytes stay, and bounds the step by max(compute, bytes / H2D)."""
    from stagehand.layer_offload.schedule import resident_count

    memory = {
        "strategy": "layer_offload",
        "gradient_checkpointing": True,
        "layer_offload_fraction": 0.5,
    }
    plan = plan_model(*_meta(tiny_flux), memory, profile("rtx4090"))
    out = plan.to_dict()
    t, n = out["transfers"], len(plan.inventory.blocks)
    assert t["resident_blocks"] == resident_count(0.5, n) < n
    kept = sum(b.nbytes for b in plan.inventory.blocks[: t["resident_blocks"]])
    assert t["resident_block_bytes"] == kept
    assert t["block_loads_per_step"] == 2 * t["streamed_blocks"]
    bound = out["bound_ms"]
    h2d_ms = t["h2d_bytes_per_step"] / (plan.profile.h2d_gbps * 1e9) * 1e3
    assert bound["h2d"] == pytest.approx(h2d_ms, abs=1e-3)
    assert bound["bound"] == max(bound["compute"], bound["h2d"])
    assert out["step_ms"]["total"] >= bound["bound"] - 1e-3


def test_table_labels_units_and_cli_takes_disk_gbps(tiny_flux, tmp_path, capsys):
    text = table(plan_model(*_meta(tiny_flux), _stream(tiny_flux, 2.5), profile("h100")).to_dict())
    assert " MB" not in text and "MiB" in text and "GiB" in text
    assert "H100 SXM5" in text
    for label in ("H2D/step", "residency", "bound", "host cache (pinned H2D)"):
        assert label in text
    preset = load_preset("tiny-ci")[1]
    preset["memory"]["stagehand"]["host_cache_mb"] = 0
    path = tmp_path / "p.json"
    path.write_text(json.dumps(preset))
    out = tmp_path / "o.json"
    args = [str(path), "--device", "rtx4090", "--no-calibration", "--json", str(out)]
    assert main([*args, "--disk-gbps", "2"]) in (0, 1)
    saved = json.loads(out.read_text())
    assert saved["transfers"]["source_mode"] == "disk"
    assert "disk through the readers" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:  # argparse's usage error, naming the flag
        main([*args, "--disk-gbps", "-1"])
    assert refused.value.code == 2
    assert "argument --disk-gbps: expected a finite number: GB/s, 0.01" in capsys.readouterr().err


def test_auto_watermarks_keep_what_fits_and_move_twice_the_rest(tiny_flux):
    """``"auto"`` weight watermarks from the plan's own figures (the runtime's rule): a bigger
    card keeps more blocks resident and moves fewer bytes, a streamed block at most twice a
    step (once in forward, once in backward; the blocks at the turns are reused)."""
    from stagehand.weights.auto import auto_watermarks
    from workbench.plan import PlanInputError

    model, inputs = _meta(tiny_flux)
    memory = _stream(tiny_flux, 2.5)
    # A window of one block: the 4 tiny blocks would all fit in a derived window's band.
    memory["stagehand"].update(
        vram_high_watermark_mb="auto", vram_low_watermark_mb="auto", prefetch_window_blocks=1
    )
    inv = plan_model(model, inputs, {"strategy": "none"}, profile("rtx4090")).inventory
    first = plan_model(model, inputs, memory, profile("rtx4090")).auto_watermarks
    taken = first["activation_peak_bytes"] + first["trainable_bytes"] + 2 * first["window_bytes"]
    resident = []
    moved = []
    for extra in (0.3, 0.6):  # of the blocks' bytes under the low watermark
        # usage counts the resident bytes, activations and trainable bytes beside the blocks
        used = first["activation_peak_bytes"] + first["trainable_bytes"]
        low = inv.resident_bytes + used + extra * inv.block_bytes
        vram = int((low + taken + 2**30) / 0.95)  # the CUDA margin: 1 GiB + 5% of the card
        plan = plan_model(model, inputs, memory, profile("rtx4090", vram_bytes=vram))
        auto, t = plan.auto_watermarks, plan.to_dict()["transfers"]
        high, low = auto_watermarks(
            auto["device_bytes"],
            auto["activation_peak_bytes"],
            auto["trainable_bytes"],
            auto["window_bytes"],
            auto["margin_bytes"],
        )
        assert auto["low_mb"] == round(low / MB, 1) and auto["high_mb"] == round(high / MB, 1)
        assert auto["activation_peak_bytes"] > 0 and auto["trainable_bytes"] == 4 * inv.lora_bytes
        assert 0 < t["streamed_blocks"] and t["block_loads_per_step"] > 0
        assert t["h2d_bytes_per_step"] <= 2 * t["streamed_block_bytes"]
        resident.append(t["resident_blocks"])
        moved.append(t["h2d_bytes_per_step"])
    assert resident[1] > resident[0] and moved[1] < moved[0]
    with pytest.raises(PlanInputError, match="vram_high_watermark_mb"):
        plan_model(model, inputs, memory, profile("rtx4090", vram_bytes=2**20))


def test_waits_follow_the_compute_to_copy_ratio(tiny_flux):
    """On a GPU profile copies overlap compute: with a link far faster than compute no use
    waits on its block; with one far slower the prefetched blocks are still in flight when
    used (waits, a stall that lengthens the step), yet were issued ahead: no more misses."""
    memory = _stream(tiny_flux, 2.5)
    fast = plan_model(*_meta(tiny_flux), memory, profile("h100", h2d_gbps=1e6)).to_dict()
    slow = plan_model(*_meta(tiny_flux), memory, profile("h100", h2d_gbps=1e-3)).to_dict()
    tf, ts = fast["transfers"], slow["transfers"]
    assert tf["block_loads_per_step"] == ts["block_loads_per_step"] > 0
    assert tf["waits_per_step"] == 0 and fast["step_ms"]["stall"] == 0
    assert 0 < ts["waits_per_step"] <= ts["block_loads_per_step"]
    assert slow["step_ms"]["stall"] > 0
    ms = slow["step_ms"]  # rounded to 1 us each
    assert ms["total"] >= ms["compute"] + ms["stall"] - 2e-3
    assert ts["misses_per_step"] == tf["misses_per_step"]
