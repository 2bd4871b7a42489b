"""``make_executor``: the executor a server's settings name. Apart from the interface
(``workbench.executors``) because it imports the implementations, which import the interface."""

from __future__ import annotations

from typing import Any

from workbench.executors import EXECUTORS, Executor
from workbench.executors.local import LocalExecutor


def make_executor(settings: Any) -> Executor:
    """The executor ``settings.executor`` names (``local`` | ``ray``).

    Raises ``ValueError`` naming the setting when it is unknown, and ``LaunchError`` when the
    Ray executor is chosen but ray is not installed or its address does not answer."""
    if settings.executor == "local":
        return LocalExecutor(settings)
    if settings.executor == "ray":
        from workbench.executors.ray_jobs import RayExecutor  # lazy: ray is an optional dependency

        return RayExecutor(settings)
    raise ValueError(f"executor: expected one of {', '.join(EXECUTORS)}, got {settings.executor!r}")
