"""``workbench tune PRESET --budget-mb N [--device cpu] [--server URL]``.

Without ``--server``: the candidates of limits the plan predicts fit the budget (``propose``),
as a table; nothing runs. With ``--server URL``: ``POST URL/api/tunes`` queues one short trial
run per candidate on that server (one group: the runs list shows them, ``/#/tunes/ID`` plots
them), then waits for them and prints predicted against measured peak and step time, the
measured Pareto front and the fastest trial within the budget. Exit status 0, 1 when no trial
succeeded within the budget, 2 for a bad input (the message names the field).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from workbench.plan.inventory import PlanInputError
from workbench.plan.profiles import profile
from workbench.plan.tune import propose
from workbench.worker.preset import load_preset


def _limits(lim: dict[str, Any]) -> str:
    if "fraction" in lim:
        offload = "on" if lim["activation_offloading"] else "off"
        return f"fraction {lim['fraction']:.4g} ({lim['resident_blocks']} resident) act-offload {offload}"
    spill = (
        f" spill {lim['spill_high_mb']:g}/{lim['spill_low_mb']:g}"
        if lim.get("spill_high_mb") is not None
        else ""
    )
    return (
        f"high {lim['high_mb']:g} low {lim['low_mb']:g} window {lim['window']} "
        f"in-flight {lim['inflight']}{spill}"
    )


def _n(value: int | None) -> str:
    return "" if value is None else str(value)


def _ms(ms: float) -> str:
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.3g}"


def table(tune: dict[str, Any]) -> str:
    """Trials as text: label, limits (MB), predicted and (once run) measured peak MB, step ms
    and blocks loaded per step (a count, free of timing noise), ``*`` on the measured front."""
    head = (
        f"tune of {tune.get('preset', '(preset)')} within {tune['budget_mb']:g} MB on "
        f"{tune['device']}: {tune['searched']} candidates simulated, {tune['feasible']} fit "
        f"({tune.get('distinct') or '?'} distinct predictions; smallest feasible peak "
        f"{tune['min_peak_mb']:.2f} MB)"
    )
    lines = [
        head,
        f"{'trial':<12}{'run':>5}  {'status':<10}{'pred MB':>9}{'pred ms':>10}{'loads':>6}"
        f"{'meas MB':>9}{'meas ms':>10}{'loads':>6}  P  limits (MB)",
    ]
    for t in tune["trials"]:
        m = t.get("measured") or {}
        peak, step = m.get("peak_mb"), m.get("step_ms")
        lines.append(
            f"{t['label']:<12}{t.get('run_id') or '':>5}  {t.get('status', 'planned'):<10}"
            f"{t['predicted']['peak_mb']:>9.2f}{_ms(t['predicted']['step_ms']):>10}"
            f"{_n(t['predicted'].get('blocks_loaded')):>6}"
            f"{'' if peak is None else f'{peak:.2f}':>9}{'' if step is None else f'{step:.1f}':>10}"
            f"{_n(m.get('blocks_loaded')):>6}"
            f"  {'*' if t.get('pareto') else ' '}  {_limits(t['limits'])}"
        )
    if tune.get("best_run_id"):
        lines.append(f"fastest within the budget (measured): run #{tune['best_run_id']}")
    return "\n".join(lines)


def _call(method: str, url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="workbench tune", description=__doc__.split("\n\n")[1])
    p.add_argument("preset", help="a preset name (the server's, with --server) or JSON file")
    p.add_argument("--budget-mb", type=float, required=True, help="VRAM budget (MB)")
    p.add_argument("--device", default="cpu", help="device profile the plan uses")
    p.add_argument("--max-trials", type=int, default=5)
    p.add_argument("--trial-steps", type=int, default=3, help="steps after the trace step")
    p.add_argument("--server", help="queue the trials on this server (http://127.0.0.1:8000)")
    p.add_argument("--no-wait", action="store_true", help="queue the trials and return")
    args = p.parse_args(argv)
    if args.server:
        return _remote(args)

    try:
        name, data = load_preset(args.preset)
        out = propose(data, profile(args.device), args.budget_mb, max_trials=args.max_trials)
    except (PlanInputError, FileNotFoundError, ValueError) as exc:
        print(f"workbench tune: {exc}", file=sys.stderr)
        return 2
    print(table({**out, "preset": name}))
    print(f"run them: workbench tune {args.preset} --budget-mb {args.budget_mb:g} --server URL")
    return 0


def _remote(args: argparse.Namespace) -> int:
    base = args.server.rstrip("/")
    body = {
        "preset": args.preset,
        "budget_mb": args.budget_mb,
        "device": args.device,
        "trial_steps": args.trial_steps,
        "max_trials": args.max_trials,
    }
    try:
        tune = _call("POST", f"{base}/api/tunes", body)
    except urllib.error.HTTPError as exc:
        error = json.loads(exc.read() or b"{}").get("error") or {}
        where = f" (field: {error.get('field')})" if error.get("field") else ""
        print(f"workbench tune: {error.get('message', exc)}{where}", file=sys.stderr)
        return 2
    print(f"tune #{tune['id']}: {len(tune['trials'])} trials queued: {base}/#/tunes/{tune['id']}")
    if args.no_wait:
        print(table(tune))
        return 0
    while tune["active"]:
        time.sleep(2)
        tune = _call("GET", f"{base}/api/tunes/{tune['id']}")
    print(table(tune))
    return 0 if tune.get("best_run_id") else 1
