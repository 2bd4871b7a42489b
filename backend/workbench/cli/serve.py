"""``workbench serve``: the API and dashboard on http://127.0.0.1:8000 by default.

Binding anything but 127.0.0.1 / localhost / ::1 needs a token (``--token`` or
``STAGEHAND_WORKBENCH_TOKEN``); without one the server refuses to start (exit code 2). So does a
damaged, truncated or foreign ``workbench.db`` (``workbench.store.DatabaseDamaged``: one message
naming the file and how to rebuild it, no traceback); ``--rebuild-db`` moves such a file aside
and starts on a new one, which adopts every run folder (``workbench.services.adoption``).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import threading
import webbrowser
from pathlib import Path

from workbench.api.app import create_app
from workbench.executors import LaunchError
from workbench.executors.factory import make_executor
from workbench.services.redaction import RedactToken
from workbench.services.settings import ENV_PREFIX, Settings, needs_token
from workbench.store import DatabaseDamaged, Store, set_aside


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench serve", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get(ENV_PREFIX + "DATA", "./data")),
        help=f"SQLite database, run dirs and caches (default ./data or ${ENV_PREFIX}DATA)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get(ENV_PREFIX + "TOKEN") or None,
        help=f"required by every request when set (default ${ENV_PREFIX}TOKEN)",
    )
    p.add_argument(
        "--max-parallel",
        type=int,
        default=None,
        help="runs at once per device (default: 1 with --executor local; Ray's placement with ray)",
    )
    p.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="where workers run: subprocesses here (local, default) or Ray jobs (ray)",
    )
    p.add_argument(
        "--ray-address",
        default=os.environ.get("RAY_API_SERVER_ADDRESS") or None,
        help="the Ray dashboard's address, http://HEAD:8265 (default $RAY_API_SERVER_ADDRESS)",
    )
    p.add_argument(
        "--ray-runtime-env",
        default=None,
        metavar="JSON",
        help='Ray runtime_env of every job, a JSON object (e.g. \'{"env_vars": {"HF_HOME": "/nfs/hf"}}\')',
    )
    p.add_argument(
        "--ray-telemetry",
        choices=("folder", "log"),
        default="folder",
        help="read telemetry from the shared run folder (folder, default) or the job's log (log)",
    )
    p.add_argument(
        "--ray-num-cpus",
        type=float,
        default=1.0,
        help="CPUs Ray reserves for each worker (default 1; CUDA runs also reserve 1 GPU)",
    )
    p.add_argument(
        "--rebuild-db",
        action="store_true",
        help="if workbench.db is damaged, move it aside (workbench.db.damaged-<time>) and "
        "rebuild it from the run folders (a healthy one is kept)",
    )
    p.add_argument("--no-browser", action="store_true", help="do not open the dashboard")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def log_config(base: dict, token: str | None = None) -> dict:
    """uvicorn's logging config with ``RedactToken`` (``token``: the server's) on every handler
    (the access log, and the error log, where uvicorn writes websocket handshakes and, at
    debug, the ``websockets`` library their headers) and ``QuietAssetPolls`` on the access
    log."""
    config = copy.deepcopy(base)
    redact = {"()": "workbench.services.redaction.RedactToken", "token": token}
    config.setdefault("filters", {})["redact_token"] = redact
    config["filters"]["quiet_asset_polls"] = {"()": "workbench.services.assets.QuietAssetPolls"}
    for handler in config["handlers"].values():
        handler.setdefault("filters", []).append("redact_token")
    config["handlers"]["access"]["filters"].append("quiet_asset_polls")
    return config


def open_store(settings: Settings, rebuild: bool = False) -> Store:
    """The database of ``settings``, checked (``PRAGMA quick_check``). With ``rebuild`` a damaged
    one is moved aside (``workbench.store.set_aside``) and a new one opened in its place; a healthy
    one is kept. Raises ``DatabaseDamaged`` (damaged, without ``rebuild``), or ``OSError`` (the
    data dir cannot be written, the file cannot be moved)."""
    try:
        return Store(settings.db_path, runs_dir=settings.runs_dir)
    except DatabaseDamaged as exc:
        if not rebuild:
            raise
        aside = set_aside(settings.db_path)
        print(
            f"workbench serve: the database {settings.db_path} is damaged ({exc.reason}); moved it "
            f"to {aside} and rebuilding it from the run folders in {settings.runs_dir}",
            file=sys.stderr,
            flush=True,
        )
        return Store(settings.db_path, runs_dir=settings.runs_dir)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        runtime_env = None
        if args.ray_runtime_env is not None:
            try:
                runtime_env = json.loads(args.ray_runtime_env)
            except ValueError as exc:
                raise ValueError(f"--ray-runtime-env: not JSON ({exc})") from exc
        settings = Settings(
            data_dir=args.data_dir,
            host=args.host,
            port=args.port,
            token=args.token,
            max_parallel=args.max_parallel,
            executor=args.executor,
            ray_address=args.ray_address,
            ray_runtime_env=runtime_env,
            ray_telemetry=args.ray_telemetry,
            ray_num_cpus=args.ray_num_cpus,
        )
        settings.check_bind()
    except ValueError as exc:
        print(f"workbench serve: {exc}", file=sys.stderr)
        return 2

    try:
        store = open_store(settings, args.rebuild_db)
    except (DatabaseDamaged, OSError) as exc:
        print(f"workbench serve: {exc}", file=sys.stderr)
        return 2
    try:
        executor = make_executor(settings)  # an unreachable cluster fails here, not on a run
    except LaunchError as exc:
        store.close()
        print(f"workbench serve: {exc}", file=sys.stderr)
        return 2
    import uvicorn  # imported here so `workbench --help` stays instant
    from uvicorn.config import LOGGING_CONFIG

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    for handler in logging.getLogger().handlers:  # the backend's own loggers
        handler.addFilter(RedactToken(settings.token))
    url = f"http://{args.host}:{args.port}/"
    # The URL first: the demo-asset build's progress bars follow it on this terminal.
    print(f"Stagehand Workbench: {url}", flush=True)
    if not args.no_browser and not needs_token(args.host):
        threading.Timer(1.5, webbrowser.open, args=(url,)).start()
    uvicorn.run(
        create_app(settings, executor, store=store),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=log_config(LOGGING_CONFIG, settings.token),
        timeout_graceful_shutdown=5,
        # Telemetry frames are small and mostly local: deflating ~30 MB/s for 20 clients at
        # 10k records/s costs more CPU than it saves.
        ws_per_message_deflate=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
