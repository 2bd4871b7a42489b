"""The local executor's fork server (``workbench.executors.forkserver``): a forked worker starts
as its command line would have started it, its exit code is reported, and a fork server serves
only the environment it imported with. The worker is ``tests.backend.echo_worker`` (light
preload); real runs through it are the lifecycle and dashboard tests' workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from workbench.executors import Exit, forkserver
from workbench.executors.forkserver import Forked, ForkServer
from workbench.executors.local import LocalExecutor
from workbench.services.settings import Settings

REPO = Path(__file__).resolve().parents[2]
MODULE = "tests.backend.echo_worker"
PRELOAD = forkserver.PRELOAD


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", MODULE, *args]


def env(mark: str = "forkserver-test") -> dict[str, str]:
    """The test process's environment without the NVML switch (an earlier test in this process
    may have set it): what the fork server adds must not reach its children."""
    environ = dict(os.environ, PYTHONUNBUFFERED="1", ECHO_MARK=mark)
    environ.pop(forkserver.NVML_CHECK, None)
    return environ


def ready_server(environ: dict[str, str]) -> ForkServer:
    server = ForkServer(environ, REPO, ["tests.backend.echo_preload"])
    assert server.ready.wait(120) and server.error is None, server.error
    return server


def cold(tmp_path: Path, name: str, args: list[str], environ: dict[str, str]) -> tuple[int, str]:
    log = tmp_path / f"{name}-cold.log"
    with log.open("ab") as out:  # the executor's cold start
        proc = forkserver.launch(command(*args), env=environ, cwd=REPO, stdout=out, fork=False)
    return proc.wait(60), log.read_text()


def forked(server: ForkServer, tmp_path: Path, name: str, args: list[str]) -> tuple[int, str]:
    log = tmp_path / f"{name}-forked.log"
    with log.open("ab") as out:
        child = server.fork(command(*args), server.env, REPO, out)
    return child.wait(60), log.read_text()


def without_traceback_frames(text: str) -> list[str]:
    """The output with a traceback's frame lines left out (the fork server's own frames sit
    where the cold interpreter's runpy frames are); its first and last lines stay."""
    return [line for line in text.splitlines() if not line.startswith(" ")]


@pytest.fixture(autouse=True)
def _fresh_module_state(monkeypatch):
    """Each test its own fork servers, importing nothing beyond torch."""
    monkeypatch.setattr(forkserver, "PRELOAD", ())
    monkeypatch.setattr(forkserver, "_current", None)
    monkeypatch.setattr(forkserver, "_retired", [])
    yield
    for server in [forkserver._current, *forkserver._retired]:
        if server is not None:
            server.close()


@pytest.fixture(scope="module")
def echo_server():
    """One fork server for the tests that fork from it directly (its environment the module's,
    without pytest's per-test variable)."""
    environ = env()
    environ.pop("PYTEST_CURRENT_TEST", None)
    server = ready_server(environ)
    yield server
    server.close()


@pytest.mark.parametrize(
    "args, rc", [(["exit", "0"], 0), (["exit", "3"], 3), (["raise"], 1)], ids=str
)
def test_a_forked_worker_starts_ends_and_writes_as_its_command_line_would(
    tmp_path, echo_server, args, rc
):
    environ = echo_server.env
    want_rc, want = cold(tmp_path, "w", args, environ)
    got_rc, got = forked(echo_server, tmp_path, "w", args)
    assert (got_rc, want_rc) == (rc, rc)
    assert without_traceback_frames(got) == without_traceback_frames(want)
    first = json.loads(got.splitlines()[0])
    # Its environment is the request's (not the fork server's, which checks CUDA over NVML),
    # with what its imports set at import, as a cold start's imports set it.
    assert first["env"] == {**environ, "ECHO_PRELOADED": "yes"}
    assert first["argv"][1:] == args and first["argv"][0].endswith("echo_worker.py")
    assert first["session_leader"] and first["group_leader"] and first["stdin"] == ""
    assert first["name"] == "__main__" and first["cwd"] == str(REPO)
    assert got.splitlines()[-2:] == ["thread joined", "atexit ran"]
    if args == ["raise"]:
        assert "Traceback (most recent call last):" in got and "RuntimeError: boom" in got


def test_a_signal_to_its_group_ends_a_forked_worker_and_the_signal_is_its_exit(
    tmp_path, echo_server
):
    with (tmp_path / "log").open("ab") as out:
        child = echo_server.fork(command("sleep", "60"), echo_server.env, REPO, out)
    assert child.exit() == (False, None)
    assert psutil.Process(child.pid).create_time() == child.create_time
    os.killpg(child.pid, signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM
    assert child.exit() == (True, -signal.SIGTERM)


def test_launch_forks_for_the_environment_its_fork_server_imported_with(tmp_path):
    first, second = env(), env("another")
    out = (tmp_path / "log").open("ab")
    # The first launch starts cold (it never waits) and the fork server in the background.
    started = forkserver.launch(command("exit", "0"), env=first, cwd=REPO, stdout=out)
    assert isinstance(started, subprocess.Popen) and started.wait(60) == 0
    server = forkserver._current
    assert server.ready.wait(120) and server.error is None
    sleeper = forkserver.launch(command("sleep", "60"), env=first, cwd=REPO, stdout=out)
    assert isinstance(sleeper, Forked) and sleeper.server is server
    # Another environment: cold again, and a fork server of its own; the first one keeps
    # reporting its child's exit, then ends.
    other = forkserver.launch(command("exit", "4"), env=second, cwd=REPO, stdout=out)
    assert isinstance(other, subprocess.Popen) and other.wait(60) == 4
    assert forkserver._retired == [server] and forkserver._current.env == second
    sleeper.kill()
    assert sleeper.wait(30) == -signal.SIGKILL
    assert forkserver._current.ready.wait(120)
    again = forkserver.launch(command("exit", "5"), env=second, cwd=REPO, stdout=out)
    assert isinstance(again, Forked) and again.wait(60) == 5
    assert forkserver._retired == [] and not server.alive()
    # Not forked at all when the caller says so (STAGEHAND_WORKBENCH_FORK_SERVER=0).
    plain = forkserver.launch(command("exit", "0"), env=second, cwd=REPO, stdout=out, fork=False)
    assert isinstance(plain, subprocess.Popen) and plain.wait(60) == 0
    out.close()


def test_a_launch_waits_for_the_fork_server_started_with_the_server(tmp_path, monkeypatch):
    """``STAGEHAND_WORKBENCH_FORK_SERVER=early``: the fork server ``prestart`` began is still
    importing (a second, as torch's import takes) when the first run launches; the launch
    waits for it and is forked, where a fork server the launch starts itself is not waited
    for (the test above: its first launch starts cold)."""
    monkeypatch.setattr(forkserver, "PRELOAD", ("tests.backend.echo_preload",))
    environ = dict(env(), ECHO_PRELOAD_S="1")
    forkserver.prestart(environ, REPO)
    server = forkserver._current
    with (tmp_path / "log").open("ab") as out:
        child = forkserver.launch(command("exit", "6"), env=environ, cwd=REPO, stdout=out)
    assert isinstance(child, Forked) and child.server is server and child.wait(60) == 6
    assert server.error is None and forkserver._current is server


def test_a_worker_outlives_its_fork_server_with_an_unknown_exit_code(tmp_path):
    environ = env()
    with (tmp_path / "log").open("ab") as out:
        forkserver.launch(command("exit", "0"), env=environ, cwd=REPO, stdout=out).wait(60)
        server = forkserver._current
        assert server.ready.wait(120)
        child = forkserver.launch(command("sleep", "60"), env=environ, cwd=REPO, stdout=out)
        assert isinstance(child, Forked)
        server.proc.kill()
        server.proc.wait(30)
        assert child.exit() == (False, None)  # still training, in its own session
        child.kill()
        deadline = time.monotonic() + 30
        while child.exit() != (True, None):  # ended; its exit code went with the fork server
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # The next launch starts cold and a new fork server for the same environment.
        again = forkserver.launch(command("exit", "0"), env=environ, cwd=REPO, stdout=out)
        assert isinstance(again, subprocess.Popen) and again.wait(60) == 0
        assert forkserver._current is not server


def test_a_fork_server_whose_imports_fail_is_named_and_not_tried_again(tmp_path, monkeypatch):
    monkeypatch.setattr(forkserver, "PRELOAD", ("tests.backend.no_such_module",))
    environ = env()
    with (tmp_path / "log").open("ab") as out:
        first = forkserver.launch(command("exit", "0"), env=environ, cwd=REPO, stdout=out)
        server = forkserver._current
        assert server.ready.wait(120)
        assert server.error == "ModuleNotFoundError: No module named 'tests.backend.no_such_module'"
        second = forkserver.launch(command("exit", "2"), env=environ, cwd=REPO, stdout=out)
    assert isinstance(second, subprocess.Popen) and forkserver._current is server
    assert (first.wait(60), second.wait(60)) == (0, 2)


def test_a_forked_worker_is_adopted_after_a_server_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO_TRAIN_S", "60")
    executor = LocalExecutor(Settings(data_dir=tmp_path, worker_module=MODULE))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run = {"id": 1, "device": None}
    first = executor.submit(run, run_dir)  # cold; the fork server starts
    executor.signal(first, signal.SIGKILL)
    assert isinstance(first.state["child"], subprocess.Popen)
    assert forkserver._current.ready.wait(120)
    job = executor.submit(run, run_dir)
    assert isinstance(job.state["child"], Forked) and executor.poll(job) is None
    row = {**run, **executor.store_fields(job)}
    # The server ends: its fork server with it; the worker trains on, and the next server
    # finds it by pid and start time.
    forkserver._current.close()
    forkserver._current.proc.wait(30)
    later = LocalExecutor(Settings(data_dir=tmp_path, worker_module=MODULE))
    adopted = later.adopt(row, run_dir)
    assert adopted is not None and adopted.pid == job.pid and later.poll(adopted) is None
    later.signal(adopted, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while later.poll(adopted) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert later.poll(adopted) == Exit(None)  # not its child: the exit code is unknown


def test_a_forked_tiny_run_trains_the_same_lora_as_a_cold_one(tmp_path, monkeypatch):
    """The real worker, forked from the real preload: the same LoRA bytes as a cold start."""
    monkeypatch.setattr(forkserver, "PRELOAD", PRELOAD)
    environ = dict(os.environ, PYTHONUNBUFFERED="1")
    loras = []
    for name in ("cold", "forked"):
        run_dir = tmp_path / name
        run_dir.mkdir()
        cmd = [sys.executable, "-m", "workbench.cli", "train", "tiny-ci", "--run-dir", str(run_dir)]
        with (run_dir / "worker.log").open("ab") as out:
            child = forkserver.launch(cmd, env=environ, cwd=REPO, stdout=out)
        assert type(child) is (subprocess.Popen if name == "cold" else Forked)
        assert child.wait(300) == 0, (run_dir / "worker.log").read_text()[-2000:]
        loras.append(load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors"))
        assert forkserver._current.ready.wait(300) and forkserver._current.error is None
    cold, forked = loras
    assert cold.keys() == forked.keys() and len(cold) > 0
    assert all(cold[k].equal(forked[k]) for k in cold)


def test_a_fork_server_whose_imported_code_changed_is_replaced(tmp_path, monkeypatch):
    """After an edit of a module it imported, a fork server forks nothing more: that launch
    starts cold, a new fork server imports the code as it is now, and the next launch forks."""
    code = tmp_path / "code"
    code.mkdir()
    module = code / "forkserver_probe.py"
    module.write_text("VALUE = 1\n")
    monkeypatch.setattr(forkserver, "PRELOAD", ("forkserver_probe",))
    environ = {**env(), "PYTHONPATH": str(code)}
    out = (tmp_path / "log").open("ab")

    def start(rc: str):
        return forkserver.launch(command("exit", rc), env=environ, cwd=REPO, stdout=out)

    assert start("0").wait(60) == 0  # cold; the fork server starts
    server = forkserver._current
    assert server.ready.wait(120) and server.error is None
    first = start("1")
    assert isinstance(first, Forked) and first.wait(60) == 1
    stat = module.stat()
    os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # edited
    edited = start("2")
    assert isinstance(edited, subprocess.Popen) and edited.wait(60) == 2
    assert forkserver._current is not server and server in forkserver._retired
    assert forkserver._current.ready.wait(120) and forkserver._current.error is None
    again = start("3")
    assert isinstance(again, Forked) and again.server is forkserver._current
    assert again.wait(60) == 3
    out.close()
