"""``backend/workbench/worker/limits_effect.py``: one ``trainer/limits_effect`` record per request once two steps
after its change step agree; unsettled when they do not within ``MAX_WATCH_STEPS`` or a later
request replaces the watch."""

from __future__ import annotations

from stagehand.common.telemetry import ListSink, Telemetry
from stagehand.config.memory import MB
from workbench.worker.limits_effect import KIND, MAX_WATCH_STEPS, LimitsEffects, StepFigures


def figures(resident: int, h2d_mb: float, peak: float = 2.0) -> StepFigures:
    return StepFigures(resident, round(h2d_mb * MB), 0, peak)


def watcher() -> tuple[LimitsEffects, ListSink]:
    sink = ListSink()
    return LimitsEffects(Telemetry(sink).emit), sink


def test_the_effect_is_written_once_two_steps_after_the_change_step_agree():
    effects, sink = watcher()
    effects.step_done(1, figures(8, 0.0))
    effects.forwarded("a")
    effects.forwarded("b")  # between the same two steps: the same change
    for step, fig in [(2, figures(0, 5.0)), (3, figures(4, 4.0)), (4, figures(4, 2.89))]:
        effects.step_done(step, fig)
    assert not sink.of(*KIND)
    effects.step_done(5, figures(4, 2.89, peak=1.5))
    records = sink.of(*KIND)
    assert [r["request_id"] for r in records] == ["a", "b"]
    assert records[0]["applied_step"] == 2 and records[0]["settled"] is True
    assert records[0]["resident_blocks"] == [8, 4]
    assert records[0]["h2d_mb"] == [0.0, round(2.89 * MB) / MB]
    assert records[0]["vram_peak_mb"] == [2.0, 1.5]
    effects.step_done(6, figures(4, 2.89))
    assert len(sink.of(*KIND)) == 2  # written once


def test_a_watch_that_does_not_settle_or_is_replaced_is_written_unsettled():
    effects, sink = watcher()
    effects.forwarded("first")  # before any step: no "before"
    for step in range(1, MAX_WATCH_STEPS + 2):
        effects.step_done(step, figures(step % 2, 1.0))
    [record] = sink.of(*KIND)
    assert record["settled"] is False and record["steps_watched"] == MAX_WATCH_STEPS
    assert record["resident_blocks"] == [None, 1]

    effects.forwarded("old")
    effects.step_done(20, figures(3, 1.0))
    effects.step_done(21, figures(3, 1.0))
    effects.forwarded("new")
    old = sink.of(*KIND)[-1]
    assert old["request_id"] == "old" and old["settled"] is False and old["steps_watched"] == 1
