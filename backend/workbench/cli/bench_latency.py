"""Telemetry latency benchmark: a worker's write to a websocket client's receipt (p50/p99 ms).

``python -m workbench.cli.bench_latency [--rates 1000 10000] [--clients 1 20] [--seconds 4] [--runs N]``
(``workbench bench --telemetry`` dispatches here). It starts a real ``workbench serve`` on a free
loopback port whose "worker" is this module in writer mode (``python -m workbench.cli.bench_latency
train CONFIG --run-dir DIR``): it appends records to ``telemetry.jsonl`` at the asked rate, each
stamped with its write time, flushing every millisecond as the trainer's sink would. N websocket
clients in one asyncio process subscribe before the first write; latency is receipt time minus
the record's ``time``. Everything shares this machine's cores, so the figures include the
clients' own JSON parsing.

``--serve-args "--executor ray --ray-address http://127.0.0.1:8265 --ray-telemetry log"``
measures the Ray path: the writer runs as a Ray job and, with ``STAGEHAND_TELEMETRY_STDOUT=1``
(set by the Ray executor for ``--ray-telemetry log``), prints each record after the marker
too, so the records reach the server through ``tail_job_logs``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stagehand.config import wire

TIME_RE = re.compile(r'"time": ?([0-9.eE+-]+)')
START_DELAY_S = 2.0
"""The writer waits this long so every client is subscribed before the first record."""


# -- writer mode (the stand-in worker) ------------------------------------------------------------
def write(run_dir: Path, rate: float, seconds: float) -> int:
    time.sleep(START_DELAY_S)
    total = int(rate * seconds)
    path = run_dir / wire.TELEMETRY_FILE
    tee = os.environ.get(wire.STDOUT_ENV) == "1"
    t0 = time.perf_counter()
    seq = 0
    with open(path, "a", encoding="utf-8") as f:
        while seq < total:
            due = min(total, int((time.perf_counter() - t0) * rate) + 1)
            while seq < due:
                rec = {
                    "seq": seq,
                    "time": time.time(),
                    "source": "trainer",
                    "kind": "step",
                    "step": seq,
                    "phase": None,
                    "loss": 1.0,
                    "vram_allocated_mb": 1.0,
                }
                line = wire.encode(rec) + "\n"
                f.write(line)
                if tee:
                    sys.stdout.write(wire.STDOUT_MARKER + line)
                seq += 1
            f.flush()
            if tee:
                sys.stdout.flush()
            time.sleep(0.001)
        end = {
            "seq": seq,
            "time": time.time(),
            "source": "trainer",
            "kind": "run_finished",
            "step": None,
            "phase": None,
            "status": "succeeded",
            "lora_path": None,
            "steps_done": seq,
        }
        f.write(wire.encode(end) + "\n")
        if tee:
            sys.stdout.write(wire.STDOUT_MARKER + wire.encode(end) + "\n")
            sys.stdout.flush()
    return 0


# -- client side -----------------------------------------------------------------------------------
async def client(url: str, latencies: list[float], expected: int) -> None:
    import websockets

    seen = 0
    async with websockets.connect(url, max_size=None) as ws:
        while seen < expected:
            frame = await asyncio.wait_for(ws.recv(), 60)
            now = time.time()
            # A regex over the frame, not json.loads: with 20 clients in this one process the
            # parsing would otherwise be what is measured.
            stamps = TIME_RE.findall(frame)
            latencies.extend((now - float(t)) * 1e3 for t in stamps)
            seen += len(stamps)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def request(port: int, method: str, path: str, body: dict | None = None) -> dict:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(
        method, path, json.dumps(body) if body else None, {"content-type": "application/json"}
    )
    out = json.loads(conn.getresponse().read() or b"{}")
    conn.close()
    return out


async def measure(port: int, rate: int, clients: int, seconds: float, runs: int = 1) -> dict:
    """``runs`` runs at once, each writing ``rate`` records/s, each watched by ``clients``."""
    desc = f"bench rate={rate} seconds={seconds}"
    urls = []
    for _ in range(runs):
        run = request(
            port, "POST", "/api/runs", {"preset": "tiny-ci", "overrides": {"description": desc}}
        )
        urls.append(f"ws://127.0.0.1:{port}/api/runs/{run['id']}/stream?since=-1")
    expected = int(rate * seconds) + 1
    lat: list[float] = []
    await asyncio.gather(*(client(url, lat, expected) for url in urls for _ in range(clients)))
    return {
        "rate": rate,
        "runs": runs,
        "clients": clients,
        "records": len(lat),
        "p50_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":  # writer mode, launched by the server under test
        p = argparse.ArgumentParser()
        p.add_argument("cmd")
        p.add_argument("config")
        p.add_argument("--run-dir", type=Path, required=True)
        a = p.parse_args(argv)
        desc = json.loads(Path(a.config).read_text())["description"]
        opts = dict(kv.split("=") for kv in desc.split()[1:])
        return write(a.run_dir, float(opts["rate"]), float(opts["seconds"]))
    p = argparse.ArgumentParser(
        prog="workbench bench --telemetry", description=__doc__.split("\n")[0]
    )
    p.add_argument("--rates", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 20])
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--runs", type=int, default=1, help="synthetic runs at once (default 1)")
    p.add_argument(
        "--serve-args", default="", help="more `workbench serve` arguments (e.g. the Ray executor)"
    )
    args = p.parse_args([a for a in argv if a != "--telemetry"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "STAGEHAND_WORKBENCH_WORKER_MODULE": "workbench.cli.bench_latency",
            "STAGEHAND_WORKBENCH_TOKEN": "",
        }
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workbench.cli",
                "serve",
                "--port",
                str(port),
                "--data-dir",
                tmp,
                "--no-browser",
                "--log-level",
                "warning",
                *shlex.split(args.serve_args),
            ],
            cwd=Path.cwd(),
            env=env,
        )
        try:
            for _ in range(300):
                try:
                    request(port, "GET", "/api/presets")
                    break
                except OSError:
                    time.sleep(0.1)
            head = f"{'records/s':>10} {'runs':>5} {'clients':>8} {'records':>9}"
            print(f"{head} {'p50 ms':>8} {'p99 ms':>8}")
            for rate in args.rates:
                for n in args.clients:
                    r = asyncio.run(measure(port, rate, n, args.seconds, args.runs))
                    print(
                        f"{r['rate']:>10} {r['runs']:>5} {r['clients']:>8} {r['records']:>9} "
                        f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f}",
                        flush=True,
                    )
        finally:
            server.terminate()
            server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
