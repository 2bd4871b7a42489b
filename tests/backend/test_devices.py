"""A run's device: named in ``POST /api/runs``, passed to the worker as ``--device``, and the
key of the ``--max-parallel`` slots (runs on one device queue, runs on another start)."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest
from pydantic import ValidationError

from workbench.api.models import RunCreate
from workbench.executors.local import LocalExecutor
from workbench.services.hub import Hub
from workbench.services.settings import Settings
from workbench.services.supervisor import Supervisor
from workbench.services.tailer import Tailer
from workbench.store import Store
from workbench.worker.cli import device_arg, pick_device

SLOW = {"name": "slow", "max_steps": 1000, "description": "step_s=5"}


def test_the_run_request_names_a_device_or_auto():
    assert RunCreate(preset="p").device == "auto"
    assert RunCreate(preset="p", device="cuda").device == "cuda:0"
    assert RunCreate(preset="p", device="cuda:1").device == "cuda:1"
    with pytest.raises(ValidationError) as err:
        RunCreate(preset="p", device="gpu")
    (problem,) = err.value.errors()
    assert problem["loc"] == ("device",)
    assert "'gpu'" in problem["msg"] and '"cuda:N"' in problem["msg"]


def test_the_worker_checks_its_device():
    assert device_arg("cuda") == "cuda:0"
    assert str(pick_device("cpu")) == "cpu"
    with pytest.raises(SystemExit, match=r"--device cuda:7 but this machine has \d+ CUDA device"):
        pick_device("cuda:7" if not _has_eight_gpus() else "cuda:99")


def _has_eight_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 7


@pytest.mark.parametrize(
    ("default_device", "started"),
    [
        # auto is the probe's cuda:0, so it shares cuda:0's one slot; cpu has a slot of its own.
        ("cuda:0", {"auto", "cpu"}),
        # No answer from the probe yet: one shared slot for every run.
        (None, {"auto"}),
    ],
)
def test_max_parallel_counts_runs_per_device(tmp_path, default_device, started):
    # Started cold: a fork server would import the trainer (~7 CPU-s) for workers that never
    # import torch.
    settings = Settings(
        data_dir=tmp_path,
        max_parallel=1,
        worker_module="tests.frontend.synthetic_worker",
        fork_server=False,
    )
    store = Store(settings.db_path)
    ids = {}
    for device in ("auto", "cuda:0", "cpu", "cpu"):
        run_id = store.create_run(device, "slow", SLOW, device)
        ids.setdefault(device, run_id)
        run_dir = settings.runs_dir / str(run_id)
        run_dir.mkdir(parents=True)
        (run_dir / "config.json").write_text(json.dumps(SLOW))
    executor = LocalExecutor(settings)
    supervisor = Supervisor(
        settings,
        store,
        Tailer(store, Hub(asyncio.new_event_loop())),
        lambda run_id: None,
        executor,
        default_device=lambda: default_device,
    )
    supervisor._launch_queued()
    jobs = dict(supervisor._workers)
    try:
        assert {store.get_run(i)["device"] for i in jobs} == started
        assert len(jobs) == len(started)  # the second cpu run and the cuda:0 run wait
        for run_id, job in jobs.items():
            argv = list(job.state["child"].args)  # the command line the worker was started with
            device = store.get_run(run_id)["device"]
            if device == "auto":
                assert "--device" not in argv  # the worker's own choice
            else:
                assert argv[argv.index("--device") + 1] == device
        assert store.get_run(ids["cuda:0"])["status"] == "queued"
    finally:
        for job in jobs.values():
            executor.signal(job, signal.SIGKILL)
            job.state["child"].wait(timeout=30)
