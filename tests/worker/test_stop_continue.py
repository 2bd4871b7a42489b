"""A stopped run can be continued, and no record of it lies past the step it stopped at; a
limits request sent while the worker starts is held and applied at the first step.

The runs are tiny-ci in this process (``workbench.worker.run.Run``), with a real control folder: the stop
request is written once the wanted number of steps ran (a subclass's ``poll_control``), so the
step a run stops at does not depend on timing."""

import json

import torch

from workbench.contract.control import write_request
from workbench.worker.cli import main
from workbench.worker.run import Run

SAMPLES = {"samples": {"prompts": ["a handwritten digit three"], "steps": 2}}


class StopAfter(Run):
    """A run whose control folder receives a stop request once ``after`` steps are done."""

    def __init__(self, *args, after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.after, self.sent = after, False

    def poll_control(self):
        if not self.sent and self.steps_done >= self.after:
            write_request(self.run_dir, 1, {"command": "stop"})
            self.sent = True
        return super().poll_control()


class LimitsWhileStarting(Run):
    """A run that reads a limits request before its strategy exists (while stage 1 runs, as a
    user's Apply during "starting worker" arrives)."""

    def stage1(self, *args, **kwargs):
        limits = {"prefetch_window_blocks": 2}
        write_request(
            self.run_dir, 1, {"command": "limits", "limits": limits, "request_id": "early"}
        )
        assert self.poll_control() is None
        return super().stage1(*args, **kwargs)


def _execute(run: Run) -> str:
    try:
        return run.execute()
    finally:
        run.stop.uninstall()
        run.progress.close()
        run.telemetry.close()


def _losses(recs, of) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in of(recs, "trainer", "step")}


def test_a_stopped_run_leaves_a_checkpoint_and_continues_with_the_same_losses(
    cache_env, make_preset, tmp_path, run_io
):
    preset = make_preset(max_steps=6, checkpoint_every=None, **SAMPLES)
    reference = tmp_path / "reference"
    assert main([str(preset), "--run-dir", str(reference)]) == 0

    run_dir = tmp_path / "stopped"
    run_dir.mkdir()
    status = _execute(StopAfter(str(preset), run_dir, torch.device("cpu"), False, after=3))
    assert status == "cancelled"
    recs = run_io.records(run_dir)
    last = recs[-1]
    assert (last["kind"], last["steps_done"], last["stop_reason"]) == ("run_finished", 3, "stop")
    # What Continue needs: the checkpoint of the last step trained (checkpoint_every is off).
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-3"]
    # The final samples are drawn, and no record of the run is stamped past step 3 (they were
    # stamped max_steps + 1 = 7: the per-step charts drew lines to a step that never ran).
    stamped = [r["step"] for r in recs if r.get("step") is not None]
    assert max(stamped) == 3, sorted(set(stamped))
    paths = [r["path"] for r in run_io.of(recs, "trainer", "sample")]
    assert paths == ["samples/step-000000-00.png", "samples/sample-00.png"]
    # The end's sampling steps are tagged, like those during training: charts leave them out.
    final_steps = [r for r in run_io.of(recs, "stagehand", "step") if r["step"] == 3]
    assert final_steps and all(r.get("sampling") for r in final_steps[1:])

    # Continue: the same folder, from its own config.json, as POST /api/runs/{id}/resume.
    config = json.loads((run_dir / "config.json").read_text())
    assert config["max_steps"] == 6
    assert main([str(run_dir / "config.json"), "--run-dir", str(run_dir), "--resume"]) == 0
    recs = run_io.records(run_dir)
    assert recs[-1]["status"] == "succeeded" and recs[-1]["steps_done"] == 6
    want = _losses(run_io.records(reference), run_io.of)
    assert sorted(want) == [1, 2, 3, 4, 5, 6]
    assert _losses(recs, run_io.of) == want


def test_limits_sent_while_the_worker_starts_apply_at_the_first_step(
    cache_env, make_preset, tmp_path, run_io
):
    run_dir = tmp_path / "early"
    run_dir.mkdir()
    preset = make_preset(max_steps=2, checkpoint_every=None)
    run = LimitsWhileStarting(str(preset), run_dir, torch.device("cpu"), False)
    assert _execute(run) == "succeeded"
    recs = run_io.records(run_dir)
    events = [r for r in run_io.of(recs, "trainer", "event") if r["event"] == "control_rejected"]
    assert events == []  # before: "command 'limits' not understood (or no strategy yet)"
    applied = [
        r for r in run_io.of(recs, "strategy", "limits_applied") if r["request_id"] == "early"
    ]
    assert [(r["step"], r["changed"]) for r in applied] == [(1, {"prefetch_window_blocks": [1, 2]})]
    steps = run_io.of(recs, "stagehand", "step")
    assert {r["step"]: r["prefetch_window_blocks"] for r in steps if r["step"] >= 1} == {1: 2, 2: 2}


def test_limits_held_by_a_run_that_ends_before_its_first_step_are_refused(
    make_preset, tmp_path, run_io
):
    run_dir = tmp_path / "ended"
    run_dir.mkdir()
    run = Run(str(make_preset()), run_dir, torch.device("cpu"), False)
    write_request(run_dir, 1, {"command": "limits", "limits": {"prefetch_window_blocks": 2}})
    assert run.poll_control() is None
    run.telemetry.flush()
    assert _rejected(run_dir, run_io) == []  # held, not refused for want of a strategy
    run.finish("cancelled", {})
    run.telemetry.close()
    assert _rejected(run_dir, run_io) == ["the run ended before its first step"]


def _rejected(run_dir, run_io) -> list[str]:
    if not (run_dir / "telemetry.jsonl").exists():
        return []
    recs = run_io.records(run_dir)
    return [r["message"] for r in recs if r.get("event") == "control_rejected"]
