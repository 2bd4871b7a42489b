"""What the run page's charts say beside their data: the VRAM chart's watermark lines from the
run's start to its newest record, "auto" watermarks as the figures they resolved to, units and
digits in the hover labels, whole steps on step axes, and Plotly's toolbar clear of the titles.
The charts are fed records in the page (``RunCharts.ingest``, as the stream does), with no run."""

from __future__ import annotations

import pytest

from tests.frontend.conftest import picture

pytestmark = [pytest.mark.browser]

# Builds RunCharts for `config` in a 2-column grid as wide as the run page's, and gives `rec`
# (a record at `time` s after 100) and `feedStep` (one training step's records: block records
# spread over [t, t + 1), then stagehand/step and trainer/step at t + 1).
SETUP = """
    const { RunCharts } = await import('/static/js/runcharts.js');
    document.body.innerHTML = '';
    const box = document.createElement('div');
    box.className = 'chart-grid';
    box.id = 'charts-box';
    box.style.width = '1300px';
    document.body.append(box);
    const charts = new RunCharts(box, config);
    let seq = 0;
    const rec = (source, kind, time, step, fields) =>
        ({seq: seq++, time: 100 + time, source, kind, step, phase: null, ...fields});
    const block = (t, step, i, mb) => rec('stagehand', 'block', t, step, {event: 'enter',
        block: i, block_name: `transformer_blocks.${i}`, vram_allocated_mb: mb,
        vram_reserved_mb: mb + 400, vram_source: 'cuda'});
    const feedStep = (step, t, marks) => {
        for (let i = 0; i < 5; i++) charts.ingest(block(t + i / 5, step, i, 5000 + 900 * i));
        charts.ingest(rec('stagehand', 'step', t + 1, step, {vram_allocated_mb: 6000,
            vram_source: 'cuda', h2d_bytes: 2e9, blocks_loaded: 5, resident_blocks: 2,
            pool_used_mb: 600, pool_total_mb: 800, stall_time_ms: 12.5, ...marks}));
        charts.ingest(rec('trainer', 'step', t + 1, step, {loss: 0.123456789 * step,
            grad_norm: 0.98765, step_time_ms: 11542.66 + step, rss_mb: 12345.678,
            pinned_mb: 8192, vram_source: 'cuda', phase_ms: {forward: 3461.234,
            backward: 6923.1, optimizer: 129.4998}}));
    };
"""

STREAMING = {
    "memory": {
        "strategy": "stagehand",
        "stagehand": {"vram_high_watermark_mb": 12000, "vram_low_watermark_mb": 8000},
    }
}


def _drawn(page, chart: str, trace: int) -> dict:
    return page.evaluate(
        f"(() => {{ const t = document.getElementById('{chart}').data[{trace}];"
        " return {x: Array.from(t.x), y: Array.from(t.y)}; })()"
    )


def test_watermarks_are_drawn_from_the_first_block_record_to_the_newest(synthetic_server, page):
    page.goto(synthetic_server + "/#/compare")
    page.wait_for_selector(".picker", state="attached")
    # Before its first step a run has block records but no stagehand/step record: the config's
    # watermarks are in force from the first of them.
    page.evaluate(
        f"""async (config) => {{ {SETUP}
        window.__t = {{charts, rec, feedStep, block}};
        charts.ingest(rec('trainer', 'run_started', 0, null, {{vram_source: 'cuda'}}));
        for (let i = 0; i < 3; i++) charts.ingest(block(0.5 + i / 10, 1, i, 5000 + 900 * i));
        charts.flush();
    }}""",
        STREAMING,
    )
    high, low = _drawn(page, "vram", 2), _drawn(page, "vram", 3)
    assert high == {"x": [0.5, 0.7], "y": [12000, 12000]}
    assert low == {"x": [0.5, 0.7], "y": [8000, 8000]}
    # Live: the lines reach the newest block record, past the last step's end.
    page.evaluate(
        """() => { const {charts, feedStep, block} = window.__t;
        feedStep(1, 1, {vram_high_watermark_mb: 12000, vram_low_watermark_mb: 8000});
        for (let i = 0; i < 4; i++) charts.ingest(block(2.1 + i / 10, 2, i, 5000 + 900 * i));
        charts.flush(); }"""
    )
    alloc = _drawn(page, "vram", 0)
    high = _drawn(page, "vram", 2)
    assert alloc["x"][-1] == pytest.approx(2.4)
    assert high["x"][-1] == alloc["x"][-1] and high["y"][-1] == 12000
    # The point that carries a line to the newest record is drawn only: the data and its CSV
    # hold the figures the records gave.
    kept = page.evaluate("Array.from(window.__t.charts.charts.vram.data[2].x)")
    assert kept == [0.5, 2]
    csv = page.evaluate("window.__t.charts.charts.vram.csv()").splitlines()
    assert [row.split(",")[3] for row in csv[1:]].count("12000") == 2
    picture(page.locator("#vram"), "chart-vram-watermarks")


AUTO = {
    "memory": {
        "strategy": "stagehand",
        "stagehand": {
            "vram_high_watermark_mb": "auto",
            "vram_low_watermark_mb": "auto",
            "activation_stagehand": {
                "enabled": True,
                "vram_high_watermark_mb": "auto",
                "vram_low_watermark_mb": "auto",
            },
        },
    }
}

# The strategy's record of what "auto" became at build (request_id "auto"): `high`, `low` MB
# for the weights, `act` [high, low] MB for the activations.
AUTO_RECORD = """
    const resolved = (time, step, high, low, act, old = 'auto') => rec('strategy',
        'limits_applied', time, step, {request_id: 'auto', changed: {
            vram_high_watermark_mb: [old, high], vram_low_watermark_mb: [old, low],
            ...(act ? {activation_vram_high_watermark_mb: [old, act[0]],
                       activation_vram_low_watermark_mb: [old, act[1]]} : {})}});
"""


def _auto_run(page, script: str) -> dict:
    return page.evaluate(
        f"""async (config) => {{ {SETUP} {AUTO_RECORD} {script}
        charts.flush();
        const c = charts.charts;
        return {{
            markers: Object.fromEntries(Object.entries(c).map(([id, ch]) =>
                [id, ch.markers.map((m) => m.label)])),
            legend: c.vram.names.slice(2), spill: c.spill.title,
            high: Array.from(document.getElementById('vram').data[2].y),
        }};
    }}""",
        AUTO,
    )


def test_auto_watermarks_show_the_figures_they_resolved_to(synthetic_server, page):
    page.goto(synthetic_server + "/#/compare")
    page.wait_for_selector(".picker", state="attached")
    # A CPU run: "auto" without a budget is no limit (1e9 MB). The resolution at build is the
    # run's starting limits, not a change: no "limits:" marker on every chart.
    cpu = _auto_run(
        page,
        """charts.ingest(rec('trainer', 'run_started', 0, null, {vram_source: 'tracked'}));
        charts.ingest(resolved(0.1, 0, 1e9, 1e9, [1e9, 1e9]));
        feedStep(1, 1, {vram_high_watermark_mb: 1e9, vram_low_watermark_mb: 1e9});""",
    )
    assert all(labels == [] for labels in cpu["markers"].values()), cpu["markers"]
    assert cpu["legend"] == ["high watermark (auto): no limit", "low watermark (auto): no limit"]
    assert cpu["spill"] == "Activation spill per step (auto watermarks: no limit)"
    assert all(y is None for y in cpu["high"])  # no 1e9 MB line
    picture(page.locator("#charts-box"), "chart-auto-watermarks-cpu")
    # A GPU run: the figures at build, then the weight watermarks again after the trace step
    # (measured activations), a change at step 1 marked with its figures; the legend follows
    # the stagehand/step records.
    gpu = _auto_run(
        page,
        """charts.ingest(rec('trainer', 'run_started', 0, null, {vram_source: 'cuda'}));
        charts.ingest(resolved(0.1, 0, 20480.4, 16384.7, [21504.25, 20480.5]));
        feedStep(1, 1, {vram_high_watermark_mb: 20480.4, vram_low_watermark_mb: 16384.7});
        charts.ingest(resolved(2.05, 1, 19000.25, 15000.6, null, 20480.4));
        feedStep(2, 2.1, {vram_high_watermark_mb: 19000.25, vram_low_watermark_mb: 15000.6});
        feedStep(3, 3.1, {});  // a step record without the figures keeps them""",
    )
    label = "auto: high=19,000, low=15,001 MB"
    assert gpu["markers"]["loss"] == [label] and gpu["markers"]["vram"] == [label]
    assert gpu["legend"] == [
        "high watermark (auto): 19,000 MB",
        "low watermark (auto): 15,001 MB",
    ]
    assert gpu["spill"] == "Activation spill per step (auto watermarks: 21,504 / 20,481 MB)"
    picture(page.locator("#vram"), "chart-vram-auto-watermarks")


def _hover_text(page, chart: str, step: int) -> list[str]:
    """The lines of the hover label Plotly draws at x = `step` of `chart` (unified hover)."""
    return page.evaluate(
        f"""() => {{ const el = document.getElementById('{chart}');
        Plotly.Fx.hover(el, {{xval: {step}}}, 'xy');
        return Array.from(el.querySelectorAll('.hoverlayer .legend text.legendtext, '
            + '.hoverlayer .legend text')).map((t) => t.textContent); }}"""
    )


def test_hover_labels_have_units_and_step_axes_whole_steps(synthetic_server, page):
    page.goto(synthetic_server + "/#/compare")
    page.wait_for_selector(".picker", state="attached")
    page.evaluate(
        f"""async (config) => {{ {SETUP}
        charts.ingest(rec('trainer', 'run_started', 0, null, {{vram_source: 'cuda'}}));
        for (let step = 1; step <= 5; step++) feedStep(step, step, {{}});
        charts.flush();
    }}""",
        STREAMING,
    )
    phases = _hover_text(page, "phases", 3)
    assert "optimizer : 129.5 ms" in phases
    assert "step time : 11,545.7 ms" in phases
    host = _hover_text(page, "host", 3)
    assert "process RSS : 12,346 MB" in host and "pinned (trainer) : 8,192 MB" in host
    loss = _hover_text(page, "loss", 3)
    assert "loss : 0.3704" in loss and "grad norm : 0.988" in loss
    ticks = page.evaluate(
        """() => Object.fromEntries(['transfers', 'host', 'phases', 'loss'].map(
            (id) => [id, Array.from(document.querySelectorAll(`#${id} .xtick text`))
                .map((t) => t.textContent)]))"""
    )
    for chart, labels in ticks.items():
        assert labels and all(label.isdigit() for label in labels), (chart, labels)
    picture(page.locator("#charts-box"), "charts-units-ticks")


# Every chart's title and toolbar boxes, and whether the toolbar shows only on hover.
BOXES = """() => Array.from(document.querySelectorAll('.chart')).filter((el) => el.data).map((el) => {
    const box = (sel) => { const n = el.querySelector(sel); if (!n) return null;
        const r = n.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
    const bar = el.querySelector('.modebar');
    const r = el.getBoundingClientRect();
    return {id: el.id, title: box('.gtitle'), bar: box('.modebar'), right: r.right,
            hover: !!bar && bar.classList.contains('modebar--hover')};
})"""


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


FEED_AUTO = f"""async (config) => {{ {SETUP} {AUTO_RECORD}
    charts.ingest(rec('trainer', 'run_started', 0, null, {{vram_source: 'cuda'}}));
    charts.ingest(resolved(0.1, 0, 20480.4, 16384.7, [21504.25, 20480.5]));
    for (let step = 1; step <= 3; step++) feedStep(step, step, {{}});
    charts.ingest(rec('activation_stagehand', 'step', 4, 3, {{activations_kept: 150,
        activations_spilled: 50, spill_bytes: 2 ** 30, restore_bytes: 2 ** 30}}));
    charts.flush();
}}"""


def test_the_toolbar_shows_on_hover_clear_of_the_titles_and_not_on_phones(
    synthetic_server, page, open_page
):
    page.goto(synthetic_server + "/#/compare")
    page.wait_for_selector(".picker", state="attached")
    page.evaluate(FEED_AUTO, AUTO)
    boxes = page.evaluate(BOXES)
    assert len(boxes) == 9
    for chart in boxes:
        assert chart["hover"] and chart["bar"] and chart["title"], chart
        assert not _overlap(chart["bar"], chart["title"]), chart
    page.hover("#spill")
    picture(page.locator("#spill"), "chart-toolbar-desktop")
    # A phone has no hover: Plotly would show the toolbar all the time, over the title.
    phone = open_page({"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    phone.goto(synthetic_server + "/#/compare")
    phone.wait_for_selector(".picker", state="attached")
    phone.evaluate(FEED_AUTO.replace("'1300px'", "'370px'"), AUTO)
    boxes = phone.evaluate(BOXES)
    assert len(boxes) == 9 and all(chart["bar"] is None for chart in boxes), boxes
    # A title too long for the phone's width goes on two lines, not past the chart's edge.
    assert all(chart["title"][2] <= chart["right"] for chart in boxes), boxes
    picture(phone.locator("#spill"), "chart-toolbar-phone")
