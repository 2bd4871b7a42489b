"""Limits learnt from out-of-memory recoveries (backend/workbench/plan/recovery.py, NOTE [ Limits a recovery
taught ]): the lowest ``limits_after`` of the newest runs, and a preset's limits capped there
before it is planned; the capped preset plans as one written with those limits."""

from __future__ import annotations

import copy

from workbench.plan import plan_preset, profile
from workbench.plan.recovery import RECOVERY_RUNS, cap_limits, learnt_limits, recovery_note
from workbench.worker.preset import load_preset


def rec(step: int, **after) -> dict:
    return {"step": step, "phase": "backward", "attempt": 1, "limits_after": after}


def test_learnt_limits_are_the_lowest_of_the_newest_runs():
    runs = [
        (9, [rec(3, vram_high_watermark_mb=22000.0), rec(3, vram_high_watermark_mb=18000.0)]),
        (7, [rec(5, vram_high_watermark_mb=20000.0, max_inflight_transfers=1)]),
        (6, [{"step": 2, "limits_after": None}]),  # nothing to learn: skipped
    ]
    learnt = learnt_limits("rtx4090", "flux", runs)
    assert learnt["limits"] == {"vram_high_watermark_mb": 18000.0, "max_inflight_transfers": 1}
    assert learnt["taught_by"] == {"vram_high_watermark_mb": 9, "max_inflight_transfers": 7}
    assert learnt["run_ids"] == [9, 7]
    assert [r["attempt"] for r in learnt["recoveries"]] == [1, 1, 1]
    # Only the newest RECOVERY_RUNS runs count; unknown fields and non-numbers teach nothing.
    newest = [(20 - i, [rec(1, vram_high_watermark_mb=20000.0)]) for i in range(RECOVERY_RUNS)]
    oldest = (1, [rec(1, vram_high_watermark_mb=1.0)])
    learnt = learnt_limits("rtx4090", "flux", [*newest, oldest])
    assert learnt["limits"] == {"vram_high_watermark_mb": 20000.0} and 1 not in learnt["run_ids"]
    odd = [(1, [rec(1, nonsense_mb=1.0, vram_low_watermark_mb="low", prefetch_window_blocks=True)])]
    assert learnt_limits("rtx4090", "flux", odd) is None


def test_cap_limits_caps_what_is_above_auto_or_unset_and_keeps_pairs_in_order():
    preset = {
        "memory": {
            "strategy": "stagehand",
            "stagehand": {
                "vram_high_watermark_mb": "auto",
                "vram_low_watermark_mb": 16000,
                "prefetch_window_blocks": 1,
                "activation_stagehand": {"enabled": True, "vram_high_watermark_mb": 9000},
            },
        }
    }
    kept = copy.deepcopy(preset)
    learnt = {
        "limits": {
            "vram_high_watermark_mb": 12000.0,
            "prefetch_window_blocks": 2,  # the preset's 1 is lower: kept
            "max_inflight_transfers": 1,  # absent: the runtime's default, capped
            "activation_vram_high_watermark_mb": 4000.0,
        }
    }
    out, capped = cap_limits(preset, learnt)
    assert preset == kept  # the caller's preset is not changed
    sh = out["memory"]["stagehand"]
    assert sh["vram_high_watermark_mb"] == 12000.0 and sh["vram_low_watermark_mb"] == 12000.0
    assert sh["prefetch_window_blocks"] == 1 and sh["max_inflight_transfers"] == 1
    assert sh["activation_stagehand"]["vram_high_watermark_mb"] == 4000.0
    assert capped == {
        "vram_high_watermark_mb": ["auto", 12000.0],
        "vram_low_watermark_mb": [16000, 12000.0],
        "max_inflight_transfers": [None, 1],
        "activation_vram_high_watermark_mb": [9000, 4000.0],
    }
    # A runtime that is off is not touched; a value the preset's validation refuses is left
    # for it to name.
    off = copy.deepcopy(kept)
    off["memory"]["stagehand"]["activation_stagehand"]["enabled"] = False
    off["memory"]["stagehand"]["vram_high_watermark_mb"] = "lots"
    out, capped = cap_limits(off, learnt)
    assert out["memory"]["stagehand"]["vram_high_watermark_mb"] == "lots"
    assert "activation_vram_high_watermark_mb" not in capped
    assert cap_limits({"memory": {"strategy": "layer_offload"}}, learnt) == (
        {"memory": {"strategy": "layer_offload"}},
        {},
    )


def test_the_capped_preset_is_planned_lower():
    _, config = load_preset("tiny-ci")
    # Watermarks that keep every block of the tiny model on the device.
    config["memory"]["stagehand"].update(vram_high_watermark_mb=100.0, vram_low_watermark_mb=50.0)
    learnt = learnt_limits("cpu", "flux", [(4, [rec(2, vram_high_watermark_mb=0.3)])])
    capped, changed = cap_limits(config, learnt)
    assert changed == {"vram_high_watermark_mb": [100.0, 0.3], "vram_low_watermark_mb": [50.0, 0.3]}
    dev = profile("rtx4090")
    raw = plan_preset(config, dev).to_dict()
    low = plan_preset(capped, dev).to_dict()
    assert low["memory"]["stagehand"]["vram_high_watermark_mb"] == 0.3
    # Fewer weight blocks kept on the device: more moved per step, a lower steady peak.
    assert low["transfers"]["resident_blocks"] < raw["transfers"]["resident_blocks"]
    assert low["transfers"]["h2d_bytes_per_step"] > raw["transfers"]["h2d_bytes_per_step"]
    assert low["peak_bytes"]["steady"] < raw["peak_bytes"]["steady"]
    assert recovery_note(learnt, changed) == (
        "a past run (#4) ran out of memory on cpu/flux (at step 2, backward); limits capped at"
        " what it went on with: vram_high_watermark_mb 100 → 0.3, vram_low_watermark_mb 50 → 0.3"
    )
