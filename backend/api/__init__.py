"""HTTP and websocket routes, one router per resource."""

from backend.api import compare, pipelines, presets, runs, stream, system, telemetry

ROUTERS = [
    system.router,
    presets.router,
    runs.router,
    telemetry.router,
    compare.router,
    stream.router,
    pipelines.router,
]
