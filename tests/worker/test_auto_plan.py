"""One resolution of ``"auto"``: a run resolves its ``"auto"`` watermarks at build with the
activation peak its plan uses, so it starts with the watermarks ``workbench plan`` shows."""

import json

from stagehand.strategy.auto import resolve_auto
from workbench.cli.train import main
from workbench.plan.activation_peak import planned_activation_peak
from workbench.plan.plan import check_memory, plan_preset
from workbench.plan.profiles import DeviceProfile
from workbench.plan.sections import (
    auto_section,
    block_sizes,
    plan_trainable_bytes,
    planned_activations,
)
from workbench.worker.preset import validate_preset

AUTO = {"vram_high_watermark_mb": "auto", "vram_low_watermark_mb": "auto"}
TRACKED = DeviceProfile("tracked", 0, 1.0, 1.0, "bytes only", tracked=True, synchronous_copies=True)


def test_a_run_resolves_auto_with_its_plans_activation_peak(
    cache_env, make_preset, tmp_path, run_io
):
    """tiny-ci with ``"auto"`` weight watermarks and a Conductor soft cap of 32 MB (the budget
    ``"auto"`` fits on a CPU device; stage 1's text encoder, with larger blocks, resolves its
    own from it too): the worker's build-time ``limits_applied`` record (request
    id ``auto``) holds the watermarks the planner resolves for the same preset, to the byte."""
    conductor = {"vram_soft_cap_mb": 32, "vram_hard_cap_mb": 64}
    stagehand = {**AUTO, "conductor_config": conductor}
    path = make_preset("tiny-auto", max_steps=2, memory={"stagehand": stagehand})
    data = json.loads(path.read_text())
    plan = plan_preset(data, TRACKED, quant_error="off")
    peak = planned_activation_peak(validate_preset(data))
    assert peak == planned_activations(plan.inventory, True) > 0
    section = check_memory(data["memory"]).stagehand
    planned = auto_section(plan.inventory, section, checkpointing=True, card_bytes=None)
    assert plan.auto_watermarks["high_mb"] == round(planned.vram_high_watermark_mb, 1)

    run_dir = tmp_path / "run"
    assert main([str(path), "--run-dir", str(run_dir)]) == 0
    recs = run_io.records(run_dir)
    applied = [
        r for r in run_io.of(recs, "strategy", "limits_applied") if r["request_id"] == "auto"
    ]
    built = applied[0]
    assert built["step"] is None or built["step"] == 0  # before the first step
    assert built["changed"]["vram_high_watermark_mb"] == ["auto", planned.vram_high_watermark_mb]
    assert built["changed"]["vram_low_watermark_mb"] == ["auto", planned.vram_low_watermark_mb]
    # Not vacuous: without the planned peak the run would have kept its bytes more.
    blind = resolve_auto(
        section,
        block_sizes=block_sizes(plan.inventory),
        trainable=plan_trainable_bytes(plan.inventory),
        activation_peak=0,
        card_bytes=None,
    )
    gap = blind.vram_high_watermark_mb - planned.vram_high_watermark_mb
    assert round(gap * 2**20) == peak
