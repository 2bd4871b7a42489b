"""The Ray executor against a real local Ray cluster (loopback), and the executor seam.

One cluster for the module (start-up ~4 s, 2 CPUs); every run is submitted as a Ray job by a real
``workbench serve --executor ray``: a real ``workbench train`` of ``tiny-ci`` where the runs'
telemetry and outputs are the point, the synthetic worker of the dashboard tests (the trainer's
records per docs/contracts.md, a step of sleep, no torch) where the jobs' control is: two tiny-ci
workers training for as long as that test runs took ~17 CPU-seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from backend_helpers import (
    REPO,
    file_records,
    stored_records,
    wait_for,
    wait_status,
)

from tests.conftest import CHROMIUM
from workbench.contract.status import TERMINAL

pytest.importorskip("ray.job_submission", reason="the [ray] extra is not installed")

from ray.job_submission import JobSubmissionClient  # noqa: E402
from ray_cluster import RayCluster  # noqa: E402

from stagehand.config.wire import STDOUT_MARKER  # noqa: E402
from workbench.executors.ray_jobs import LogStreamTail, exit_of  # noqa: E402

LONG = {"max_steps": 100000}


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = RayCluster().start()
    print(f"\nRay head up in {cluster.start_s:.1f} s at {cluster.address}")
    yield cluster
    cluster.stop()


def ray_server(server_factory, cluster, *args, env=None):
    return server_factory(
        args=("--executor", "ray", "--ray-address", cluster.address, *args), env=env
    ).start()


def create(client, overrides=None):
    resp = client.post("/api/runs", json={"preset": "tiny-ci", "overrides": overrides or {}})
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


def worker_pid(data_dir, run_id) -> int:
    started = [r for r in file_records(data_dir, run_id) if r["kind"] == "run_started"]
    return started[-1]["pid"]


def steps(client, run_id) -> int:
    params = {"source": "trainer", "kind": "step"}
    return client.get(f"/api/runs/{run_id}/telemetry", params=params).json()["count"]


@pytest.mark.slow
def test_two_runs_on_ray_stream_their_telemetry_from_the_job_log(
    server_factory, ray_cluster, request
):
    srv = ray_server(server_factory, ray_cluster, "--ray-telemetry", "log")
    client = srv.client()
    system = client.get("/api/system").json()
    assert system["executor"] == "ray"
    cluster = system["cluster"]
    assert cluster["reachable"] and cluster["nodes_alive"] == 1, cluster
    assert cluster["cpus_total"] == 2 and cluster["gpus_total"] == 0
    node_ip = cluster["nodes"][0]["ip"]

    first, second = create(client, {"max_steps": 40}), create(client, {"max_steps": 6})
    jobs = JobSubmissionClient(ray_cluster.address)

    def live_records():
        # Records arrive while the job runs (the live log stream, not only the full read that
        # follows the job's end): Ray still says RUNNING after the server held 20 of them.
        run = client.get(f"/api/runs/{first}").json()
        if run["status"] != "running" or run["last_seq"] < 20:
            return None
        return jobs.get_job_status(run["job_id"]) == "RUNNING" and run

    live = wait_for(live_records, 240, 0.1, "records of a running Ray job")
    assert live["executor"] == "ray" and live["job_id"].startswith(f"workbench-run-{first}-")
    for run_id in (first, second):
        done = wait_status(client, run_id, TERMINAL, timeout=240)
        assert done["status"] == "succeeded", done
        assert done["node"] == node_ip and done["exit_code"] == 0
        assert jobs.get_job_status(done["job_id"]) == "SUCCEEDED"
        # The server never read the run folder: the records came from the job's log. They
        # are the folder's JSONL line for line, each once.
        stored = stored_records(client, run_id)
        assert stored == file_records(srv.data_dir, run_id)
        assert [r["seq"] for r in stored] == list(range(len(stored)))
        assert stored[-1]["kind"] == "run_finished"
        assert (srv.data_dir / "runs" / str(run_id) / "lora").is_dir()
    assert done["summary"]["steps_done"] == 6

    # The dashboard: the cluster in the system strip, the node on the run page (the test
    # process's one chromium, tests/conftest.py's ``browser``).
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed: the dashboard part is not checked")
    page = request.getfixturevalue("browser").new_page()
    try:
        page.goto(f"{srv.url}/#/runs/{first}")
        page.wait_for_selector("#system-strip [data-key=cluster]", timeout=30_000)
        strip = page.text_content("#system-strip [data-key=cluster]")
        assert strip == "Ray 1 node, no GPUs, CPUs 0/2 used", strip
        page.wait_for_selector("#fact-node", timeout=30_000)
        assert page.text_content("#fact-node .fact-value") == f"{node_ip} (ray)"
    finally:
        page.close()


@pytest.mark.slow
def test_kill_restart_and_cancel_on_ray(server_factory, ray_cluster):
    # Shared-folder telemetry; a cancel goes to stop_job at once (no grace for the stop file).
    env = {
        "STAGEHAND_WORKBENCH_STOP_GRACE_S": "0",
        "STAGEHAND_WORKBENCH_WORKER_MODULE": "tests.frontend.synthetic_worker",
    }
    synthetic = ("--ray-runtime-env", json.dumps({"env_vars": {"PYTHONPATH": str(REPO)}}))
    srv = ray_server(server_factory, ray_cluster, *synthetic, env=env)
    client = srv.client()
    # The synthetic worker leaves the stop request unanswered: else it could see it and end
    # with exit 0 before stop_job's SIGTERM reached it (Ray: SUCCEEDED, no signal; seen once
    # in three runs after the browser tests in one process).
    hung = {**LONG, "description": "ignore_stop=1"}
    kept, killed = create(client, hung), create(client, hung)
    for run_id in (kept, killed):
        wait_for(lambda r=run_id: steps(client, r) >= 2, 240, 0.2, f"steps of run {run_id}")
    job_of = {i: client.get(f"/api/runs/{i}").json()["job_id"] for i in (kept, killed)}

    # The server dies; while nobody watches, one job's worker is killed and Ray marks it
    # failed; the other job keeps training.
    srv.stop(signal.SIGKILL)
    os.kill(worker_pid(srv.data_dir, killed), signal.SIGKILL)
    jobs = JobSubmissionClient(ray_cluster.address)
    wait_for(lambda: jobs.get_job_status(job_of[killed]) == "FAILED", 60, 0.2, "Ray: FAILED")

    srv2 = ray_server(server_factory, ray_cluster, *synthetic, env=env)
    client = srv2.client()
    gone = wait_status(client, killed, TERMINAL, timeout=60)
    assert gone["status"] == "killed" and gone["signal"] == "SIGKILL", gone
    assert gone["exit_code"] == -9
    assert "SIGKILL" in gone["error"]["message"] and "exit code 137" in gone["error"]["message"]
    assert stored_records(client, killed) == file_records(srv2.data_dir, killed)

    alive = client.get(f"/api/runs/{kept}").json()
    assert alive["status"] == "running" and alive["job_id"] == job_of[kept], alive
    before = alive["last_seq"]
    wait_for(lambda: client.get(f"/api/runs/{kept}").json()["last_seq"] > before + 5, 120)
    assert client.post(f"/api/runs/{kept}/cancel").status_code == 200
    final = wait_status(client, kept, TERMINAL, timeout=120)
    assert final["status"] == "cancelled" and final["signal"] == "SIGTERM", final
    assert jobs.get_job_status(job_of[kept]) == "STOPPED"
    stored = stored_records(client, kept)
    assert stored == file_records(srv2.data_dir, kept)
    assert [r["seq"] for r in stored] == list(range(len(stored)))


# -- without a cluster ------------------------------------------------------------------------
class ReplayingClient:
    """A job client whose log stream drops after ``cut`` chunks and, on reconnect, sends the
    log from its start again, as Ray's ``tail_job_logs`` does."""

    def __init__(self, log: str, cut: int) -> None:
        self.log, self.cut, self.connects = log, cut, 0

    async def tail_job_logs(self, sid):
        self.connects += 1
        chunks = [self.log[i : i + 37] for i in range(0, len(self.log), 37)]  # torn lines
        for i, chunk in enumerate(chunks):
            if self.connects == 1 and i == self.cut:
                raise ConnectionError("websocket dropped")
            yield chunk

    def get_job_status(self, sid):
        class Done:
            def is_terminal(self):
                return True

        return Done()

    def get_job_logs(self, sid):
        return self.log


def test_log_stream_delivers_each_record_once_across_reconnects_and_restarts(monkeypatch):
    monkeypatch.setattr("workbench.executors.ray_jobs.RECONNECT_S", 0.0)
    records = [{"seq": i, "time": 1.0 + i, "source": "trainer", "kind": "step"} for i in range(40)]
    lines = []
    for rec in records:
        lines.append(f"step {rec['seq']} of the progress printout")
        lines.append(STDOUT_MARKER + json.dumps(rec, separators=(",", ":")))
    log = "\n".join(lines) + "\n"
    client = ReplayingClient(log, cut=30)
    tail = LogStreamTail(client, "job", after_seq=-1)
    tail.finish()
    got = tail.read()
    assert client.connects == 2  # it did reconnect, and the replay's repeats were dropped
    assert [ln.seq for ln in got] == list(range(40))
    assert [ln.raw for ln in got] == [ln[len(STDOUT_MARKER) :] for ln in lines[1::2]]
    assert tail.streamed == 40 and tail.recovered == 0

    # A server restarted after storing up to seq 24 resumes after it.
    tail = LogStreamTail(ReplayingClient(log, cut=-1), "job", after_seq=24)
    tail.finish()
    assert [ln.seq for ln in tail.read()] == list(range(25, 40))


def test_job_status_becomes_the_workers_exit():
    assert exit_of("SUCCEEDED", 0, "Job finished successfully.").rc == 0
    killed = exit_of("FAILED", 137, "Job entrypoint command failed with exit code 137, last...")
    assert killed.rc == -9 and "exit code 137" in killed.reason
    assert exit_of("FAILED", 1, "failed").rc == 1
    assert exit_of("FAILED", None, "Node died").rc is None
    assert exit_of("STOPPED", None, "Job was intentionally stopped.").rc == -signal.SIGTERM
    assert exit_of("RUNNING", None, None) is None and exit_of("PENDING", None, None) is None


def serve(capsys, *args: str) -> tuple[int, str]:
    """``workbench serve --no-browser ARGS`` in this process (each refusal here comes before
    the server would start; a real process refusing to start, with its exit code, is
    ``test_security.test_other_address_without_token_refuses_to_start``): ``(exit code,
    stderr)``."""
    from workbench.cli import main

    capsys.readouterr()
    try:
        rc = main(["serve", "--no-browser", *args])
    except SystemExit as exc:  # argparse's refusals
        rc = exc.code
    return rc, capsys.readouterr().err


def test_serve_refuses_bad_executor_settings_naming_them(tmp_path, capsys):
    data = ("--data-dir", str(tmp_path / "d"), "--port", "1")
    rc, err = serve(capsys, "--executor", "ray", *data)
    assert rc == 2 and "ray_address" in err, err
    ray = ("--executor", "ray", "--ray-address", "http://127.0.0.1:9")
    rc, err = serve(capsys, *ray, "--ray-runtime-env", "{", *data)
    assert rc == 2 and "--ray-runtime-env: not JSON" in err, err
    rc, err = serve(capsys, *ray, "--ray-runtime-env", "[1]", *data)
    assert rc == 2 and "ray_runtime_env: expected a JSON object" in err
    rc, err = serve(capsys, *ray, *data)
    assert rc == 2 and "ray_address: no Ray job API answers" in err, err
    rc, err = serve(capsys, "--executor", "slurm", *data)
    assert rc == 2 and "--executor" in err


def test_the_local_executor_never_imports_ray(tmp_path):
    code = (
        "import sys\n"
        "from fastapi.testclient import TestClient\n"
        "from workbench.api.app import create_app\n"
        "from workbench.services.settings import Settings\n"
        f"with TestClient(create_app(Settings(data_dir={str(tmp_path)!r})), base_url='http://127.0.0.1:8000') as c:\n"
        "    info = c.get('/api/system').json()\n"
        "assert info['executor'] == 'local' and info['cluster'] is None, info\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_run_of_the_other_executor_is_settled_naming_both(tmp_path):
    """A server restarted with --executor local finds a run a Ray server left running: it
    cannot follow the job, so the run is crashed (never left running) and the error says how
    to follow it."""
    import asyncio

    from workbench.executors.local import LocalExecutor
    from workbench.services.hub import Hub
    from workbench.services.settings import Settings
    from workbench.services.supervisor import Supervisor
    from workbench.services.tailer import Tailer
    from workbench.store import Store

    settings = Settings(data_dir=tmp_path)
    store = Store(settings.db_path)
    run_id = store.create_run("r", "tiny-ci", {}, "default")
    store.update_run(run_id, status="running", executor="ray", job_id="workbench-run-1-abc")
    (settings.runs_dir / str(run_id)).mkdir(parents=True)
    tailer = Tailer(store, Hub(asyncio.new_event_loop()))
    changed = []
    Supervisor(settings, store, tailer, changed.append, LocalExecutor(settings)).reconcile()
    run = store.get_run(run_id)
    assert run["status"] == "crashed" and changed == [run_id]
    assert "started by the ray executor" in run["error"]["message"]
    assert "serve with --executor ray to follow it" in run["error"]["message"]
