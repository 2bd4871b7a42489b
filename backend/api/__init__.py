"""HTTP and websocket routes, one router per resource."""

from backend.api import artifacts, compare, presets, runs, stream, system, telemetry

ROUTERS = [
    system.router,
    presets.router,
    runs.router,
    artifacts.router,
    telemetry.router,
    compare.router,
    stream.router,
]
