"""docker-compose.yml agrees with the CLI, the Dockerfile installs the package as pyproject
declares it; the backend imports without torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest
import yaml
from backend_helpers import REPO
from packaging.requirements import Requirement


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


def test_dockerfile_installs_the_package_not_editable_on_a_torch_in_range():
    """The image is built from every file the package is made of and installs it as a wheel
    would be (``pip install .``, not ``-e``), on a base image whose torch pyproject admits.

    What the package needs is read from pyproject (its readme, the source folders
    ``packages.find`` searches) and from the links in those folders (the presets and the
    dashboard reach the workbench package as ``backend/workbench/presets -> ../../presets``):
    the image's copy must hold each, or ``pip install .`` builds a wheel without them."""
    dockerfile = (REPO / "Dockerfile").read_text()
    lines = [line.strip() for line in dockerfile.splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())

    copied = set()
    for line in instructions:
        if line.startswith("COPY "):
            *sources, _dest = line.split()[1:]
            copied |= {s.rstrip("/") for s in sources if not s.startswith("--")}
    needed = {"pyproject.toml", project["project"]["readme"]}
    roots = project["tool"]["setuptools"]["packages"]["find"]["where"]
    needed |= set(roots)
    links = []
    for root in roots:
        for folder, dirs, files in os.walk(REPO / root):
            for name in dirs + files:
                path = os.path.join(folder, name)
                if os.path.islink(path):
                    target = os.path.relpath(os.path.realpath(path), REPO)
                    links.append((os.path.relpath(path, REPO), target))
                    needed.add(target.split(os.sep)[0])
    assert {link for link, _ in links} >= {
        "backend/workbench/presets",
        "backend/workbench/frontend",
    }
    assert needed <= copied, f"the Dockerfile does not copy {sorted(needed - copied)}"

    runs = " ".join(line for line in instructions if line.startswith("RUN "))
    installs = re.findall(r"pip install ([^&;]*)", runs)
    assert any(args.split()[-1] == "." for args in installs), installs
    assert not any(re.search(r"(^|\s)(-e|--editable)\b", args) for args in installs), installs

    (base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, flags=re.M)
    assert "FROM ${BASE_IMAGE}" in instructions
    tag = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", base)
    assert tag, base
    (torch_req,) = [
        r for r in map(Requirement, project["project"]["dependencies"]) if r.name == "torch"
    ]
    assert tag.group(1) in torch_req.specifier, (base, str(torch_req))


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
