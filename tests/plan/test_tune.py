"""``tune``: the Pareto marks, and candidates that the plan (the same simulation) says fit."""

from __future__ import annotations

import itertools

import pytest

from stagehand.config.memory import MB
from workbench.contract.preset.merge import merge_overrides
from workbench.plan import PlanInputError, plan_preset, profile
from workbench.plan.tune import limits_text, pareto, propose, trial_overrides
from workbench.plan.tune_cli import main as tune_main
from workbench.worker.preset import load_preset


def _dominated(p, points):
    return any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in points)


def test_pareto_marks_exactly_the_non_dominated_points():
    points = [(10, 5), (8, 7), (12, 4), (9, 9), (8, 7), (15, 4), (7, 12), (10, 6)]
    assert pareto(points) == [True, True, True, False, True, False, True, False]
    # Against brute force on every small grid of points.
    grid = list(itertools.product(range(3), range(3)))
    for pts in itertools.combinations(grid, 4):
        assert pareto(list(pts)) == [not _dominated(p, pts) for p in pts]


def test_candidates_fit_the_budget_as_the_plan_predicts():
    _, data = load_preset("tiny-ci")
    dev = profile("rtx4090")
    out = propose(data, dev, 3.0, max_trials=3)
    trials = out["trials"]
    # The preset's own limits first and last (the machine's drift), a candidate between.
    assert [t["label"] for t in trials] == ["preset", "t1", "preset-last"]
    assert trials[0]["memory"] == trials[2]["memory"] == {}
    assert trials[0]["limits"] == trials[2]["limits"]
    assert out["feasible"] >= 3 and out["searched"] == 270
    budget = profile("rtx4090", vram_bytes=3 * MB)
    for t in trials:
        assert t["predicted"]["peak_mb"] <= 3.0
        # The plan of the trial's own memory section predicts the same peak and step time.
        plan = plan_preset(merge_overrides(data, {"memory": t["memory"]}), budget).to_dict()
        assert plan["fits"] is True
        peak = max(plan["peak_bytes"].values()) / MB
        assert peak == pytest.approx(t["predicted"]["peak_mb"], abs=1e-4)
        assert plan["step_ms"]["total"] == pytest.approx(t["predicted"]["step_ms"], abs=1e-3)
        assert plan["blocks_loaded"] == t["predicted"]["blocks_loaded"]
    # The candidates are the predicted front's fastest: none slower than the preset's own.
    assert min(t["predicted"]["step_ms"] for t in trials[1:]) < trials[0]["predicted"]["step_ms"]
    over = trial_overrides(data, trials[1]["memory"], 2)
    assert (over["max_steps"], over["checkpoint_every"], over["data"]) == (3, None, {"limit": 16})


def test_budget_below_the_smallest_feasible_plan_names_the_field_and_minimum(capsys):
    _, data = load_preset("tiny-ci")
    with pytest.raises(PlanInputError, match=r"^budget_mb: 1 MB is below .* 1\.54 MB peak"):
        propose(data, profile("rtx4090"), 1.0)
    assert tune_main(["tiny-ci", "--budget-mb", "1", "--device", "rtx4090"]) == 2
    assert "budget_mb: 1 MB is below the smallest feasible plan" in capsys.readouterr().err


def test_feasible_counts_candidates_not_distinct_predictions():
    _, data = load_preset("tiny-ci")
    out = propose(data, profile("rtx4090"), 1000.0, max_trials=3)  # every candidate fits
    assert out["feasible"] == out["searched"] == 270
    # Many limits predict the same figures (a watermark above every peak changes nothing).
    assert 1 < out["distinct"] < out["feasible"]


@pytest.mark.parametrize("budget", ["1e308", "inf", str(2**30 + 1)])
def test_a_budget_no_machine_has_is_refused_offline_as_on_the_server(budget, capsys):
    assert tune_main(["tiny-ci", "--budget-mb", budget]) == 2
    err = capsys.readouterr().err
    assert "workbench tune: budget_mb: expected a number of MB > 0 and at most " in err
    assert "1073741824 (1 PiB)" in err and "Traceback" not in err


def _layer_offload_preset() -> dict:
    _, data = load_preset("tiny-ci")
    data["memory"] = {
        "strategy": "layer_offload",
        "gradient_checkpointing": True,
        "enable_activation_offloading": False,
        "layer_offload_fraction": 0.5,
    }
    return data


def test_layer_offload_preset_is_tuned_by_fraction_as_the_plan_predicts():
    """A layer-offload preset: candidates are resident counts 0..N (fractions the runtime maps
    back to them) with and without activation offloading, each predicted as its own plan."""
    from stagehand.layer_offload import resident_count

    data = _layer_offload_preset()
    dev = profile("rtx4090")
    n = len(plan_preset(data, dev).inventory.blocks)
    own = plan_preset(data, dev).to_dict()
    budget = max(own["peak_bytes"].values()) / MB + 0.01  # the preset's own limits just fit
    out = propose(data, dev, budget, max_trials=4)
    assert out["searched"] == 2 * (n + 1)
    assert "layer_offload_fraction" not in out["not_tuned"]
    trials = out["trials"]
    assert [t["label"] for t in trials] == ["preset", "t1", "t2", "preset-last"]
    assert trials[0]["limits"] == {
        "fraction": 0.5,
        "resident_blocks": n // 2,
        "activation_offloading": False,
    }
    assert limits_text(trials[0]["limits"]) == (
        f"layer offload 0.5 ({n // 2} blocks resident), activation offloading off"
    )
    for t in trials[1:-1]:
        lim = t["limits"]
        assert t["memory"]["strategy"] == "layer_offload"
        assert resident_count(t["memory"]["layer_offload_fraction"], n) == lim["resident_blocks"]
        assert t["predicted"]["peak_mb"] <= budget
        plan = plan_preset(merge_overrides(data, {"memory": t["memory"]}), dev).to_dict()
        assert max(plan["peak_bytes"].values()) / MB == pytest.approx(
            t["predicted"]["peak_mb"], abs=1e-4
        )
        assert plan["blocks_loaded"] == 2 * (n - lim["resident_blocks"])
    # Within the preset's own peak the fastest candidate keeps at least as many blocks.
    assert trials[1]["limits"]["resident_blocks"] >= n // 2
    assert trials[1]["predicted"]["step_ms"] <= trials[0]["predicted"]["step_ms"]
    floor = propose(data, dev, 1000.0)["min_peak_mb"]
    with pytest.raises(PlanInputError, match="every block offloaded, activation offloading on"):
        propose(data, dev, floor * 0.99)
