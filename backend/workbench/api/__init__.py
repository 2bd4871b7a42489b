"""The app and its API: the FastAPI application (``app``), one router per resource (``runs``,
``presets``, ...), the API's models and error bodies (``models``, ``errors``), its OpenAPI and
docs pages, and the security middleware. The package itself imports nothing, so services import
``workbench.api.errors`` without loading the routers."""
