"""A worker for the fork server's tests (``python -m tests.backend.echo_worker ACTION [ARG]``):
prints what a process can tell of how it was started, then ends as ACTION says: ``exit N``,
``raise`` (an uncaught exception), ``sleep S`` or ``train`` (the executor's command line: sleeps
``$ECHO_TRAIN_S`` seconds). A non-daemon thread and an ``atexit`` handler
print last, so the interpreter's own ending shows in the output."""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time

import tests.backend.echo_preload  # noqa: F401 - sets ECHO_PRELOADED at import


def report() -> dict:
    return {
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "stdin": sys.stdin.read(),
        "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgid(0) == os.getpid(),
        "name": __name__,
    }


if __name__ == "__main__":
    print(json.dumps(report(), sort_keys=True))
    print("to stderr", file=sys.stderr)
    atexit.register(print, "atexit ran")
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
    action = sys.argv[1]
    if action == "exit":
        sys.exit(int(sys.argv[2]))
    if action == "raise":
        raise RuntimeError("boom")
    if action == "sleep":
        time.sleep(float(sys.argv[2]))
    if action == "train":
        time.sleep(float(os.environ.get("ECHO_TRAIN_S", "0")))
