"""A bounded attack on a workbench server on loopback, as it was first run by hand.

    python tests/backend/attack.py --url http://127.0.0.1:8000 [--token T] [--requests 2000]
        [--seconds 120] [--seed 0] [--log SERVER_LOG]

What it sends: JSON nested past the limit to every body route, each followed by a request on
the same keep-alive connection (a 500 once reset it); sizes no machine has in a run's
overrides and in live limits; path ids that are not plain integers; traversal in artifact and
LoRA names; ``--requests`` fuzzed requests (seeded: random routes, ids, queries and JSON bodies);
with ``--token``: as many requests again without it, a websocket carrying it in its query and a
``/?%74oken=`` link. With ``--log`` (the server's stdout and stderr), that the token is nowhere
in it. It creates runs and presets on the server: point it at a scratch data dir.

Loopback only: a URL whose host is not 127.0.0.1, 127.0.0.2, localhost or ::1 is refused. Bounded: at most ``--requests`` fuzzed requests and ``--seconds`` in all. Prints one
line per finding and a summary; exit status 0 when nothing gave way, 1 otherwise, 2 for a bad
argument. ``test_attack.py`` runs it against a fresh server with small bounds. (A bare ``..``
is not sent: httpx normalises it away; ``test_bad_input`` sends raw paths in-process. Kills of
workers and the server: ``test_lifecycle.py``.)
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from urllib.parse import urlsplit

import httpx
from websockets.sync.client import connect

LOOPBACK = ("127.0.0.1", "127.0.0.2", "localhost", "::1")
DEEP = 600  # levels: past the server's limit, under what a 1 MB body can hold
IDS = ["1", "0", "-1", "1_0", "1.0", "%201", "%D9%A1", "99999999999999999999", "x", "%2e%2e"]
NAMES = ["%2e%2e", "%2e%2e%2f%2e%2e%2fworkbench.db", "..%2fconfig.json", "a%00b", "x" * 300]
WATERMARK = "memory.stagehand.vram_high_watermark_mb"


class Attack:
    def __init__(self, url: str, token: str | None, seconds: float, seed: int) -> None:
        self.url, self.token = url.rstrip("/"), token
        self.deadline = time.monotonic() + seconds
        self.rng = random.Random(seed)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=30)
        self.findings: list[str] = []
        self.sent = 0

    def send(self, method: str, path: str, **kw) -> httpx.Response | None:
        """One request; a 5xx, a body that is not the one error body, or a dropped connection
        is a finding (None returned for the latter)."""
        self.sent += 1
        try:
            resp = self.client.request(method, path, **kw)
        except httpx.TransportError as exc:
            self.findings.append(f"{method} {path}: connection failed: {exc!r}")
            return None
        if resp.status_code >= 500:
            self.findings.append(f"{method} {path}: {resp.status_code} {resp.text[:200]}")
        elif resp.status_code >= 400:
            error = _error(resp)
            if error is None:
                self.findings.append(f"{method} {path}: {resp.status_code} without the error body")
        return resp

    def expect(self, resp: httpx.Response | None, status: int, what: str, **fields) -> None:
        if resp is None:
            return
        error = _error(resp) or {}
        wrong = {k: error.get(k) for k, v in fields.items() if error.get(k) != v}
        if resp.status_code != status or wrong:
            self.findings.append(
                f"{what}: expected {status} {fields}, got {resp.status_code} {wrong}"
            )

    def body_routes(self) -> list[tuple[str, str]]:
        spec = self.client.get("/openapi.json").json()
        return [
            (method.upper(), path.replace("{run_id}", "1").replace("{tune_id}", "1"))
            for path, ops in spec["paths"].items()
            for method, op in ops.items()
            if "requestBody" in op
        ]

    def deep_json(self, routes: list[tuple[str, str]]) -> None:
        body = '{"preset": "tiny-ci", "overrides": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}"
        for method, path in routes:
            path = path.replace("{name}", "tiny-ci")
            resp = self.send(
                method, path, content=body, headers={"content-type": "application/json"}
            )
            self.expect(resp, 422, f"{method} {path} nested {DEEP} deep", code="json_too_deep")
            self.expect(self.send("GET", "/api/runs"), 200, f"the request after {method} {path}")

    def sizes(self) -> None:
        for raw in ("1e308", "1" * 401):
            value = raw
            for key in reversed(WATERMARK.split(".")):
                value = f'{{"{key}": {value}}}'
            body = f'{{"preset": "tiny-ci", "overrides": {value}}}'
            headers = {"content-type": "application/json"}
            resp = self.send("POST", "/api/runs", content=body, headers=headers)
            self.expect(resp, 422, f"overrides {raw[:8]}", field=f"overrides.{WATERMARK}")
            body = f'{{"activation_vram_high_watermark_mb": {raw}}}'
            resp = self.send("PATCH", "/api/runs/1/limits", content=body, headers=headers)
            self.expect(resp, 422, f"limits {raw[:8]}", field="activation_vram_high_watermark_mb")

    def ids_and_names(self) -> None:
        for raw in IDS[3:]:
            for path in (
                f"/api/runs/{raw}",
                f"/api/tunes/{raw}",
                f"/api/runs/1/telemetry?since={raw}",
            ):
                resp = self.send("GET", path)
                if resp is not None and resp.status_code != 422:
                    self.findings.append(f"GET {path}: {resp.status_code}, expected 422")
        for name in NAMES:
            for path in (f"/api/runs/1/artifacts/{name}", f"/api/runs/1/lora/{name}"):
                resp = self.send("GET", path)
                if resp is not None and resp.status_code < 400:
                    self.findings.append(f"GET {path}: {resp.status_code}: served a file")

    def fuzz(self, n: int, authorized: bool = True) -> None:
        spec = self.client.get("/openapi.json").json()
        every = [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops]
        client = self.client if authorized else httpx.Client(base_url=self.url, timeout=30)
        for _ in range(n):
            if time.monotonic() > self.deadline:
                break
            method, path = self.rng.choice(every)
            if method == "DELETE" and "/runs" in path:
                continue  # keep the runs the other checks use
            url = re.sub(r"\{[^}]+\}", lambda _: self.rng.choice([*IDS, "tiny-ci"]), path)
            kw = {"params": {self.rng.choice(["since", "limit", "ids", "x"]): self.rng.choice(IDS)}}
            if method in ("POST", "PUT", "PATCH"):
                kw["content"] = json.dumps(_json(self.rng, 3))
                kw["headers"] = {"content-type": "application/json"}
            if authorized:
                self.send(method, url, **kw)
                continue
            self.sent += 1
            resp = client.request(method, url, **kw)
            if resp.status_code not in (401, 403):
                self.findings.append(f"{method} {url} without the token: {resp.status_code}")

    def token_handover(self) -> None:
        host = urlsplit(self.url).netloc
        ws = f"ws://{host}/api/runs/1/stream?since=-1&token={self.token}"
        with connect(ws, open_timeout=10) as conn:
            frame = json.loads(conn.recv(timeout=10))
            if (frame.get("error") or {}).get("code") != "unauthorized":
                self.findings.append(f"websocket with the token in its query: {frame}")
        resp = httpx.get(f"{self.url}/?%74oken={self.token}", follow_redirects=False)
        if resp.status_code != 303:
            self.findings.append(f"/?%74oken=: {resp.status_code}, expected 303")


def _error(resp: httpx.Response) -> dict | None:
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return None
    keys = {"code", "message", "field", "details"}
    return error if isinstance(error, dict) and keys <= set(error) else None


def _json(rng: random.Random, depth: int):
    kind = rng.randrange(7 if depth else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -1, 2**63, 10**30, 1e308, -1e308, 0.5])
    if kind in (2, 3, 4):
        return rng.choice(["", "tiny-ci", "..", "x" * 120, "\u0661", "a/b"])
    if kind == 5:
        return [_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    keys = ["preset", "overrides", "name", "config", "budget_mb", "memory", "root", "x"]
    return {rng.choice(keys): _json(rng, depth - 1) for _ in range(rng.randrange(4))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="attack.py", description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the server, on loopback")
    p.add_argument("--token", help="the server's token, if it has one")
    p.add_argument("--requests", type=int, default=2000, help="fuzzed requests (default 2000)")
    p.add_argument("--seconds", type=float, default=120, help="time bound (default 120)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", help="the server's log, to search for the token")
    args = p.parse_args(argv)
    host = urlsplit(args.url).hostname
    if host not in LOOPBACK:
        print(f"attack.py: {args.url}: loopback only ({', '.join(LOOPBACK)})", file=sys.stderr)
        return 2
    attack = Attack(args.url, args.token, args.seconds, args.seed)
    routes = attack.body_routes()
    attack.deep_json(routes)
    attack.sizes()
    attack.ids_and_names()
    attack.fuzz(args.requests)
    if args.token:
        attack.fuzz(args.requests, authorized=False)
        attack.token_handover()
    if args.log and args.token:
        time.sleep(0.5)  # the server writes its last lines
        with open(args.log, encoding="utf-8", errors="replace") as f:
            if args.token in f.read():
                attack.findings.append(f"{args.log}: holds the token in clear")
    for finding in attack.findings:
        print(finding)
    print(f"{attack.sent} requests, {len(routes)} body routes, {len(attack.findings)} findings")
    return 1 if attack.findings else 0


if __name__ == "__main__":
    sys.exit(main())
