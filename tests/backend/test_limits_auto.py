"""A run whose preset says "auto": its starting limits leave those fields out until the worker's
``limits_applied`` record (request id "auto") gives the figures they became."""

from stagehand.config.limits import watermark_problem
from workbench.services.limits import config_limits, effective_limits

AUTO = {"vram_high_watermark_mb": "auto", "vram_low_watermark_mb": "auto"}
CONFIG = {
    "memory": {
        "strategy": "stagehand",
        "stagehand": {**AUTO, "activation_stagehand": {"enabled": True, **AUTO}},
    }
}


def test_auto_fields_are_figures_only_once_the_worker_resolved_them():
    assert "vram_high_watermark_mb" not in config_limits(CONFIG)
    built = {"seq": 1, "step": None, "request_id": "auto"}
    built["changed"] = {
        "vram_high_watermark_mb": ["auto", 900.0],
        "vram_low_watermark_mb": ["auto", 800.0],
    }
    now = effective_limits(CONFIG, [built])["now"]
    assert (now["vram_high_watermark_mb"], now["vram_low_watermark_mb"]) == (900.0, 800.0)
    # A request checked against them: a high watermark under the low one in force is named.
    assert watermark_problem(now, {"vram_high_watermark_mb": 700.0})[0] == "vram_high_watermark_mb"
    assert watermark_problem(config_limits(CONFIG), {"vram_high_watermark_mb": 700.0}) is None
