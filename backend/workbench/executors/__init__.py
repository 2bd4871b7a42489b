"""Where a run's worker runs: one ``Executor`` interface, two implementations.

The supervisor (``workbench.services.supervisor``) owns the queue, cancel escalation, stall detection and
exit classification; an executor only starts a worker, says whether it ended (and how), sends it
a signal, finds it again after a server restart and names the stream its telemetry arrives on:

- ``local`` (``workbench.executors.local``): a subprocess of the server, in its own session;
  telemetry tailed from ``DIR/telemetry.jsonl``. The default.
- ``ray`` (``workbench.executors.ray_jobs``): a Ray job per run through
  ``ray.job_submission.JobSubmissionClient``; Ray places it and accounts for its GPU; telemetry
  from the shared run folder or from the job's log stream. Imported only when chosen, so ray
  is an optional extra (``pip install stagehand-workbench[ray]``).

``workbench.executors.factory.make_executor`` builds the one a server's settings name.
"""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from stagehand.config.memory import AUTO_DEVICE
from workbench.services.run_files import CONFIG_FILE
from workbench.services.tailer import Line

EXECUTORS = ("local", "ray")


class LaunchError(Exception):
    """The executor could not start a worker (the message says why)."""


def worker_command(
    python: str, worker_module: str, run: dict[str, Any], run_dir: Path
) -> list[str]:
    """The worker's command line for ``run`` (a store row), the same for every executor:
    ``workbench train DIR/config.json --run-dir DIR``, with ``--resume`` for a run re-queued to
    continue from its last checkpoint (``POST /api/runs/{id}/resume``) and ``--device`` for a run
    that names one (``"auto"`` and rows from before the field, ``"default"``, leave the worker's
    own choice)."""
    cmd = [python, "-m", worker_module, "train", str(run_dir / CONFIG_FILE)]
    cmd += ["--run-dir", str(run_dir)]
    if run.get("resume"):
        cmd.append("--resume")
    if run.get("device") not in (None, "", "default", AUTO_DEVICE):
        cmd += ["--device", run["device"]]
    return cmd


@dataclass
class Exit:
    """How a worker ended. ``rc``: its exit code, negative for a signal, None when unknown
    (a worker the server did not start); ``reason``: the executor's own words, if any."""

    rc: int | None
    reason: str | None = None


@dataclass
class Job:
    """A live worker of a run, as the supervisor tracks it.

    ``key`` is the executor's name for it (a pid for ``local``, a submission id for ``ray``);
    ``state`` holds what only the executor reads (a ``Popen``, a ``psutil.Process``).
    """

    run_id: int
    key: str
    device: str
    run_dir: Path
    node: str | None = None
    state: dict[str, Any] = field(default_factory=dict)
    cancel_at: float | None = None
    sent_term: bool = False
    sent_kill: bool = False

    @property
    def pid(self) -> int | None:
        return int(self.key) if self.key.isdigit() else None


class TelemetrySource(Protocol):
    """Where a run's records come from (``workbench.services.tailer.Tailer`` polls it).

    ``read`` returns the complete records that arrived since the last call, each once;
    ``offset`` is what the store keeps to resume from after a restart (a byte offset into the
    run's ``telemetry.jsonl``); ``rewind`` makes the next ``read`` return ``lines`` again (their
    ingest failed); ``finish`` is called once the worker ended, before the last ``read``s, and
    waits until everything the worker wrote can be read.
    """

    offset: int

    def read(self) -> list[Line]: ...

    def rewind(self, offset: int, lines: list[Line]) -> None: ...

    def finish(self) -> None: ...


class Executor(ABC):
    """Starts, watches, signals and re-finds workers. Methods are called under the
    supervisor's lock, from its thread and the API's."""

    name: str = ""

    @abstractmethod
    def submit(self, run: dict[str, Any], run_dir: Path) -> Job:
        """Start the worker of ``run`` (a store row) writing into ``run_dir``.

        Raises ``LaunchError`` when it cannot be started."""

    @abstractmethod
    def poll(self, job: Job) -> Exit | None:
        """None while the worker runs; how it ended once it did. May set ``job.node``."""

    @abstractmethod
    def signal(self, job: Job, sig: signal.Signals) -> None:
        """SIGTERM: ask the worker to stop; SIGKILL: make it stop (cancel escalation)."""

    @abstractmethod
    def adopt(self, run: dict[str, Any], run_dir: Path) -> Job | None:
        """After a restart: the job of a run the store has as running, or None when this
        executor no longer knows it (then the run is settled as crashed)."""

    @abstractmethod
    def telemetry(self, run: dict[str, Any], run_dir: Path) -> TelemetrySource:
        """The stream of ``run``'s records, resuming after what the store already has."""

    @abstractmethod
    def log_tail(self, job: Job) -> str | None:
        """The end of the worker's own output (for errors), or None."""

    @abstractmethod
    def withdraw(self, job: Job) -> None:
        """Undo a ``submit`` the store refused (the run was cancelled in between)."""

    def slots(self, max_parallel: int | None) -> float:
        """How many runs of one device may be live at once (``--max-parallel``, or this
        executor's default when it is None)."""
        return max_parallel if max_parallel is not None else 1

    def store_fields(self, job: Job) -> dict[str, Any]:
        """Columns the store keeps for ``job`` so that ``adopt`` can find it again."""
        return {"executor": self.name, "job_id": job.key, "node": job.node}

    def cluster(self) -> dict[str, Any] | None:
        """What the system strip shows of the cluster (None for a single machine)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional: most executors hold nothing to release
        """Release clients and threads; workers keep running."""
