"""``./dev``: its ``test`` reruns the tests marked ``parity`` on ATen's baseline kernels, from the
folders its ``-m parity`` line names (collecting no more of the suite than it must): every test
module that marks a test ``parity`` lies under one of them, so none is left out of that rerun.
Its install hands uv the sources pip is configured with (``uv_sources``); that rerun runs at the
lowest priority in a session of its own (``lowest_priority``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parity_folders() -> list[str]:
    text = (REPO / "dev").read_text()
    found = re.findall(r"-m parity ((?:tests/[^\s)]+ ?)+)", text)
    assert len(found) == 1, "dev: expected one `-m parity tests/...` line"
    return found[0].split()


def test_every_parity_test_is_in_a_folder_the_rerun_collects():
    folders = parity_folders()
    assert folders and all((REPO / f).is_dir() for f in folders), folders
    marked = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.parity\b", p.read_text())
    )
    assert len(marked) >= 10, marked  # the suite's exactness tests (runtime, worker)
    outside = [m for m in marked if not any(m.startswith(f + "/") for f in folders)]
    assert outside == [], f"parity tests outside the rerun's folders {folders}: {outside}"


def test_uv_gets_the_sources_pip_is_configured_with(tmp_path):
    """A config file's global and install sections and PIP_ variables, ranked as pip ranks them
    (variable over install over global), become uv's options; cert becomes SSL_CERT_FILE."""
    conf = tmp_path / "pip.conf"
    conf.write_text(
        "[global]\nindex-url = https://mirror.example/simple\n"
        "extra-index-url = file:///srv/a/simple file:///srv/b/simple\n"
        "find-links = /srv/global-wheels\ncert = /etc/my-ca.pem\n"
        "[install]\nfind-links = /srv/install-wheels\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=str(conf), PIP_CONSTRAINT="/srv/caps.txt", PIP_NO_INDEX="1")
    script = (
        f"PY={sys.executable}; uv_args=(); uv_env=(); "
        f'source <(sed -n "/^uv_sources() {{/,/^}}/p" {REPO / "dev"}); uv_sources; '
        'printf "%s\\n" "${uv_args[@]}" -- "${uv_env[@]}"'
    )
    out = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    args, uv_env = out[: out.index("--")], [x for x in out[out.index("--") + 1 :] if x]
    line = " ".join(args)
    assert line.startswith("--index-strategy unsafe-best-match ")
    assert "--find-links /srv/install-wheels" in line and "/srv/global-wheels" not in line
    assert "--index-url https://mirror.example/simple" in line
    assert "--extra-index-url file:///srv/a/simple --extra-index-url file:///srv/b/simple" in line
    assert "--constraint /srv/caps.txt" in line and "--no-index" in args
    assert uv_env == ["SSL_CERT_FILE=/etc/my-ca.pem"]


PROBE = """
import json, os
try:
    autogroup = open("/proc/self/autogroup").read().strip()
except OSError:
    autogroup = None
print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0),
                  "nice": os.nice(0), "autogroup": autogroup, "aten": os.environ.get("ATEN")}))
"""


def test_the_parity_rerun_runs_niced_in_a_session_of_its_own():
    """``lowest_priority CMD`` (in a subshell, as ``test`` runs the rerun) becomes CMD, leader of a
    session and process group of its own (the ``kill -- -PID`` of ``./dev``'s exit trap ends it;
    Linux's autogroup shares the CPU between sessions, so a session's nice is its autogroup's),
    niced to 19, its autogroup too where the kernel has one; the environment it is given reaches
    CMD."""
    script = (
        f'source <(sed -n "/^lowest_priority() {{/,/^}}/p" {REPO / "dev"}); '
        f"(lowest_priority env ATEN=default {sys.executable} -c '{PROBE}') & "
        'echo "$!"; wait "$!"'
    )
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split("\n")
    started, probe = int(out[0]), json.loads(out[1])
    assert probe["pid"] == started == probe["sid"] == probe["pgid"]
    assert probe["sid"] != os.getsid(0)
    assert probe["nice"] == 19 and probe["aten"] == "default"
    if Path("/proc/self/autogroup").exists():
        assert probe["autogroup"].endswith("nice 19"), probe["autogroup"]


def test_the_venv_is_made_from_the_system_python_of_python3s_version(tmp_path):
    """``venv_python``: ``$STAGEHAND_PYTHON`` when set; else the system's CPython
    (``$STAGEHAND_SYSTEM_PYTHON``) when it is the version ``python3`` on PATH is and has venv; else
    ``python3`` (a system interpreter of another version, without venv, or absent)."""
    version = subprocess.run(
        ["python3", "-c", "import sys; print(*sys.version_info[:2])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip

    def fake(name: str, prints: str, has_venv: bool) -> str:
        path = tmp_path / name
        check = "exit 0" if has_venv else "exit 1"
        path.write_text(
            f'#!/bin/sh\ncase "$2" in *ensurepip*) {check};; *) echo "{prints}";; esac\n'
        )
        path.chmod(0o755)
        return str(path)

    def chosen(**env: str) -> str:
        wanted = "/^STAGEHAND_SYSTEM_PYTHON=/p;/^venv_python() {/,/^}/p"
        script = f'source <(sed -n "{wanted}" {REPO / "dev"}); venv_python'
        base = {k: v for k, v in os.environ.items() if k not in ("STAGEHAND_PYTHON",)}
        return subprocess.run(
            ["bash", "-c", script], env={**base, **env}, capture_output=True, text=True,
            check=True, timeout=60,
        ).stdout.strip()  # fmt: skip

    same = fake("same", version, has_venv=True)
    assert chosen(STAGEHAND_SYSTEM_PYTHON=same) == same
    assert chosen(STAGEHAND_SYSTEM_PYTHON=same, STAGEHAND_PYTHON="/opt/py/bin/python3") == (
        "/opt/py/bin/python3"
    )
    assert chosen(STAGEHAND_SYSTEM_PYTHON=fake("older", "3 8", has_venv=True)) == "python3"
    assert chosen(STAGEHAND_SYSTEM_PYTHON=fake("no-venv", version, has_venv=False)) == "python3"
    assert chosen(STAGEHAND_SYSTEM_PYTHON=str(tmp_path / "absent")) == "python3"
