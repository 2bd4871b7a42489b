"""docker-compose.yml agrees with the CLI; the backend imports without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from backend_helpers import REPO


def test_compose_service_gpu_volumes_port_and_command():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    service = compose["services"]["workbench"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    targets = {v.rsplit("}", 1)[-1].split(":")[1] for v in service["volumes"]}
    assert {"/data", "/models"} <= targets
    assert service["ports"] == ["127.0.0.1:8000:8000"]
    assert "STAGEHAND_WORKBENCH_TOKEN" in service["environment"]
    assert "${STAGEHAND_WORKBENCH_TOKEN" in service["environment"]["STAGEHAND_WORKBENCH_TOKEN"]

    cmd = service["command"]
    assert cmd[:2] == ["workbench", "serve"]
    from workbench.cli import COMMANDS
    from workbench.cli.serve import build_parser

    assert COMMANDS["serve"][0] == "workbench.cli.serve"
    args = build_parser().parse_args(cmd[2:])  # every flag exists (argparse exits otherwise)
    assert (args.host, args.port, str(args.data_dir)) == ("0.0.0.0", 8000, "/data")
    assert "/data" in targets  # the data dir the command names is a volume
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "EXPOSE 8000" in dockerfile and '"serve"' in dockerfile


def test_backend_imports_without_torch():
    code = (
        "import sys, backend, workbench.api.app, workbench.cli.serve, workbench.cli\n"
        "workbench.api.app.create_app()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_bench_telemetry_is_dispatched_by_the_backend_cli(capsys):
    """``workbench bench --telemetry`` runs the backend's latency benchmark, chosen by
    workbench.cli: the runtime's bench never imports the backend."""
    from workbench import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "--telemetry", "--help"])
    assert stop.value.code == 0
    assert "Telemetry latency benchmark" in capsys.readouterr().out
    code = (
        "import sys, workbench.bench.cli; print(any(m.startswith('backend') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
