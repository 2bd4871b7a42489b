"""Workers forked from a process that already imported them: the local executor's fork server.

A worker started cold (``python -m workbench.cli train DIR/config.json --run-dir DIR``) spends
most of its start importing torch, diffusers' model classes, peft and transformers (measured
here on 2 cores: ``POST /api/runs`` to a tiny-ci run's first step 5.2-7.2 s cold, 0.42-0.43 s
forked). The fork server imports
them once (``PRELOAD``) and then forks one child per run. The child becomes what the command
line would have started: its own session (so ``killpg`` reaches its children), the requested
working directory and environment, stdin from ``/dev/null``, stdout and stderr appended to the
run's log (the executor's open file, passed over the socket), the module run as ``__main__``
with the command's arguments, and the interpreter's own exit (exit code, threads joined,
``atexit``).

Rules:

- The backend itself never imports torch (it stays free of CUDA and OpenMP state). The fork
  server starts on the first launch, in the background; until it is ready, launches start cold
  (``subprocess.Popen``), so no launch waits for a fork server it started. One started with the
  server (``STAGEHAND_WORKBENCH_FORK_SERVER=early``: ``prestart``) is waited for: it began
  importing before the launch, so it is ahead of a cold start of the same imports, and the
  cold start's whole import (~5-7 s) is saved.
- Imports read the environment (``HF_HUB_OFFLINE``, ``OMP_NUM_THREADS``, our own knobs), so a
  fork server serves only launches with the environment it was started with. A launch with
  another environment starts cold and starts a fork server for it; the one it replaces keeps
  reporting its children's exits until they are all gone, then ends.
- A forked child cannot use CUDA once its parent initialised it: the fork server checks CUDA
  through NVML (``PYTORCH_NVML_BASED_CUDA_CHECK=1``, as ``backend/workbench/bench/runner.py``), and refuses to
  serve (every launch then starts cold) when a preload initialised CUDA anyway.
- Code on disk: a fork server forks only while every module it imported is unchanged on disk
  (each file's mtime, checked at each launch): after an edit or an upgrade, it answers
  ``stale``; that launch starts cold and a new fork server starts, so no run trains with code
  older than what a cold start would import.
- Exit codes: the fork server reaps its children and reports each ``(pid, rc)``, ``rc`` as
  ``Popen.returncode`` (negative for a signal). When the fork server ends first (the backend
  stopped, or it was killed), its children keep running; their exit code is then unknown, as
  for a worker adopted after a restart (``LocalExecutor.adopt``).

Messages are JSON, one per ``SOCK_SEQPACKET`` packet, over a socket pair; the fork server's
own process is ``backend/workbench/executors/forkserver_process.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import psutil

from workbench.executors.forkserver_process import MAX_MESSAGE, send
from workbench.worker.preload import TRAIN

log = logging.getLogger(__name__)

PROCESS = "workbench.executors.forkserver_process"
"""The fork server's own module (``python -m``)."""

PRELOAD = TRAIN
"""What a worker imports before its first step, as a cold ``workbench train`` imports it
(``workbench.worker.preload.TRAIN``)."""
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
READY_TIMEOUT_S = 300.0
REPLY_TIMEOUT_S = 30.0


class ForkServerError(RuntimeError):
    """The fork server did not answer, or answered with an error (the message says which)."""


class ForkServerStale(ForkServerError):
    """A module the fork server imported changed on disk since (the message names its file)."""


class Forked:
    """A worker the fork server started; ``args``, ``pid``, ``wait`` and ``kill`` as
    ``subprocess.Popen``'s. ``exit`` says how it ended."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server = server
        self.pid = pid
        self.args = args
        try:
            self.create_time: float | None = psutil.Process(pid).create_time()
        except psutil.Error:
            self.create_time = None

    def exit(self) -> tuple[bool, int | None]:
        """``(False, None)`` while it runs; ``(True, rc)`` once it ended, ``rc`` None when the
        fork server ended before reporting it."""
        ended, rc = self.server.returncode(self.pid)
        if ended or self.server.alive():
            return ended, rc
        try:  # the fork server is gone: is the child?
            proc = psutil.Process(self.pid)
            same = self.create_time is None or abs(proc.create_time() - self.create_time) < 0.05
            if same and proc.status() != psutil.STATUS_ZOMBIE:
                return False, None
        except psutil.Error:
            pass
        return True, None

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code (None when unknown). Raises ``subprocess.TimeoutExpired``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ended, rc = self.exit()
            if ended:
                return rc
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.05)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class ForkServer:
    """One fork server process, started with ``env`` and importing ``preload``; ``ready``
    once it has imported them."""

    def __init__(
        self, env: dict[str, str], cwd: Path, preload: Sequence[str], prestarted: bool = False
    ) -> None:
        self.env = env
        self.prestarted = prestarted  # started ahead of any launch: launches wait for it
        self.error: str | None = None
        self.ready = threading.Event()
        self.children: set[int] = set()
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server_env = dict(env)
        server_env.setdefault(NVML_CHECK, "1")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", PROCESS, str(theirs.fileno()), *preload],
                pass_fds=[theirs.fileno()],
                env=server_env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C of the backend does not reach it
            )
        finally:
            theirs.close()
        threading.Thread(target=self._wait_ready, name="forkserver-start", daemon=True).start()

    def _wait_ready(self) -> None:
        try:
            message = self._receive(READY_TIMEOUT_S)
            if "error" in message:
                raise ForkServerError(message["error"])
        except (ForkServerError, OSError, ValueError) as exc:
            if not self._closed:
                self.error = str(exc)
                log.warning("fork server unavailable, workers start cold: %s", exc)
            self.close()
        self.ready.set()

    def _receive(self, timeout: float) -> dict[str, Any]:
        if not select.select([self.sock], [], [], timeout)[0]:
            raise ForkServerError(f"no answer in {timeout:.0f} s")
        data = self.sock.recv(MAX_MESSAGE)
        if not data:
            raise ForkServerError("it ended")
        return json.loads(data)

    def _drain(self, until_pid: bool = False) -> int | None:
        """Read what the fork server sent; with ``until_pid``, wait for a launch's answer."""
        while True:
            timeout = REPLY_TIMEOUT_S if until_pid else 0.0
            try:
                message = self._receive(timeout)
            except ForkServerError:
                if until_pid:
                    raise
                return None
            if "exit" in message:
                self._exits[message["exit"]] = message["rc"]
                self.children.discard(message["exit"])
            elif "error" in message:
                raise ForkServerError(message["error"])
            elif "stale" in message:
                raise ForkServerStale(f"{message['stale']} changed since it was imported")
            elif "pid" in message:
                return message["pid"]

    def alive(self) -> bool:
        return not self._closed and self.proc.poll() is None

    def fork(self, cmd: list[str], env: dict[str, str], cwd: Path, stdout: IO) -> Forked:
        """Start ``cmd`` (``[python, "-m", module, *args]``) with ``env``, in ``cwd``, its
        output appended to ``stdout`` (an open file).

        Raises:
            ForkServerStale: an imported module changed on disk (nothing was started).
            ForkServerError: it failed (it is closed and not used again).
        """
        request = {"module": cmd[2], "args": cmd[3:], "env": env, "cwd": str(cwd)}
        with self._lock:
            if not self.alive():
                raise ForkServerError("it ended")
            try:
                send(self.sock, request, [stdout.fileno()])
                pid = self._drain(until_pid=True)
            except ForkServerStale:
                raise
            except (ForkServerError, OSError, ValueError) as exc:
                self.error = str(exc)  # not tried again for this environment
                self.close()
                raise ForkServerError(self.error) from exc
            self.children.add(pid)
        return Forked(self, pid, list(cmd))

    def update(self) -> None:
        """Take in the exits the fork server reported."""
        with self._lock:
            if self.ready.is_set() and not self._closed:
                with contextlib.suppress(ForkServerError, OSError, ValueError):
                    self._drain()

    def returncode(self, pid: int) -> tuple[bool, int | None]:
        """``(True, rc)`` once ``pid``'s exit was reported, else ``(False, None)``."""
        if pid not in self._exits:
            self.update()
        rc = self._exits.get(pid)
        return (pid in self._exits), rc

    def close(self) -> None:
        """End the fork server (its children keep running)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.close()


_lock = threading.Lock()
_current: ForkServer | None = None
_retired: list[ForkServer] = []


def prestart(env: dict[str, str], cwd: Path) -> None:
    """Start the fork server for ``env`` now, in the background, unless one is there: the first
    ``launch`` with ``env`` is then forked too, once it is ready."""
    global _current
    with _lock:
        if _current is None:
            _current = ForkServer(env, cwd, PRELOAD, prestarted=True)


def launch(
    cmd: list[str], *, env: dict[str, str], cwd: Path, stdout: IO, fork: bool = True
) -> Forked | subprocess.Popen:
    """Start the worker ``cmd`` (``[sys.executable, "-m", module, *args]``): forked when
    ``fork`` and a fork server with ``env`` is ready, else cold (``subprocess.Popen``; with
    ``fork``, a fork server for ``env`` then starts in the background, importing ``PRELOAD``,
    not ``module`` itself, which ``runpy`` would then warn of). Either way in its own session,
    in ``cwd``, stdin from /dev/null, stdout and stderr to ``stdout`` (an open file).

    A fork server ``prestart`` began for ``env`` is waited for while it imports (at most
    ``READY_TIMEOUT_S``, after which it has failed); one started by a launch is not.

    Raises ``OSError`` when it cannot be started."""
    global _current
    server = None
    if fork and len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m":
        with _lock:
            early = _current if _current is not None and _current.env == env else None
        if early is not None and early.prestarted:
            early.ready.wait(READY_TIMEOUT_S + 5)  # its start thread sets it by then
        with _lock:
            died = _current is not None and _current.ready.is_set() and not _current.alive()
            if _current is not None and (_current.env != env or (died and not _current.error)):
                _retired.append(_current)
                _current = None
            if _current is None:
                _current = ForkServer(env, cwd, PRELOAD)
            for old in list(_retired):  # ended once all its children are reported
                old.update()
                if not old.children or not old.alive():
                    old.close()
                    _retired.remove(old)
            if _current.ready.is_set() and _current.alive():
                server = _current
    if server is not None:
        try:
            return server.fork(cmd, env, cwd, stdout)
        except ForkServerStale as exc:  # a new one imports the code as it is now
            log.info("fork server replaced, this worker starts cold: %s", exc)
            with _lock:
                if _current is server:
                    _retired.append(server)
                    _current = ForkServer(env, cwd, PRELOAD)
        except ForkServerError as exc:  # not tried again for this environment
            log.warning("fork server failed, workers start cold: %s", exc)
    return subprocess.Popen(
        cmd,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
