"""A run folder that cannot take the run's output (read-only, full, removed mid-run) ends the
run with one line naming the folder and why, not a traceback from closing telemetry.jsonl."""

import errno
import os
import shutil
import subprocess
import threading
import time

import pytest

from workbench.worker.cli import main


@pytest.fixture
def read_only_folder(tmp_path):
    """An empty read-only folder: permissions for a user, a read-only tmpfs for root."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("root without mount(8) rights: no way to make a folder read-only")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("where", ["itself", "parent"])
def test_read_only_run_folder_is_named(cache_env, read_only_folder, capsys, where):
    run_dir = read_only_folder / "run" if where == "parent" else read_only_folder
    assert main(["tiny-ci", "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err
    problem = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    assert err.startswith(f"workbench train: cannot write the run folder {run_dir}: {problem}")
    assert "Traceback" not in err


def test_full_run_folder_is_named_without_a_traceback(cache_env, tmp_path, make_preset, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "telemetry.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    preset = make_preset(max_steps=2, checkpoint_every=None)
    assert main([str(preset), "--run-dir", str(run_dir)]) == 1
    out = capsys.readouterr()
    assert f"failed: OSError: cannot write the run folder {run_dir}: No space left on device" in (
        out.out
    )
    assert "Traceback" not in out.out + out.err


def test_removed_run_folder_is_named(cache_env, tmp_path, make_preset, run_io):
    run_dir = tmp_path / "run"
    preset = make_preset(max_steps=5000, checkpoint_every=None)
    worker = run_io.start_worker(preset, run_dir, cache_env)
    deadline = time.monotonic() + 120
    while (
        not (run_dir / "telemetry.jsonl").is_file()
        or '"kind":"step"' not in (run_dir / "telemetry.jsonl").read_text()
    ):
        assert worker.poll() is None and time.monotonic() < deadline, worker.stdout.read()
        time.sleep(0.1)
    shutil.rmtree(run_dir)
    out, _ = worker.communicate(timeout=120)
    assert worker.returncode == 1
    assert f"the run folder {run_dir} no longer exists (removed while the run was going?)" in out
    assert "Traceback" not in out and not run_dir.exists()


def test_a_file_gone_while_the_folder_is_being_removed_names_the_removed_folder(
    tmp_path, monkeypatch
):
    """``shutil.rmtree`` empties a folder before removing it: a worker that meets the missing
    ``control/`` first still reports the folder removed (it waits for the removal to finish),
    and a file removed from a folder that stays is named as such."""
    from workbench.worker import outputs

    run_dir = tmp_path / "run"
    (run_dir / "control").mkdir(parents=True)
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", str(run_dir / "control"))
    shutil.rmtree(run_dir / "control")
    remover = threading.Timer(0.3, shutil.rmtree, args=(run_dir,))
    remover.start()
    problem = outputs.folder_problem(run_dir, missing)
    remover.join()
    assert problem.startswith(f"the run folder {run_dir} no longer exists (removed while")
    run_dir.mkdir()
    monkeypatch.setattr(outputs, "REMOVAL_WAIT_S", 0.2)
    assert outputs.folder_problem(run_dir, missing) == (
        f"{run_dir / 'control'} was removed from the run folder {run_dir} while the run was going"
    )
    other = FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "x.png"))
    assert outputs.folder_problem(run_dir, other) is None  # not the run folder's: another error
