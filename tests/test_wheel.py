"""The wheel works anywhere: a wheel built from the checkout holds the two import packages
(``stagehand``, ``workbench``) with the presets and the dashboard inside, and installed into a
fresh venv outside the checkout it serves the dashboard and the presets and trains ``tiny-ci``
to its end, from a folder outside the checkout.

The wheel is built from the committed tree (``git archive HEAD`` of what the Dockerfile copies,
``BUILD_INPUTS``), unpacked outside the checkout: what a clone builds. Not from the working
tree: setuptools would put untracked files of the package folders into the wheel (every module
and every file the package-data patterns match there) and write ``build/`` and ``*.egg-info``
into the checkout; and not from its tracked files either, which mix uncommitted edits with the
untracked modules they may import (a shared tree's work in progress: an edited
``workbench/plan/inventory.py`` importing a new, not yet added module failed the run here).
Commit first, then run this test.

The venv gets the wheel and nothing else; its dependencies come from the environment running
the tests through a ``.pth`` file listing that environment's site-packages folders (a ``.pth``
line only adds a folder to ``sys.path``: the editable install's finder in that folder is not
started, so ``workbench`` and ``stagehand`` resolve to the venv's copies; checked first).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import site
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from workbench.worker.assets import ENV_VAR

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "README.md", "runtime", "backend", "presets", "frontend")
"""What the wheel is built from: the Dockerfile's copy of the checkout (tests/backend/
test_deploy.py checks the Dockerfile copies every folder the package needs)."""
PACKAGES = {"stagehand": "runtime/stagehand", "workbench": "backend/workbench"}
"""The wheel's import packages and the folders they are built from."""
OLD_NAMES = ("backend", "bench", "contract", "plan", "runtime", "worker", "tests")
"""Top-level names of the layout before issue 55 (and the tests): none is installed."""


def committed_tree(dest: Path) -> list[str]:
    """Unpack ``BUILD_INPUTS`` of ``HEAD`` into ``dest``; return the paths unpacked (files and
    links, the links kept as links)."""
    tar = subprocess.run(
        ["git", "archive", "--format=tar", "HEAD", "--", *BUILD_INPUTS],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        members = [m for m in archive.getmembers() if m.isfile() or m.issym()]
        # The "tar" filter (Python >= 3.11.4) refuses absolute paths and links leading out.
        safe = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
        archive.extractall(dest, members=members, **safe)
    return sorted(m.name for m in members)


def run(cmd: list, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw
    )
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> SimpleNamespace:
    """The wheel of the committed tree, built once for this module."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout (the wheel is built from its committed tree)")
    root = tmp_path_factory.mktemp("wheel")
    src, dist = root / "src", root / "dist"
    files = committed_tree(src)
    started = time.monotonic()
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["--disable-pip-version-check", "-w", dist, "."],
        cwd=src,
    )
    (path,) = dist.glob("*.whl")
    return SimpleNamespace(
        path=path, src=src, files=files, root=root, build_s=time.monotonic() - started
    )


@pytest.fixture(scope="module")
def venv(wheel) -> SimpleNamespace:
    """A fresh venv outside the checkout with the wheel installed, the test environment's
    site-packages after its own, and ``env`` to run it with (no ``PYTHONPATH``)."""
    started = time.monotonic()
    folder = wheel.root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", folder])
    python = folder / "bin" / "python"
    purelib = run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    ).stdout.strip()
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "project-dependencies.pth").write_text("".join(p + "\n" for p in deps))
    run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps"]
        + ["--no-index", "--no-compile", "--disable-pip-version-check", wheel.path]
    )
    outside = wheel.root / "outside"  # the working folder of every command run from the venv
    outside.mkdir()
    assert not outside.resolve().is_relative_to(REPO)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        PATH=f"{folder / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(folder),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return SimpleNamespace(
        folder=folder,
        python=python,
        purelib=Path(purelib),
        bin=folder / "bin",
        outside=outside,
        env=env,
        install_s=time.monotonic() - started,
    )


def venv_python(venv, code: str) -> dict:
    """Run ``code`` with the venv's python in the folder outside the checkout; it prints JSON."""
    proc = run([venv.python, "-c", code], cwd=venv.outside, env=venv.env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_wheel_holds_two_import_packages_the_presets_and_the_dashboard(wheel):
    with zipfile.ZipFile(wheel.path) as zf:
        names = set(zf.namelist())
        contents = {n: zf.read(n) for n in names if n.startswith("workbench/")}
        top_level = [zf.read(n) for n in names if n.endswith(".dist-info/top_level.txt")]
    top = {n.split("/", 1)[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == set(PACKAGES), sorted(top)
    assert not top & set(OLD_NAMES)
    assert all(t.decode().split() == sorted(PACKAGES) for t in top_level), top_level

    # Every module of the two source folders, and nothing else.
    modules = {n for n in names if n.endswith(".py")}
    want = {
        name + f[len(folder) :]
        for name, folder in PACKAGES.items()
        for f in wheel.files
        if f.startswith(folder + "/") and f.endswith(".py")
    }
    assert modules == want, (sorted(modules - want)[:5], sorted(want - modules)[:5])

    # Every file of presets/ and frontend/ (the links' targets), with its bytes.
    for folder in ("presets", "frontend"):
        files = [f for f in wheel.files if f.startswith(folder + "/")]
        inside = {n for n in names if n.startswith(f"workbench/{folder}/")}
        assert inside == {f"workbench/{f}" for f in files}
        for f in files:
            assert contents[f"workbench/{f}"] == (wheel.src / f).read_bytes(), f
    frontend = {n for n in names if n.startswith("workbench/frontend/")}
    assert "workbench/frontend/index.html" in frontend
    assert any(n.endswith(".js") for n in frontend) and any(n.endswith(".css") for n in frontend)
    presets = {n for n in names if n.startswith("workbench/presets/")}
    assert presets and all(n.endswith(".json") for n in presets)
    print(
        f"\nwheel {wheel.path.name}: {len(names)} files, top-level {sorted(top - dist_info)}, "
        f"{len(modules)} modules, {len(presets)} presets, {len(frontend)} dashboard files, "
        f"{wheel.path.stat().st_size} bytes, built in {wheel.build_s:.1f} s"
    )


def test_the_venv_imports_the_installed_wheel_not_the_checkout(venv):
    code = (
        "import json, sys, importlib.metadata as md, stagehand, workbench\n"
        "from workbench.contract.package_data import FRONTEND_DIR, PRESETS_DIR\n"
        "print(json.dumps({'stagehand': stagehand.__file__, 'workbench': workbench.__file__,\n"
        "  'dist': str(md.distribution('stagehand-workbench')._path),\n"
        "  'presets': str(PRESETS_DIR), 'frontend': str(FRONTEND_DIR), 'path': sys.path}))"
    )
    got = venv_python(venv, code)
    for key in ("stagehand", "workbench", "dist", "presets", "frontend"):
        assert Path(got[key]).is_relative_to(venv.purelib), (key, got[key])
    source_dirs = {REPO, REPO / "runtime", REPO / "backend"}
    assert not {Path(p).resolve() for p in got["path"] if p} & source_dirs, got["path"]
    print(f"\nvenv with the wheel in {venv.install_s:.1f} s; sys.path {got['path']}")


def test_the_runtime_imports_nothing_of_the_workbench(venv):
    code = (
        "import json, sys, stagehand.strategy\n"
        "print(json.dumps({'file': stagehand.strategy.__file__, 'modules': sorted(sys.modules)}))"
    )
    got = venv_python(venv, code)
    assert Path(got["file"]).is_relative_to(venv.purelib)
    tops = {m.split(".", 1)[0] for m in got["modules"]}
    assert "workbench" not in tops and not tops & set(OLD_NAMES), sorted(tops)
    ours = [m for m in got["modules"] if m.split(".", 1)[0] == "stagehand"]
    print(f"\nimport stagehand.strategy: {len(ours)} stagehand modules, 0 of workbench")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_serve_from_the_venv_serves_the_dashboard_and_every_preset(venv, wheel):
    port, data = free_port(), venv.outside / "serve-data"
    base = f"http://127.0.0.1:{port}"
    cmd = [venv.bin / "workbench", "serve", "--port", str(port), "--data-dir", data]
    log = (venv.outside / "serve.log").open("w")
    server = subprocess.Popen(
        [str(c) for c in cmd + ["--no-browser"]],
        cwd=venv.outside,
        env=venv.env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (venv.outside / "serve.log").read_text()
            try:
                status, page = fetch(base + "/")
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not answer in 120 s"
                time.sleep(0.3)
        assert status == 200
        assert page == (wheel.src / "frontend" / "index.html").read_bytes()

        served = 0
        for f in (f for f in wheel.files if f.startswith("frontend/")):
            status, body = fetch(f"{base}/static/{f.removeprefix('frontend/')}")
            assert (status, body) == (200, (wheel.src / f).read_bytes()), f
            served += 1
        for extra in ("/static/vendor/plotly.min.js", "/static/js/contract.js"):
            assert fetch(base + extra)[0] == 200, extra

        status, body = fetch(base + "/api/presets")
        assert status == 200
        listed = {p["name"] for p in json.loads(body)["data"] if p["builtin"]}
        shipped = {Path(f).stem for f in wheel.files if f.startswith("presets/")}
        assert listed == shipped
        print(
            f"\nserve: / and {served} dashboard files served as shipped; presets {sorted(listed)}"
        )
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def test_train_tiny_ci_from_the_venv_to_its_end(venv, asset_cache):
    run_dir = venv.outside / "train-data" / "run"
    env = {**venv.env, ENV_VAR: str(asset_cache)}
    started = time.monotonic()
    proc = subprocess.run(
        [str(venv.bin / "workbench"), "train", "tiny-ci", "--run-dir", str(run_dir)],
        cwd=venv.outside,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    finished = [r for r in records if r["kind"] == "run_finished"]
    assert len(finished) == 1 and finished[0] is records[-1]
    assert finished[0]["status"] == "succeeded" and finished[0]["steps_done"] == 8, finished[0]
    lora = run_dir / finished[0]["lora_path"]
    assert lora.is_file() and lora.stat().st_size > 0

    from safetensors import safe_open

    with safe_open(str(lora), "pt") as f:
        assert len(list(f.keys())) > 0
        assert f.metadata()["stagehand.steps"] == "8"
    print(
        f"\ntiny-ci from the venv: {finished[0]['status']}, 8 steps, LoRA {lora.name}, {took:.1f} s"
    )
