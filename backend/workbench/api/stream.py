"""WebSocket ``/api/runs/{id}/stream?since=SEQ``: replay from the store, then live, no gaps.

Order of operations is what makes it lossless and duplicate-free: subscribe to the hub first
(live batches start queueing), then replay every stored record with ``seq > since``, then send
queued live records whose seq is above the last one sent. The ingester commits a batch to the
store before publishing it, so each record is either in the replay, in the queue, or both
(dropped by seq), never neither.

Frames: ``{"records": [...]}`` (batched) and ``{"run": {...}}`` (after the replay and on every
status change). Errors: an ``{"error": {...}}`` frame (the API's one error body), then a close
with code 4400 (bad request), 4404 (no such run), 4408 (client fell too far behind: reconnect
with ``since`` = last seq received) or 4401 (token missing).
"""

from __future__ import annotations

import asyncio
import json
from contextlib import suppress
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from starlette.concurrency import run_in_threadpool

from workbench.api.deps import HubDep, StoreDep, public_run
from workbench.api.errors import error_body
from workbench.api.models import MAX_ID, bounded_int
from workbench.services.hub import Batch, SubscriberState, records_frame

router = APIRouter(tags=["stream"])
REPLAY_CHUNK = 5000


async def _close_with(ws: WebSocket, close_code: int, code: str, message: str) -> None:
    with suppress(Exception):
        await ws.send_text(json.dumps(error_body(code, message)))
        await ws.close(code=close_code, reason=code)


async def _until_disconnect(ws: WebSocket, sub) -> None:
    with suppress(WebSocketDisconnect, RuntimeError):
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
    sub.close()


def _merge(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Consecutive line batches become one frame; a lone batch keeps its shared frame text."""
    out: list[tuple[str, Any]] = []
    for kind, payload in items:
        if kind == "lines" and out and out[-1][0] == "lines":
            prev = out[-1][1]
            out[-1] = ("lines", Batch(prev.lines + payload.lines))
        else:
            out.append((kind, payload))
    return out


@router.websocket("/api/runs/{run_id}/stream")
async def stream(ws: WebSocket, run_id: str, store: StoreDep, hub: HubDep) -> None:
    await ws.accept()
    rid = bounded_int(run_id, 1, MAX_ID)
    since = bounded_int(ws.query_params.get("since", "-1"), -1, MAX_ID)
    if rid is None or since is None:
        await _close_with(
            ws,
            4400,
            "bad_request",
            f"expected a run id from 1 to {MAX_ID} and since from -1 to {MAX_ID}",
        )
        return
    row = await run_in_threadpool(store.get_run, rid)
    if row is None:
        await _close_with(ws, 4404, "not_found", f"no run with id {rid}")
        return
    sub = hub.subscribe(rid)
    watcher = asyncio.create_task(_until_disconnect(ws, sub))
    try:
        last = since
        while True:
            rows = await run_in_threadpool(store.telemetry_lines, rid, last, REPLAY_CHUNK)
            if not rows:
                break
            await ws.send_text(records_frame(rows))
            last = rows[-1][0]
        row = await run_in_threadpool(store.get_run, rid)
        if row is not None:
            run = await run_in_threadpool(public_run, store, row)
            await ws.send_text(json.dumps({"run": run}))
        while True:
            items = await sub.take()
            if sub.state is SubscriberState.CLOSED:
                return
            if sub.state is SubscriberState.OVERFLOWED:
                await _close_with(
                    ws,
                    4408,
                    "too_slow",
                    f"fell more than {sub.max_pending} records behind; reconnect with since={last}",
                )
                return
            for kind, payload in _merge(items):
                if kind == "run":
                    await ws.send_text(json.dumps({"run": payload}))
                elif payload.first_seq > last:
                    await ws.send_text(payload.frame)
                    last = payload.lines[-1][0]
                else:  # overlaps the replay: drop what was already sent
                    fresh = [(s, line) for s, line in payload.lines if s > last]
                    if fresh:
                        await ws.send_text(records_frame(fresh))
                        last = fresh[-1][0]
    except (WebSocketDisconnect, RuntimeError):
        return
    finally:
        hub.unsubscribe(sub)
        watcher.cancel()
