"""A run's outcome from its worker's exit and its last records."""

from __future__ import annotations

from pathlib import Path


def test_outcome_from_exit_and_last_records():
    from workbench.services.outcome import classify

    fin = {"seq": 9, "source": "trainer", "kind": "run_finished", "status": "cancelled"}
    err = {
        "seq": 5,
        "source": "trainer",
        "kind": "error",
        "step": 3,
        "message": "CUDA out of memory",
        "error_type": "OutOfMemoryError",
        "traceback": "Traceback...",
        "oom": True,
    }
    step = {"seq": 4, "source": "trainer", "kind": "step", "step": 3}
    kw = {"tail": "log", "pid": 42}
    killed = classify(-9, cancel_requested=False, finished=None, last=step, **kw)
    assert (killed["status"], killed["signal"]) == ("killed", "SIGKILL")
    assert (
        classify(-15, cancel_requested=True, finished=None, last=step, **kw)["status"]
        == "cancelled"
    )
    assert classify(0, cancel_requested=True, finished=fin, last=fin, **kw)["status"] == "cancelled"
    assert classify(None, cancel_requested=False, finished=fin, last=fin, **kw)["error"] is None
    failed = classify(1, cancel_requested=False, finished=None, last=err, **kw)
    assert failed["status"] == "failed" and failed["error"]["oom"] is True
    assert failed["error"]["message"] == "CUDA out of memory"
    crashed = classify(
        None, cancel_requested=False, finished=None, last=step, gone_at_start=True, **kw
    )
    assert crashed["status"] == "crashed"
    assert (
        "pid 42" in crashed["error"]["message"]
        and "trainer/step at step 3 (seq 4)" in crashed["error"]["message"]
    )
    early = classify(2, cancel_requested=False, finished=None, last=None, **kw)
    assert early["status"] == "failed" and early["error"]["log_tail"] == "log"
    assert "code 2 after no telemetry" in early["error"]["message"]
    removed = classify(
        1, cancel_requested=False, finished=None, last=step, **kw, missing_dir=Path("/d/7")
    )
    assert removed["status"] == "failed" and removed["error"]["message"] == (
        "the run folder /d/7 no longer exists (removed while the run was going?); worker exited "
        "with code 1 after trainer/step at step 3 (seq 4)"
    )
