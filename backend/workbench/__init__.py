"""Stagehand Workbench's server: it launches training workers, stores their runs, presets and
telemetry in SQLite, and streams the telemetry to the dashboard.

The parts, by what each is:

- ``api/``: the FastAPI application (``app.create_app``: services built in its lifespan, one
  router per resource, the dashboard's static files, one error body, the security middleware
  in front), the routers (``runs``, ``presets``, ``telemetry``, ``stream``, ...), the API's
  models (``models``) and errors (``errors``).
- ``services/``: what the server does besides answering HTTP. ``supervisor`` queues, launches,
  watches, cancels and reconciles workers; ``tailer`` reads each active run's
  ``telemetry.jsonl`` exactly once into the store; ``hub`` fans the records out to websockets;
  ``calibration`` compares a finished run with its plan; ``limits`` forwards live limits to a
  worker's control folder; ``settings`` is the configuration (``STAGEHAND_WORKBENCH_*``).
- ``store/``: SQLite (runs, presets, telemetry, tunes) and its migrations.
- ``executors/``: where a worker runs: a local subprocess or a Ray job.
- ``cli/``: the ``workbench`` command line (``serve``, ``train``, ``bench``, ``plan``, ...).

The life of a run, once: ``POST /api/runs`` validates the preset with its overrides and stores
the run as queued; the supervisor starts ``python -m workbench.cli train DIR/config.json
--run-dir DIR`` through the executor when a worker slot is free; the tailer ingests the
records the worker appends to ``DIR/telemetry.jsonl`` and the hub streams them to every open
run page; a stop or a live-limit change is a file in ``DIR/control/`` the worker reads between
steps; the worker's exit (and its last record) settles the run's status (``workbench.contract.status``).

The server never imports torch: the runtimes and the trainer run in the worker's process, and
the routes that need them (the plan, pipeline inspection) import them when first called
(``tests/backend/test_deploy.py`` holds it to that).
"""
