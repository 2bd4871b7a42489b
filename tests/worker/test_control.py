"""Stop through the control folder and through SIGTERM: the step finishes, the LoRA is saved,
the worker exits 0 with status cancelled; a stop request then draws the final samples, a SIGTERM
does not (and ends them while they are drawn). Limits requests reach the strategy."""

import json
import os
import signal
import time

import pytest

from workbench.contract.control import ControlDir
from workbench.worker.control import Interrupted, StopFlag

LONG = {"max_steps": 100000, "checkpoint_every": None}
SAMPLES = {"samples": {"prompts": ["a handwritten digit three"], "steps": 2}}


def _wait_for(run_dir, proc, run_io, source, kind, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        if (run_dir / "telemetry.jsonl").exists():
            found = run_io.of(run_io.records(run_dir), source, kind)
            if found:
                return found
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"the worker wrote no {source}/{kind} record")


def _request(run_dir, n, request_id, body):
    control = run_dir / "control"
    tmp = control / f".tmp-{request_id}"
    tmp.write_text(json.dumps({"request_id": request_id, **body}))
    os.rename(tmp, control / f"{n:06d}-{request_id}.json")


def _finish(proc, run_dir, run_io):
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    recs = run_io.records(run_dir)
    last = recs[-1]
    assert last["kind"] == "run_finished" and last["status"] == "cancelled", last
    assert last["steps_done"] >= 1
    assert (run_dir / last["lora_path"]).stat().st_size > 0
    return recs, last


def test_stop_request_saves_the_lora_and_exits_cancelled(cache_env, make_preset, tmp_path, run_io):
    run_dir = tmp_path / "stopped"
    proc = run_io.start_worker(make_preset(**LONG, **SAMPLES), run_dir, cache_env)
    _wait_for(run_dir, proc, run_io, "trainer", "step")
    _request(run_dir, 1, "lim1", {"command": "limits", "limits": {"prefetch_window_blocks": 2}})
    _request(run_dir, 2, "bad", {"command": "limits", "limits": {"no_such_limit": 1}})
    # Limits apply at the next STEP_BEGIN: wait for the acknowledgement before stopping.
    _wait_for(run_dir, proc, run_io, "strategy", "limits_applied")
    _request(run_dir, 3, "stop1", {"command": "stop"})
    recs, last = _finish(proc, run_dir, run_io)
    assert last["stop_reason"] == "stop"
    assert list((run_dir / "control").iterdir()) == []  # every request consumed
    applied = run_io.of(recs, "strategy", "limits_applied")
    rejected = [r for r in run_io.of(recs, "trainer", "event") if r["event"] == "control_rejected"]
    assert [r["request_id"] for r in applied] == ["lim1"]
    assert applied[0]["changed"] == {"prefetch_window_blocks": [1, 2]}  # tiny-ci has 1
    assert [r["request_id"] for r in rejected] == ["bad"]
    assert "no_such_limit" in rejected[0]["message"]
    # The model it trained is drawn (before: the step-0 samples only), after the LoRA is saved:
    # a kill during the samples loses no step.
    paths = [r["path"] for r in run_io.of(recs, "trainer", "sample")]
    assert paths == ["samples/step-000000-00.png", "samples/sample-00.png"]
    final = run_dir / "samples" / "sample-00.png"
    assert (run_dir / last["lora_path"]).stat().st_mtime <= final.stat().st_mtime
    assert all(r["event"] != "final_samples_skipped" for r in run_io.of(recs, "trainer", "event"))


def test_sigterm_saves_the_lora_and_exits_cancelled(cache_env, make_preset, tmp_path, run_io):
    run_dir = tmp_path / "terminated"
    proc = run_io.start_worker(make_preset(**LONG, **SAMPLES), run_dir, cache_env)
    _wait_for(run_dir, proc, run_io, "trainer", "step")
    proc.send_signal(signal.SIGTERM)
    recs, last = _finish(proc, run_dir, run_io)
    assert last["stop_reason"] == "sigterm"
    steps = run_io.of(recs, "trainer", "step")
    assert steps[-1]["step"] == last["steps_done"]  # the step in flight finished
    # SIGTERM means now (the server's escalation, the machine going down): no final samples.
    paths = [r["path"] for r in run_io.of(recs, "trainer", "sample")]
    assert paths == ["samples/step-000000-00.png"]
    events = [r for r in run_io.of(recs, "trainer", "event") if r["event"] != "control_rejected"]
    assert [(e["event"], e["message"]) for e in events] == [
        ("final_samples_skipped", "the run was stopped by SIGTERM")
    ]


def test_sigterm_ends_interruptible_work_and_only_sets_the_flag_elsewhere():
    flag = StopFlag()
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # outside: the loop sees the flag between steps
        assert flag() and flag.terminated and flag.reason == "sigterm"
        reached = False
        with pytest.raises(Interrupted), flag.interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs at the next bytecode
                time.sleep(0.001)
            reached = True
        assert not reached
        os.kill(os.getpid(), signal.SIGTERM)  # the block is over: a flag again, no exception
    finally:
        flag.uninstall()


def test_control_dir_reads_in_name_order_and_skips_temp_names(tmp_path):
    control = ControlDir(tmp_path)
    (control.path / ".tmp-x").write_text("{}")
    (control.path / "000002-b.json").write_text('{"command": "stop"}')
    (control.path / "000001-a.json").write_text('{"command": "limits", "limits": {}}')
    (control.path / "000003-c.json").write_text("not json")
    got = control.poll()
    assert [(r.name, r.command, r.request_id) for r in got] == [
        ("000001-a.json", "limits", "a"),
        ("000002-b.json", "stop", "b"),
        ("000003-c.json", None, "c"),
    ]
    assert got[2].error.startswith("JSONDecodeError")
    assert [p.name for p in control.path.iterdir()] == [".tmp-x"]


def test_stop_flag_keeps_the_first_reason():
    flag = StopFlag()
    assert not flag()
    flag.set("sigterm")
    flag.set("stop")
    assert flag() and flag.reason == "sigterm"
