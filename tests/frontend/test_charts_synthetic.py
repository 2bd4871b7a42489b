"""Charts against rich telemetry: the point cap keeps peaks, a 100k-record run opens downsampled,
and every live chart of a weight-streaming run fills (synthetic worker, real backend)."""

from __future__ import annotations

import copy
import time

import pytest

from tests.frontend.conftest import Api

pytestmark = [pytest.mark.browser]


def make_preset(api: Api, name: str, steps: int, step_s: float, knobs: str = "") -> None:
    config = copy.deepcopy(api.call("GET", "/api/presets/tiny-ci")["config"])
    config.update(name=name, max_steps=steps, description=f"synthetic step_s={step_s} {knobs}")
    sh = config["memory"]["stagehand"]
    sh.update(vram_high_watermark_mb=12000, vram_low_watermark_mb=8000)
    api.call("POST", "/api/presets", {"name": name, "config": config})


def test_min_max_downsample_and_point_cap_keep_peaks(synthetic_server, page):
    page.goto(synthetic_server + "/#/compare")
    page.wait_for_selector(".picker", state="attached")
    result = page.evaluate("""async () => {
        const m = await import('/static/js/charts.js');
        const n = 100000;
        const x = Array.from({length: n}, (_, i) => i);
        const y = x.map((i) => Math.sin(i / 50));
        y[77777] = 42; y[33333] = -42; y[500] = null;
        const ds = m.minMaxDownsample(x, y, 500);
        // A live chart fed in small batches, as the stream does, past its cap five times.
        const div = document.createElement('div');
        document.body.append(div);
        const chart = new m.LiveChart(div, {title: 't', traces: [{name: 'a'}], cap: 1000});
        for (let i = 0; i < 5000; i++) {
            chart.push(0, i, i === 1234 ? 999 : (i % 7));
            if (i % 50 === 49) chart.flush();
        }
        chart.flush();
        const t = div.data[0];
        return {
            len: ds.x.length, max: Math.max(...ds.y), min: Math.min(...ds.y),
            increasing: ds.x.every((v, i) => i === 0 || v > ds.x[i - 1]),
            peakAt: ds.x[ds.y.indexOf(42)],
            liveLen: t.x.length, liveMax: Math.max(...t.y), liveMin: Math.min(...t.y),
            liveLast: t.x[t.x.length - 1], livePeakAt: t.x[Array.from(t.y).indexOf(999)],
        };
    }""")
    assert result["len"] <= 1000
    assert (result["max"], result["min"], result["peakAt"]) == (42, -42, 77777)
    assert result["increasing"]
    assert result["liveLen"] <= 1000
    assert (result["liveMax"], result["liveMin"]) == (999, 0)
    assert (result["liveLast"], result["livePeakAt"]) == (4999, 1234)


def test_live_points_wait_on_the_last_draws_cost_and_nothing_else_does(synthetic_server, page):
    """charts.js PACE: a live point is drawn no sooner than min(PACE x the last draw's cost,
    MAX_PACE_MS) after that draw began; a never-drawn chart, a user's change and a finished run
    are not held by it."""
    page.goto(synthetic_server + "/#/compare")
    page.wait_for_selector(".picker", state="attached")
    r = page.evaluate("""async () => {
        const m = await import('/static/js/charts.js');
        const div = document.createElement('div');
        document.body.append(div);
        const chart = new m.LiveChart(div, {title: 't', traces: [{name: 'a'}]});
        const within = (f) => { const t0 = performance.now(); f(); const t1 = performance.now();
            return t0 + m.FLUSH_MS <= chart.due && chart.due <= t1 + m.FLUSH_MS; };
        const firstInFlush = within(() => chart.push(0, 1, 1)); // never drawn: FLUSH_MS
        chart.flush();
        const drawn = div.data[0].x.length;
        // As if that draw had taken 20 ms (x PACE), then 1 s (the cap).
        chart.cost = 20;
        chart.push(0, 2, 2);
        const paced = [chart.due, chart.drawnAt + 20 * m.PACE];
        const morePoints = (chart.push(0, 3, 3), chart.due === paced[0]); // one redraw, kept
        chart.unschedule();
        chart.cost = 1000;
        chart.push(0, 4, 4);
        const capped = [chart.due, chart.drawnAt + m.MAX_PACE_MS];
        const heldPoints = div.data[0].x.length;
        // A user's change (log y) is not held: the redraw is brought forward to FLUSH_MS.
        const userInFlush = within(() => chart.setLogY(true));
        chart.flush();
        const afterUser = div.data[0].x.length;
        // The run ends: a redraw the pacing holds is drawn at once, and pacing is over.
        chart.drawnAt = performance.now();
        chart.cost = 1000;
        chart.push(0, 5, 5);
        const heldAtEnd = div.data[0].x.length;
        chart.unpace();
        const atEnd = div.data[0].x.length;
        const afterEndInFlush = within(() => chart.push(0, 6, 6));
        return {firstInFlush, drawn, paced, morePoints, capped, heldPoints, userInFlush, afterUser,
                heldAtEnd, atEnd, afterEndInFlush, pace: m.PACE, cap: m.MAX_PACE_MS};
    }""")
    assert r["firstInFlush"] and r["drawn"] == 1
    assert r["paced"][0] == r["paced"][1] and 20 * r["pace"] < r["cap"]
    assert r["morePoints"]
    assert r["capped"][0] == r["capped"][1] and 1000 * r["pace"] > r["cap"]
    assert r["heldPoints"] == 1 and r["userInFlush"] and r["afterUser"] == 4
    assert (r["heldAtEnd"], r["atEnd"]) == (4, 5) and r["afterEndInFlush"]


def test_a_chart_out_of_view_draws_live_points_every_out_of_view_ms(synthetic_server, page):
    """charts.js IN_VIEW_MARGIN_PX: a chart farther than that below the window redraws for a
    live point OUT_OF_VIEW_MS after its last draw, not on the pacing of one in view; a user's
    change is drawn in FLUSH_MS; scrolled to, the held redraw comes in FLUSH_MS; the run's end
    (unpace) draws a held point at once."""
    page.goto(synthetic_server + "/#/compare")
    page.wait_for_selector(".picker", state="attached")
    r = page.evaluate("""async () => {
        const m = await import('/static/js/charts.js');
        const until = async (f) => {  // the observer reports at a frame, on a loaded machine late
            for (let i = 0; i < 100 && !f(); i++) await new Promise((ok) => setTimeout(ok, 50));
            return f();
        };
        const div = document.createElement('div');
        div.style.cssText = `position: absolute; left: 0; width: 600px; height: 300px;
            top: ${window.scrollY + innerHeight + m.IN_VIEW_MARGIN_PX + 400}px`;
        document.body.append(div);
        const chart = new m.LiveChart(div, {title: 't', traces: [{name: 'a'}]});
        chart.push(0, 1, 1);
        chart.flush();
        const away = await until(() => !chart.inView);
        chart.cost = 1;  // in view, its next live redraw would be due 1 x PACE ms after the last
        chart.push(0, 2, 2);
        chart.push(0, 3, 3);
        const held = [chart.due === chart.drawnAt + m.OUT_OF_VIEW_MS, div.data[0].x.length];
        const t0 = performance.now();
        chart.setLogY(true);  // a user's change is drawn in FLUSH_MS, out of view or not
        const userDue = chart.due <= performance.now() + m.FLUSH_MS && chart.due >= t0;
        chart.flush();
        const afterUser = div.data[0].x.length;
        chart.push(0, 4, 4);
        const heldAgain = [chart.due === chart.drawnAt + m.OUT_OF_VIEW_MS, div.data[0].x.length];
        div.scrollIntoView();
        const near = await until(() => chart.inView);
        const drawnInView = await until(() => div.data[0].x.length === 4);
        const inViewBy = performance.now() - chart.drawnAt < m.OUT_OF_VIEW_MS;
        window.scrollTo(0, 0);
        await until(() => !chart.inView);
        chart.push(0, 5, 5);
        const heldAtEnd = [chart.inView, div.data[0].x.length];
        chart.unpace();
        const atEnd = div.data[0].x.length;
        return {away, held, userDue, afterUser, heldAgain, near, drawnInView, inViewBy, heldAtEnd,
                atEnd, outMs: m.OUT_OF_VIEW_MS, paceCap: m.MAX_PACE_MS};
    }""")
    assert r["away"] is True and r["outMs"] > r["paceCap"]
    assert r["held"] == [True, 1]
    assert r["userDue"] and r["afterUser"] == 3
    assert r["heldAgain"] == [True, 3]
    assert r["near"] is True and r["drawnInView"] is True and r["inViewBy"] is True
    assert r["heldAtEnd"] == [False, 4] and r["atEnd"] == 5


STEPS = 45
"""The live run's steps."""


def test_live_streaming_run_fills_every_chart(synthetic_server, page, shoot):
    api = Api(synthetic_server)
    # The worker waits at step 3 for the live limit (on a loaded machine the run could
    # otherwise end before the limit is sent), then runs long enough for the charts' window to
    # follow 9 points.
    make_preset(api, "synth-live", steps=STEPS, step_s=0.25, knobs="hold_at=3")
    run = api.call("POST", "/api/runs", {"preset": "synth-live", "name": "synthetic-live"})
    page.goto(synthetic_server + f"/#/runs/{run['id']}")
    vram_len = "(document.getElementById('vram')?.data?.[0]?.x?.length ?? 0)"
    page.wait_for_function(f"{vram_len} > 0", timeout=60_000)
    assert "source: cuda" in page.evaluate("document.getElementById('vram').layout.title.text")
    # A live limit, sent while the worker holds at step 3.
    page.fill("#limit-vram_high_watermark_mb", "10000")
    page.click("#apply-limits")
    page.wait_for_selector("#limits-log li.applied", timeout=30_000)
    # The chart grows live as the run goes on.
    first = page.evaluate(vram_len)
    page.wait_for_function(f"{vram_len} > {first}", timeout=30_000)
    # A "last 5 steps" window follows the live records (the data underneath stays whole).
    page.fill("#chart-window", "5")
    page.press("#chart-window", "Enter")
    follows = (
        "(() => { const d = document.getElementById('loss'); const x = d.data[0].x;"
        " const r = d.layout.xaxis.range; return x.length >= {n} && !!r"
        " && r[1] === x[x.length - 1] + 0.5 && r[0] === r[1] - 5; })()"
    )
    page.wait_for_function(follows.replace("{n}", "6"), timeout=30_000)
    page.wait_for_function(follows.replace("{n}", "9"), timeout=30_000)

    page.wait_for_selector(".run-header .badge[data-status='succeeded']", timeout=60_000)
    page.wait_for_selector("#samples img")
    # The last step's records may still sit in the charts' batch (drawn once per flush period).
    page.wait_for_function(
        "(window.__runView.charts.flush(), document.getElementById('loss').data[0].x.length >= "
        + str(STEPS)
        + ")",
        timeout=10_000,
    )
    charts = page.evaluate("""() => Object.fromEntries(
        ['vram', 'transfers', 'host', 'spill', 'spill-pool', 'phases', 'loss', 'conductor']
        .map((id) => [id,
            document.getElementById(id).data.map((t) => t.x.length)]))""")
    assert charts["phases"] == [STEPS] * 4 and charts["loss"] == [STEPS] * 3
    assert charts["spill"] == [STEPS] * 4 and charts["conductor"] == [STEPS] * 5
    # Weights moved per step, live from stagehand/step: H2D GB, block loads, resident blocks,
    # prefetch misses, host waits (the worker writes none: no points drawn) and copy waits.
    assert charts["transfers"] == [STEPS] * 6
    h2d = page.evaluate("Array.from(document.getElementById('transfers').data[0].y)")
    assert all(v > 0 for v in h2d)
    records = api.call(
        "GET", f"/api/runs/{run['id']}/telemetry?source=stagehand&kind=step&limit=1000"
    )["data"]
    misses = page.evaluate("Array.from(document.getElementById('transfers').data[3].y)")
    assert misses == [r["prefetch_misses"] for r in records] and max(misses) > 0
    assert page.evaluate("document.getElementById('transfers').data[4].name") == "host waits"
    copy_waits = page.evaluate("Array.from(document.getElementById('transfers').data[5].y)")
    assert copy_waits == [r["copy_waits"] for r in records] and max(copy_waits) > 0
    assert all(n > 0 for n in charts["vram"]) and all(n == STEPS for n in charts["host"])
    high = page.evaluate("Array.from(document.getElementById('vram').data[2].y)")
    assert high[0] == 12000 and high[-1] == 10000
    residency = page.evaluate("document.getElementById('residency').data")
    assert len(residency[0]["z"]) == 12  # one row per block
    assert {v for row in residency[0]["z"] for v in row} == {0, 1, 2}
    assert len(residency[3]["x"]) > 0  # stall marks
    assert len(page.evaluate("document.getElementById('vram').layout.shapes")) == 1
    shoot(
        synthetic_server + f"/#/runs/{run['id']}", "run-synthetic", ready="#samples img", settle_s=2
    )


def test_finished_100k_record_run_opens_downsampled(synthetic_server, page, shoot):
    api = Api(synthetic_server)
    make_preset(api, "synth-100k", steps=1350, step_s=0)
    run = api.call("POST", "/api/runs", {"preset": "synth-100k", "name": "long"})
    api.wait_run(run["id"], {"succeeded"}, timeout=120)
    deadline = time.monotonic() + 60
    while api.call("GET", f"/api/runs/{run['id']}")["last_seq"] < 99_000:
        assert time.monotonic() < deadline, "the backend did not ingest the run's records"
        time.sleep(0.2)
    records = api.call("GET", f"/api/runs/{run['id']}")["last_seq"] + 1
    whole = api.call(
        "GET", f"/api/runs/{run['id']}/telemetry?source=stagehand&kind=block&buckets=1"
    )

    timings = []
    for _ in range(3):  # the first open compiles the page's code; later ones are warm
        page.goto(synthetic_server + "/#/runs")
        page.wait_for_selector(f"tr[data-run-id='{run['id']}']")
        page.goto(synthetic_server + f"/#/runs/{run['id']}")
        page.wait_for_selector(
            "#charts[data-all-drawn-ms]",
            state="attached",
            timeout=60_000,
        )
        grid = page.evaluate("Object.assign({}, document.getElementById('charts').dataset)")
        timings.append(grid)
    assert grid["downsampled"] == "true"
    assert int(grid["historyRecords"]) < records / 5  # not 100k records through the browser
    vram = page.evaluate(
        "(() => { const t = document.getElementById('vram').data[0];"
        " return {n: t.x.length, max: Math.max(...t.y), min: Math.min(...t.y)}; })()"
    )
    assert vram["n"] <= 4000
    # The buckets keep both the block-loaded peak and the post-eviction valley.
    assert vram["max"] == whole["data"][0]["max"]["vram_allocated_mb"]
    assert vram["min"] == whole["data"][0]["min"]["vram_allocated_mb"]
    assert page.evaluate("document.getElementById('loss').data[0].x.length") == 1350
    # Per-step VRAM points stay off a chart drawn from block buckets (they would run backwards).
    xs = page.evaluate("Array.from(document.getElementById('vram').data[0].x)")
    assert all(a <= b for a, b in zip(xs, xs[1:], strict=False))
    print(f"\n{records} records, opened 3 times (painted, ms after opening):")
    for t in timings:
        print(
            f"  fetched {t['fetchedMs']}, charts in the window {t['drawnMs']}, "
            f"every chart {t['allDrawnMs']}"
        )
    shoot(
        synthetic_server + f"/#/runs/{run['id']}",
        "run-100k",
        ready="#charts[data-all-drawn-ms]",
    )


def test_auto_watermarks_without_a_limit_do_not_scale_the_vram_chart(synthetic_server, page):
    # "auto" on a CPU device without a cap writes 1e9 MB watermarks (no limit): drawn, they
    # scaled the VRAM chart to 1e9 MB and hid the allocated bytes; the marker said 1000000000.
    page.goto(synthetic_server + "/#/compare")
    page.wait_for_selector(".picker", state="attached")
    result = page.evaluate("""async () => {
        const { RunCharts } = await import('/static/js/runcharts.js');
        const box = document.createElement('div');
        document.body.append(box);
        const charts = new RunCharts(box, {});
        const base = {source: 'stagehand', kind: 'step', phase: 'step_end', vram_source: 'tracked',
                      vram_allocated_mb: 0.3, h2d_bytes: 0, blocks_loaded: 0, resident_blocks: 8};
        charts.ingest({...base, seq: 1, time: 100, step: 1,
                       vram_high_watermark_mb: 1e9, vram_low_watermark_mb: 1e9});
        charts.markLimits(0.5, 2, {changed: {vram_high_watermark_mb: [1e9, 0.12],
                                             vram_low_watermark_mb: [1e9, 0.08]}});
        charts.markLimits(0.8, 3, {changed: {vram_high_watermark_mb: ['auto', 1e9]}});
        charts.flush();
        const d = charts.charts.vram.data;
        const labels = charts.charts.vram.markers.map((m) => m.label);
        return {high: Array.from(d[2].y), low: Array.from(d[3].y), labels};
    }""")
    assert result["high"] == [None, 0.12, None]
    assert result["low"] == [None, 0.08]
    assert result["labels"] == ["limits: high=0.12, low=0.08", "limits: high=no limit"]


def test_a_resumed_run_draws_each_step_once_from_its_newest_records(synthetic_server, page):
    # A worker killed after step 5 (and in step 6) resumed from its step-3 checkpoint trains
    # steps 4-6 again: the charts draw the resumed run's points there, one per step.
    page.goto(synthetic_server + "/#/compare")
    page.wait_for_selector(".picker", state="attached")
    result = page.evaluate("""async () => {
        const { RunCharts, ema } = await import('/static/js/runcharts.js');
        const box = document.createElement('div');
        document.body.append(box);
        const charts = new RunCharts(box, {});
        let seq = 0;
        const rec = (source, kind, step, fields) =>
            ({seq, time: 100 + seq++, source, kind, step, phase: null, ...fields});
        const weights = (n, loads) => rec('stagehand', 'step', n, {
            vram_source: 'tracked', h2d_bytes: 1e9, blocks_loaded: loads, resident_blocks: 1});
        const step = (n, loss, again) => [weights(n, 10 * n + again), rec('trainer', 'step', n, {
            loss, grad_norm: 2 * loss, step_time_ms: 10 * n, rss_mb: 100 + n, pinned_mb: 0,
            phase_ms: {forward: 1, backward: 2, optimizer: 3}})];
        const killed = [1, 2, 3, 4, 5].flatMap((n) => step(n, 1 / n, 0)).concat([weights(6, 60)]);
        const resumed = [rec('trainer', 'resumed', 3, {checkpoint: 'checkpoints/step-3'})]
            .concat([4, 5, 6, 7].flatMap((n) => step(n, 2 / n, 1)));
        for (const r of killed) charts.ingest(r);
        charts.flush();  // the killed run's points drawn, then the resumed run's arrive
        for (const r of resumed) charts.ingest(r);
        charts.flush();
        const c = charts.charts;
        const xy = (id, i) => ({x: Array.from(c[id].data[i].x), y: Array.from(c[id].data[i].y)});
        const losses = [1, 1 / 2, 1 / 3, 2 / 4, 2 / 5, 2 / 6, 2 / 7];
        return {
            loss: xy('loss', 0), smooth: xy('loss', 1).y, wantSmooth: ema(losses, 0.9),
            grad: xy('loss', 2).x, phases: xy('phases', 3).x, host: xy('host', 0).x,
            loads: xy('transfers', 1), csvRows: c.loss.csv().trim().split('\\n').length - 1,
            markers: c.loss.markers.map((m) => [m.x, m.label]), lastStep: charts.lastStep,
            records: killed.length + resumed.length,
        };
    }""")
    steps = [1, 2, 3, 4, 5, 6, 7]
    assert result["loss"]["x"] == steps
    assert result["loss"]["y"] == [1, 1 / 2, 1 / 3, 2 / 4, 2 / 5, 2 / 6, 2 / 7]
    assert result["smooth"] == pytest.approx(result["wantSmooth"], rel=1e-12)
    assert result["grad"] == result["phases"] == result["host"] == steps
    assert result["loads"] == {"x": steps, "y": [10, 20, 30, 41, 51, 61, 71]}
    assert result["csvRows"] == 7
    assert result["markers"] == [[3, "resumed after step 3"]]
    assert result["lastStep"] == 7 and result["records"] == 20
