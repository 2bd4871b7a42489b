"""Imported by ``tests.backend.echo_worker``: sets an environment variable by default at import,
as ``workbench.worker.cli`` sets ``HF_HUB_OFFLINE`` (a fork server that preloads it must give its children
the same environment a cold import gives). With ``ECHO_PRELOAD_S`` set, its import takes that
many seconds, as torch's does."""

import os
import time

os.environ.setdefault("ECHO_PRELOADED", "yes")
time.sleep(float(os.environ.get("ECHO_PRELOAD_S", "0")))
