"""The fork server's own process: ``python -m workbench.executors.forkserver_process FD MODULE...``.

It imports the modules, then forks one child per request read from the socket FD (a
``SOCK_SEQPACKET`` socket of the backend's ``ForkServer``, ``backend/workbench/executors/forkserver.py``,
where the rules are), answers each request with the child's pid, reports each child's exit
code, and answers ``stale`` instead of forking once a file it imported changed on disk. In the
child, the request's command line takes over (``_become``, then the module as ``__main__``).
Standard library only (and ``workbench.worker.preload``, which is): what it imports is what it
was asked to.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from workbench.worker.preload import import_frozen

MAX_MESSAGE = 1 << 20
"""The largest message read (bytes): a request holds the worker's environment."""


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """``message`` as one JSON packet, with ``fds`` passed along (``SCM_RIGHTS``)."""
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def _imported_files() -> dict[str, int]:
    """Each imported module's file and its mtime (ns)."""
    files: dict[str, int] = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and path not in files:
            with contextlib.suppress(OSError):
                files[path] = os.stat(path).st_mtime_ns
    return files


def _changed(files: dict[str, int]) -> str | None:
    """The first of ``files`` whose mtime is no longer the one recorded (or gone), or None."""
    for path, mtime in files.items():
        try:
            if os.stat(path).st_mtime_ns != mtime:
                return path
        except OSError:
            return path
    return None


def _serve(sock: socket.socket, files: dict[str, int]) -> dict[str, Any] | None:
    """Fork a child per request until the backend closes the socket, while none of ``files``
    changed (else the answer is ``stale``). Returns None in the fork server when it should
    end, and the request in each child."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            send(sock, {"exit": pid, "rc": os.waitstatus_to_exitcode(status)})

    send(sock, {"ready": os.getpid()})
    while True:
        readable = select.select([sock, wake_r], [], [])[0]
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        if sock in readable:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
            if not data:
                return None
            request = json.loads(data)
            changed = _changed(files)
            if changed is not None:
                for fd in fds:
                    os.close(fd)
                send(sock, {"stale": changed})
                reap()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            started_r, started_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                # Its own session before its pid is answered: a killpg(pid) right after the
                # launch must reach it (the pipe's EOF tells the fork server it is done).
                os.setsid()
                os.close(started_r)
                os.close(started_w)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                sock.close()
                request["fd"] = fds[0]
                return request
            for fd in fds:
                os.close(fd)
            os.close(started_w)
            os.read(started_r, 1)  # EOF once the child has its session (or died)
            os.close(started_r)
            send(sock, {"pid": pid})
        reap()


def _become(request: dict[str, Any], imported: dict[str, str]) -> None:
    """In a forked child (already in its own session): become the worker the request's command
    line would have started. ``imported``: environment variables the fork server's imports set
    (as defaults: the request's own values win, as they would over a cold import's)."""
    os.chdir(request["cwd"])
    os.dup2(request["fd"], 1)
    os.dup2(request["fd"], 2)
    os.close(request["fd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in imported.items():
        os.environ.setdefault(key, value)
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin
    sys.stdout, sys.stderr = (
        io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False),
            encoding=encoding,
            errors=errors,
            line_buffering=True,
            write_through=True,
        )
        for fd, errors in ((1, "strict"), (2, "backslashreplace"))
    )
    sys.argv = [request["module"], *request["args"]]


def main(argv: list[str]) -> int:
    """``python -m workbench.executors.forkserver_process FD MODULE...``: import the modules,
    then serve the socket FD (the backend's ``ForkServer``)."""
    sock = socket.socket(fileno=int(argv[0]))
    before = dict(os.environ)
    try:
        # Paused collector, then every object frozen: a child's collections neither scan nor
        # copy what the imports made.
        import_frozen(argv[1:])
        import torch

        if torch.cuda.is_initialized():
            raise RuntimeError(
                f"importing {argv[1:]} initialised CUDA: a forked worker could not use it"
            )
    except BaseException as exc:  # noqa: BLE001 - reported to the backend, which starts cold
        with contextlib.suppress(OSError):
            send(sock, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    # What the imports set (``workbench.worker.cli`` sets ``HF_HUB_OFFLINE`` and others by default): a
    # cold worker's imports set it in its environment, so a child's environment has it too.
    imported = {k: v for k, v in os.environ.items() if before.get(k) != v}
    files = _imported_files()
    try:
        request = _serve(sock, files)
    except (BrokenPipeError, ConnectionError):
        return 0  # the backend is gone
    if request is None:
        return 0
    _become(request, imported)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
