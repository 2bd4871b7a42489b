"""Run status: one enum with its legal moves, checked by the store before anything is written."""

from __future__ import annotations

import json

import pytest
from inprocess import IdleExecutor, in_process

from workbench.contract.status import (
    ACTIVE,
    LEGAL_NEXT,
    RESUMABLE,
    TERMINAL,
    RunStatus,
    RunStatusError,
    check_status_transition,
)
from workbench.services.run_files import write_run_config
from workbench.store import Store


def test_every_status_has_its_moves_and_only_an_unfinished_ending_resumes():
    assert set(LEGAL_NEXT) == set(RunStatus)
    assert LEGAL_NEXT[RunStatus.SUCCEEDED] == frozenset()  # a finished run stays finished
    assert {s for s, nxt in LEGAL_NEXT.items() if RunStatus.QUEUED in nxt} == set(RESUMABLE)
    assert ACTIVE | TERMINAL | {RunStatus.QUEUED} == set(RunStatus)
    check_status_transition("stalled", "running")  # records again
    with pytest.raises(RunStatusError, match="a succeeded run may become nothing, not queued"):
        check_status_transition("succeeded", "queued")
    with pytest.raises(RunStatusError, match="must be one of queued, running"):
        check_status_transition("running", "paused")


def test_the_store_refuses_an_illegal_move_before_writing(tmp_path):
    store = Store(tmp_path / "runs.db")
    run_id = store.create_run("r", "tiny-ci", {}, "auto")
    assert store.set_status_if(run_id, [RunStatus.QUEUED], status=RunStatus.RUNNING)
    assert store.set_status_if(run_id, ["running"], status="succeeded", exit_code=0)
    with pytest.raises(RunStatusError, match="a succeeded run may become nothing, not queued"):
        store.set_status_if(run_id, ["succeeded"], status="queued", exit_code=None)
    run = store.get_run(run_id)
    assert run["status"] == "succeeded" and run["exit_code"] == 0
    # A status not among ``expected`` changes nothing (and is no error).
    assert not store.set_status_if(run_id, ["running"], status="failed")
    store.close()


def test_a_queued_run_is_launched_only_once_its_folder_holds_its_config(tmp_path):
    """The run's row is stored (queued) before ``POST /api/runs`` writes its folder; a
    supervisor tick in between launched it, and the worker's log could not be opened: "could
    not start the worker: No such file or directory: .../worker.log" failed the run (seen in
    CI). A queued run waits for its ``config.json`` (``write_run_config``)."""
    with in_process(tmp_path / "data", IdleExecutor(slots=1)) as client:
        store, supervisor = client.app.state.store, client.app.state.supervisor
        config = {"name": "tiny-ci", "max_steps": 3}
        run_id = store.create_run("between", "tiny-ci", config, None)
        supervisor.tick()
        assert store.get_run(run_id)["status"] == RunStatus.QUEUED
        write_run_config(supervisor.run_dir(run_id), config)
        supervisor.tick()
        assert store.get_run(run_id)["status"] == RunStatus.RUNNING
        assert json.loads((supervisor.run_dir(run_id) / "config.json").read_text()) == config
