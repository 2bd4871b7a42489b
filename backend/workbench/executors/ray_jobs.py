"""The Ray executor: each run is a Ray job (``workbench serve --executor ray``).

Jobs go through ``ray.job_submission.JobSubmissionClient`` against the dashboard's job API
(``--ray-address http://HEAD:8265``): ``submit_job`` with the entrypoint ``python -m
workbench.cli train DIR/config.json --run-dir DIR``, a submission id made from the run id,
``entrypoint_num_cpus`` and, on a cluster with GPUs (unless the run asks for ``cpu``),
``entrypoint_num_gpus=1``; Ray places the job on a node with a free GPU and queues it until
there is one. ``stop_job`` cancels (Ray sends SIGTERM, then SIGKILL), ``get_job_info`` says
when and how it ended and on which node it runs, and after a server restart the submission id
in the store finds the job again.

The run folder is the same path on every node (shared storage): the worker reads its
``config.json`` and the ``control/`` requests there and writes its LoRA, samples and
checkpoints there. Telemetry reaches the store from that folder (``--ray-telemetry folder``,
``JsonlTail``), or from the job's log (``--ray-telemetry log``, ``LogStreamTail``: the worker
also prints every record after ``STDOUT_MARKER``), for a server whose view of the shared
folder lags. Either way each record is stored once: the store keys records by ``(run, seq)``
and the log stream drops what it already delivered by ``seq``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import shlex
import signal
import sys
import threading
import time
import urllib.request
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from stagehand.config.wire import STDOUT_ENV, STDOUT_MARKER, TELEMETRY_FILE
from workbench.executors import Executor, Exit, Job, LaunchError, TelemetrySource, worker_command
from workbench.services.outcome import LOG_TAIL_BYTES
from workbench.services.settings import Settings
from workbench.services.tailer import JsonlTail, Line, parse_line

try:  # the [ray] extra; make_executor imports this module only for --executor ray
    from ray.job_submission import JobStatus, JobSubmissionClient
except ImportError as exc:  # pragma: no cover - exercised by a test that hides ray
    raise LaunchError(
        "--executor ray needs ray's job client: pip install 'stagehand-workbench[ray]'"
    ) from exc

log = logging.getLogger("workbench.executors.ray")

POLL_S = 0.5
"""``get_job_info`` at most this often per job: each is an HTTP request to the head."""
CLUSTER_S = 2.0
"""The cluster's nodes and resources are read at most this often."""
RECONNECT_S = 1.0
"""Pause before reconnecting a log stream that broke while its job ran."""
FINISH_WAIT_S = 10.0
"""After a job ended, how long its log stream may take to deliver its last lines."""


def submission_id(run_id: int) -> str:
    """``workbench-run-<id>-<8 hex>``: the run id, and a suffix because a cluster outlives a
    data folder (two servers' run 1 must not collide)."""
    return f"workbench-run-{run_id}-{uuid.uuid4().hex[:8]}"


def exit_of(status: str, exit_code: int | None, message: str | None) -> Exit | None:
    """The ``Exit`` of a job in ``status`` (None while it is pending or running).

    The entrypoint runs under ``/bin/sh``, which reports a child killed by signal N as exit
    code 128 + N: that becomes ``-N``, as ``Popen`` reports it for the local executor. A job
    stopped through ``stop_job`` ended by SIGTERM (Ray escalates to SIGKILL after its wait).
    A failure without an exit code (the node died, the runtime env could not be set up) has
    an unknown exit; Ray's message says why."""
    first = (message or "").strip().splitlines()[0] if message and message.strip() else None
    if status == JobStatus.SUCCEEDED:
        return Exit(exit_code or 0)
    if status == JobStatus.STOPPED:
        return Exit(-int(signal.SIGTERM), f"Ray job stopped: {first or 'stop_job'}")
    if status == JobStatus.FAILED:
        rc = exit_code
        if rc is not None and 128 < rc <= 128 + 64:
            rc = -(rc - 128)
        return Exit(rc, f"Ray: {first}" if first else "Ray job failed")
    return None


class RayExecutor(Executor):
    """Runs as Ray jobs on the cluster whose job API is ``settings.ray_address``."""

    name = "ray"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.address = str(settings.ray_address).rstrip("/")
        try:
            self.client = JobSubmissionClient(self.address)
        except Exception as exc:
            raise LaunchError(
                f"ray_address: no Ray job API answers at {self.address} ({exc}); start the head "
                "with `ray start --head` (its dashboard serves the job API on port 8265)"
            ) from exc
        self._polled: dict[str, float] = {}
        self._cluster: tuple[float, dict[str, Any]] | None = None
        self._tails: list[LogStreamTail] = []

    # -- jobs ------------------------------------------------------------------------------
    def submit(self, run: dict[str, Any], run_dir: Path) -> Job:
        device = run["device"] or "default"
        sid = submission_id(run["id"])
        cmd = worker_command(sys.executable, self.settings.worker_module, run, run_dir)
        runtime_env = copy.deepcopy(self.settings.ray_runtime_env or {})
        env_vars = {"PYTHONUNBUFFERED": "1", **runtime_env.get("env_vars", {})}
        if self.settings.ray_telemetry == "log":
            env_vars[STDOUT_ENV] = "1"
        runtime_env["env_vars"] = env_vars
        gpus = 1 if device.startswith("cuda") or (device != "cpu" and self._has_gpus()) else 0
        try:
            self.client.submit_job(
                entrypoint=shlex.join(cmd),
                submission_id=sid,
                runtime_env=runtime_env,
                entrypoint_num_cpus=self.settings.ray_num_cpus,
                entrypoint_num_gpus=gpus,
                metadata={"workbench_run": str(run["id"]), "run_dir": str(run_dir)},
            )
        except Exception as exc:
            raise LaunchError(f"Ray did not take job {sid} at {self.address}: {exc}") from exc
        return Job(run["id"], sid, device, run_dir, state={"gpus": gpus})

    def slots(self, max_parallel: int | None) -> float:
        # Ray holds a job PENDING until a node has its CPUs/GPU: no queue of ours by default.
        return max_parallel if max_parallel is not None else float("inf")

    def poll(self, job: Job) -> Exit | None:
        now = time.monotonic()
        if now - self._polled.get(job.key, 0.0) < POLL_S:
            return None
        self._polled[job.key] = now
        try:
            info = self.client.get_job_info(job.key)
        except Exception as exc:  # the head is unreachable for now: keep the job, ask again
            log.warning("run %d: Ray job %s: %s", job.run_id, job.key, exc)
            return None
        if job.node is None and info.driver_node_id:
            job.node = self._node_ip(info.driver_node_id)
        ended = exit_of(info.status, info.driver_exit_code, info.message)
        if ended is not None:
            self._polled.pop(job.key, None)
        return ended

    def signal(self, job: Job, sig: signal.Signals) -> None:
        # One verb on Ray: stop_job sends SIGTERM and SIGKILL after its own wait.
        try:
            self.client.stop_job(job.key)
        except Exception as exc:
            log.warning("run %d: stop_job(%s) failed: %s", job.run_id, job.key, exc)

    def withdraw(self, job: Job) -> None:
        self.signal(job, signal.SIGKILL)

    def adopt(self, run: dict[str, Any], run_dir: Path) -> Job | None:
        sid = run["job_id"]
        if not sid:
            return None
        try:
            self.client.get_job_info(sid)
        except Exception as exc:
            if "does not exist" in str(exc) or "404" in str(exc):
                return None  # a cluster that was restarted forgot it
            log.warning("run %d: Ray job %s unknown for now (%s); adopting", run["id"], sid, exc)
        # Adopted even when it already ended: the next poll settles it with Ray's exit.
        return Job(run["id"], sid, run["device"] or "default", run_dir, node=run["node"])

    def telemetry(self, run: dict[str, Any], run_dir: Path) -> TelemetrySource:
        if self.settings.ray_telemetry == "log" and run.get("job_id"):
            tail = LogStreamTail(self.client, run["job_id"], run["last_seq"], run["tail_offset"])
            self._tails = [t for t in self._tails if not t.closed] + [tail]
            return tail
        return JsonlTail(run_dir / TELEMETRY_FILE, run["tail_offset"] or 0)

    def log_tail(self, job: Job) -> str | None:
        """The end of the job's log without its telemetry lines."""
        if not job.key:
            return None
        try:
            text = self.client.get_job_logs(job.key)
        except Exception:
            return None
        kept = [ln for ln in text.splitlines() if not ln.startswith(STDOUT_MARKER)]
        return "\n".join(kept)[-LOG_TAIL_BYTES:]

    def close(self) -> None:
        for tail in self._tails:
            tail.close()

    # -- the cluster -----------------------------------------------------------------------
    def _get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.address + path, timeout=5) as resp:
            return json.loads(resp.read())

    def cluster(self) -> dict[str, Any]:
        """Nodes (state API ``/api/v0/nodes``) and CPU/GPU use (``/api/cluster_status``)."""
        now = time.monotonic()
        if self._cluster is not None and now - self._cluster[0] < CLUSTER_S:
            return self._cluster[1]
        out: dict[str, Any] = {"executor": "ray", "address": self.address, "reachable": False}
        try:
            listed = self._get("/api/v0/nodes?limit=10000")["data"]["result"]["result"]
            usage = self._get("/api/cluster_status")["data"]["clusterStatus"]
            usage = usage["loadMetricsReport"]["usage"]
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            return out
        nodes = [
            {
                "node_id": n["node_id"],
                "ip": n["node_ip"],
                "alive": n["state"] == "ALIVE",
                "head": bool(n.get("is_head_node")),
                "cpus": float(n.get("resources_total", {}).get("CPU", 0)),
                "gpus": float(n.get("resources_total", {}).get("GPU", 0)),
            }
            for n in listed
        ]
        used = {k: v[0] for k, v in usage.items() if isinstance(v, list) and len(v) == 2}
        alive = [n for n in nodes if n["alive"]]
        out.update(
            reachable=True,
            nodes=nodes,
            nodes_alive=len(alive),
            cpus_total=sum(n["cpus"] for n in alive),
            cpus_used=float(used.get("CPU", 0)),
            gpus_total=sum(n["gpus"] for n in alive),
            gpus_used=float(used.get("GPU", 0)),
        )
        self._cluster = (now, out)
        return out

    def _has_gpus(self) -> bool:
        return self.cluster().get("gpus_total", 0) > 0

    def _node_ip(self, node_id: str) -> str:
        for n in self.cluster().get("nodes", []):
            if n["node_id"] == node_id:
                return n["ip"]
        self._cluster = None  # a node that joined since the last read
        for n in self.cluster().get("nodes", []):
            if n["node_id"] == node_id:
                return n["ip"]
        return node_id[:12]


class LogStreamTail:
    """A run's records from its Ray job's log: ``tail_job_logs`` followed on its own thread.

    Only lines that start with ``STDOUT_MARKER`` are records; a torn last chunk is held back
    until its newline arrives. The stream restarts from the log's beginning on every
    (re)connect, so records with a ``seq`` at or below the last one delivered (or stored
    before a restart: ``after_seq``) are dropped: each record is delivered once. ``finish``
    (the job ended) waits for the stream's end, then reads the whole log once more with
    ``get_job_logs``, which only adds records the stream had not delivered (``recovered``).
    """

    def __init__(
        self, client: Any, sid: str, after_seq: int | None, offset: int | None = 0
    ) -> None:
        self.client, self.sid = client, sid
        self.offset = offset or 0  # the file's byte offset is not this source's to move
        self._last_seq = -1 if after_seq is None else after_seq
        self._lock = threading.Lock()
        self._partial = ""
        self._queue: deque[str] = deque()
        self._late: deque[str] = deque()
        self._retry: list[Line] = []
        self._ended = threading.Event()
        self._stop = threading.Event()
        self.closed = False
        self.streamed = 0
        """Records delivered from the live stream."""
        self.recovered = 0
        """Records only ``finish``'s full read found (the stream had dropped them)."""
        self._thread = threading.Thread(target=self._run, name=f"ray-log-{sid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self._follow())
        finally:
            self._ended.set()

    async def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                async for chunk in self.client.tail_job_logs(self.sid):
                    self.feed(chunk)
                    if self._stop.is_set():
                        return
                if self.client.get_job_status(self.sid).is_terminal():
                    return
            except Exception as exc:
                log.warning("log stream of Ray job %s: %s; reconnecting", self.sid, exc)
            with self._lock:
                self._partial = ""  # the next connection re-sends the log from its start
            await asyncio.sleep(RECONNECT_S)

    def feed(self, chunk: str, queue: deque[str] | None = None) -> None:
        """Add text from the log; its complete marker lines are queued."""
        with self._lock:
            queue = self._queue if queue is None else queue
            lines = (self._partial + chunk).split("\n")
            self._partial = lines.pop()
            for line in lines:
                if line.startswith(STDOUT_MARKER):
                    queue.append(line[len(STDOUT_MARKER) :].rstrip("\r"))

    def read(self) -> list[Line]:
        with self._lock:
            out, self._retry = self._retry, []
            # The stream's lines first, then those of finish's full read: both in seq order.
            for queue, counter in ((self._queue, "streamed"), (self._late, "recovered")):
                while queue:
                    line = parse_line(queue.popleft())
                    if line is None or line.seq <= self._last_seq:
                        continue
                    self._last_seq = line.seq
                    setattr(self, counter, getattr(self, counter) + 1)
                    out.append(line)
        return out

    def rewind(self, offset: int, lines: list[Line]) -> None:
        with self._lock:
            self._retry = lines + self._retry

    def finish(self) -> None:
        self._ended.wait(FINISH_WAIT_S)
        self._stop.set()
        try:
            text = self.client.get_job_logs(self.sid)
        except Exception as exc:
            log.warning("Ray job %s: full log unavailable (%s)", self.sid, exc)
            return
        with self._lock:
            self._partial = ""
        # A last line without its newline is a record torn by a killed worker: parse_line
        # drops it, as JsonlTail never delivers it.
        self.feed(text + "\n", self._late)
        n_late = len(self._late)
        log.info(
            "Ray job %s: log stream delivered %d records; full log holds %d",
            self.sid,
            self.streamed,
            n_late,
        )

    def close(self) -> None:
        self._stop.set()
        self.closed = True
