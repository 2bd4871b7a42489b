"""HTTP and websocket routes, one router per resource."""

from backend.api import (
    artifacts,
    assets,
    compare,
    data,
    pipelines,
    plan,
    presets,
    runs,
    stream,
    system,
    telemetry,
    tunes,
)

ROUTERS = [
    system.router,
    assets.router,
    presets.router,
    runs.router,
    artifacts.router,
    data.router,
    telemetry.router,
    compare.router,
    stream.router,
    pipelines.router,
    plan.router,
    tunes.router,
]
