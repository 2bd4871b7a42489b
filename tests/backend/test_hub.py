"""The websocket hub: batching for slow clients, closing the hopeless."""

from __future__ import annotations


def test_hub_batches_for_slow_clients_and_closes_the_hopeless():
    import asyncio
    import concurrent.futures

    from workbench.services.hub import Hub, SubscriberState

    async def scenario():
        hub = Hub(asyncio.get_running_loop(), max_pending=18)
        fast, slow = hub.subscribe(1), hub.subscribe(1)
        hub.publish_lines(1, [(0, "{}"), (1, "{}")])
        hub.publish_lines(1, [(2, "{}")])
        hub.publish_run(1, {"status": "running"})
        await asyncio.sleep(0)
        items = await fast.take()
        assert [k for k, _ in items] == ["lines", "lines", "run"]
        assert [s for _, b in items[:2] for s, _ in b.lines] == [0, 1, 2]
        assert items[0][1].frame == '{"records":[{},{}]}'
        hub.publish_lines(1, [(i, "{}") for i in range(3, 20)])  # slow: 3 + 17 = 20 > 18 behind
        await asyncio.sleep(0)
        assert slow.state is SubscriberState.OVERFLOWED and fast.state is SubscriberState.LIVE
        assert await slow.take() == []
        assert len((await fast.take())[0][1].lines) == 17
        hub.unsubscribe(fast)
        hub.unsubscribe(slow)
        assert hub.subscribers(1) == 0

    # In a thread of its own: a browser test run earlier in this process leaves Playwright's
    # event loop running in the main thread, where asyncio.run refuses to start.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, scenario()).result()
