"""Imported by ``tests.backend.echo_worker``: sets an environment variable by default at import,
as ``workbench.worker.cli`` sets ``HF_HUB_OFFLINE`` (a fork server that preloads it must give its children
the same environment a cold import gives)."""

import os

os.environ.setdefault("ECHO_PRELOADED", "yes")
