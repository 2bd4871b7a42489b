"""Server settings: where data lives, where to listen, who may connect, how runs are scheduled.

Every field has a default a single user on one GPU wants; ``Settings.from_env`` reads the
``STAGEHAND_WORKBENCH_*`` variables and the command line (``workbench.cli.serve``) overrides both.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from stagehand.config.cache import cache_dir
from workbench.contract.package_data import FRONTEND_DIR, PRESETS_DIR

ENV_PREFIX = "STAGEHAND_WORKBENCH_"


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(ENV_PREFIX + name, default)


def _env_float(name: str, default: float) -> float:
    value = _env(name)
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError as exc:
        raise ValueError(f"{ENV_PREFIX}{name}: expected a number, got {value!r}") from exc


TOKENLESS_HOSTS = ("127.0.0.1", "localhost", "::1")
"""The only binds allowed without a token. Even 127.0.0.2 needs one: the rule is "the default
address or a token", which keeps it simple to state and to test."""


def needs_token(host: str) -> bool:
    """True unless ``host`` is one of ``TOKENLESS_HOSTS``."""
    try:
        return str(ipaddress.ip_address(host)) not in TOKENLESS_HOSTS
    except ValueError:
        return host not in TOKENLESS_HOSTS


@dataclass
class Settings:
    """Everything the app reads at start-up. Times are seconds, sizes bytes."""

    data_dir: Path = field(default_factory=lambda: Path(_env("DATA", "./data") or "./data"))
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = field(default_factory=lambda: _env("TOKEN") or None)
    max_parallel: int | None = None
    """Runs that may hold one device at once. None: one at a time per GPU with the local
    executor; no cap of ours with Ray, which queues each job until a node has its GPU/CPUs."""
    presets_dir: Path = PRESETS_DIR
    frontend_dir: Path = FRONTEND_DIR
    max_body_bytes: int = 1 << 20
    """Request bodies above this get 413 (presets and overrides are a few KB)."""
    max_name_chars: int = 100
    poll_interval_s: float = field(default_factory=lambda: _env_float("POLL_S", 0.01))
    """How often the tailer looks at the telemetry files of active runs."""
    stop_grace_s: float = field(default_factory=lambda: _env_float("STOP_GRACE_S", 30.0))
    """After a stop request, wait this long for the step to finish before SIGTERM."""
    term_grace_s: float = field(default_factory=lambda: _env_float("TERM_GRACE_S", 10.0))
    """After SIGTERM, wait this long before SIGKILL."""
    stall_factor: float = field(default_factory=lambda: _env_float("STALL_FACTOR", 20.0))
    """A run is stalled after ``stall_factor`` x its median step time without telemetry..."""
    stall_min_s: float = field(default_factory=lambda: _env_float("STALL_MIN_S", 60.0))
    """...and never sooner than this (the first steps and checkpoint saves are slow)."""
    startup_stall_s: float = field(default_factory=lambda: _env_float("STARTUP_STALL_S", 900.0))
    """Before the first step record (model load, stage-1 caching) the threshold is this."""
    executor: str = "local"
    """Where workers run: ``local`` (subprocesses of the server) or ``ray`` (Ray jobs)."""
    ray_address: str | None = None
    """The Ray dashboard's job API, ``http://HEAD:8265`` (``--executor ray`` needs it)."""
    ray_runtime_env: dict | None = None
    """Ray ``runtime_env`` of every job (``env_vars``, ``working_dir``, ``pip``...)."""
    ray_telemetry: str = "folder"
    """``folder``: tail ``DIR/telemetry.jsonl`` (storage shared with the nodes); ``log``: read
    the records from the job's log stream (``tail_job_logs``)."""
    ray_num_cpus: float = 1.0
    """CPUs Ray reserves for each run's worker (``entrypoint_num_cpus``)."""
    calibrate: bool = field(default_factory=lambda: _env("CALIBRATE", "1") != "0")
    """Plan each succeeded run's config and store its calibration (``workbench.services.calibration``):
    seconds of CPU per run on the server (the first plan on ``cpu`` measures this machine).
    ``STAGEHAND_WORKBENCH_CALIBRATE=0`` turns it off (test servers, whose CPU is the tests')."""
    demo_assets: bool = field(default_factory=lambda: _env("DEMO_ASSETS", "1") != "0")
    """Start the demo-asset build (``workbench.services.assets``) beside the server; it keeps what is built.
    ``STAGEHAND_WORKBENCH_DEMO_ASSETS=0`` leaves it to ``POST /api/assets/build`` (the tests)."""
    asset_cache: Path = field(default_factory=cache_dir)
    """The asset cache the build and the workers use (``$STAGEHAND_WORKBENCH_CACHE``)."""
    worker_module: str = field(default_factory=lambda: _env("WORKER_MODULE", "workbench.cli") or "")
    """``python -m <worker_module> train CONFIG --run-dir DIR`` launches a worker."""
    fork_server: bool = field(default_factory=lambda: _env("FORK_SERVER", "1") != "0")
    """Fork local workers from a process that already imported them (a run starts ~5-7 s sooner;
    ``workbench.executors.forkserver``). ``STAGEHAND_WORKBENCH_FORK_SERVER=0`` starts each cold."""
    fork_server_early: bool = field(default_factory=lambda: _env("FORK_SERVER") == "early")
    """``STAGEHAND_WORKBENCH_FORK_SERVER=early`` starts the fork server with the server, not at
    the first launch, so that the first run is forked too instead of starting cold while the
    fork server imports beside it: a launch waits for it (the browser tests' server, whose tests
    start runs at once)."""

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).expanduser().resolve()
        if self.max_parallel is not None and self.max_parallel < 1:
            raise ValueError(f"max_parallel must be >= 1, got {self.max_parallel}")
        if self.executor not in ("local", "ray"):
            raise ValueError(f"executor: expected local or ray, got {self.executor!r}")
        if self.executor == "ray" and not self.ray_address:
            raise ValueError(
                "ray_address: --executor ray needs --ray-address http://HEAD:8265 "
                "(the Ray dashboard's address, where jobs are submitted)"
            )
        if self.ray_telemetry not in ("folder", "log"):
            raise ValueError(f"ray_telemetry: expected folder or log, got {self.ray_telemetry!r}")
        if self.ray_runtime_env is not None and not isinstance(self.ray_runtime_env, dict):
            raise ValueError(
                f"ray_runtime_env: expected a JSON object, got {type(self.ray_runtime_env).__name__}"
            )
        if not self.ray_num_cpus > 0:
            raise ValueError(f"ray_num_cpus: expected a number > 0, got {self.ray_num_cpus}")

    @property
    def runs_dir(self) -> Path:
        return self.data_dir / "runs"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "workbench.db"

    def check_bind(self) -> None:
        """Raise ``ValueError`` when binding anything but 127.0.0.1 / localhost / ::1 without a token."""
        if needs_token(self.host) and not self.token:
            raise ValueError(
                f"refusing to bind {self.host!r} without a token: anyone who can reach it could "
                f"start and delete runs. Pass --token or set {ENV_PREFIX}TOKEN, or bind 127.0.0.1"
            )
