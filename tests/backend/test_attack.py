"""``attack.py`` (the attack, bounded) against a fresh server with a token on loopback:
nothing gives way, and the token is nowhere in the server's log."""

from __future__ import annotations

import subprocess
import sys

from backend_helpers import REPO

TOKEN = "attack-token-for-tests"


def test_a_bounded_attack_on_loopback_finds_nothing(server_factory):
    srv = server_factory(env={"STAGEHAND_WORKBENCH_TOKEN": TOKEN}, args=("--log-level", "info"))
    srv.start()
    attack = [sys.executable, str(REPO / "tests" / "backend" / "attack.py"), "--url", srv.url]
    attack += ["--token", TOKEN, "--requests", "150", "--seconds", "60", "--log", str(srv.log)]
    done = subprocess.run(attack, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.endswith(" 0 findings") and int(last.split()[0]) > 300, last
    refused = subprocess.run(
        [*attack[:3], "http://192.0.2.1:8000"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "loopback only" in refused.stderr
