"""On a CPU device nothing is page-locked and the weight pool fills as blocks use it: what the
worker reports as "pinned" (the pools' sizes) and the plan's host RAM (the pools at their full
size) are budgets. The run page's host chart, the plan and the calibration table say so, beside
what is measured (the process RSS). A CPU run of the Qwen-Image preset on its tiny pipeline
reported 9,384 MB "pinned" beside a 513 MB RSS."""

from __future__ import annotations

import copy

import pytest

from tests.frontend.conftest import Api, picture

pytestmark = [pytest.mark.browser]


def _open(page, base: str) -> None:
    page.goto(base + "/#/compare")
    page.wait_for_selector(".picker", state="attached")


def test_host_chart_of_a_cpu_run_names_the_pools_a_budget(synthetic_server, page):
    _open(page, synthetic_server)
    host = page.evaluate("""async () => {
        const { RunCharts } = await import('/static/js/runcharts.js');
        document.body.innerHTML = '';
        const box = document.createElement('div');
        box.className = 'chart-grid';
        box.style.width = '1300px';
        document.body.append(box);
        const charts = new RunCharts(box, {});
        const rec = (kind, time, step, fields) => ({seq: time, time: 100 + time,
            source: 'trainer', kind, step, phase: null, ...fields});
        charts.ingest(rec('run_started', 0, null, {device: 'cpu', vram_source: 'tracked'}));
        for (let step = 1; step <= 4; step++) {
            charts.ingest(rec('step', step, step, {loss: 1, rss_mb: 513 + step,
                pinned_mb: 9384, vram_source: 'tracked', phase_ms: {}}));
            charts.ingest({...rec('step', step + 0.5, step, {pool_used_mb: 0,
                pool_total_mb: 8192, h2d_bytes: 0, blocks_loaded: 0, resident_blocks: 3}),
                source: 'stagehand'});
        }
        charts.flush();
        const el = document.getElementById('host');
        return {names: el.data.map((t) => t.name), dash: el.data.map((t) => t.line.dash),
                title: el.layout.title.text};
    }""")
    assert host["names"] == [
        "process RSS",
        "pools (budget)",
        "weight pool used",
        "pool size (budget)",
    ]
    assert host["dash"][1] == "dot"  # drawn as a limit, not as a measured line
    assert host["title"] == "Host memory (MB; on CPU the pools are budgets, not pinned)"
    picture(page.locator("#host"), "chart-host-cpu-budgets")


MB = 2**20
PLAN = {  # the fields the Plan panel reads, as POST /api/plan gives them for a GPU profile
    "fits": True,
    "knob": None,
    "device": {"name": "rtx4090", "vram_bytes": 24 * 1024 * MB},
    "vram_source": "allocated",
    "peak_bytes": {"steady": 1.5 * MB, "trace_step": 1.6 * MB},
    "steady_band_bytes": [MB, 1.5 * MB],
    "host": {
        "ram_peak_bytes": 9777.8 * MB,
        "pinned_bytes": 9384 * MB,
        "host_cache_bytes": 0,
        "spilled_activation_bytes": 0,
    },
    "step_ms": {"total": 400.0, "compute": 390.0, "exposed_h2d": 10.0, "stall": 0.0},
    "transfers": None,
    "quant_error": None,
    "auto_watermarks": None,
    "curve": {"t_ms": [0, 1, 2], "bytes": [0, MB, 0], "event": ["load", "enter", "evict"]},
}


def _answer(plan: dict):
    return lambda route: route.fulfill(json=plan)


def test_plan_on_cpu_gives_host_ram_as_a_budget(synthetic_server, page):
    config = Api(synthetic_server).call("GET", "/api/presets/tiny-ci")["config"]
    gpu = PLAN
    # The cpu profile is a tracked device: the plan gives the same figures, for the host.
    cpu = copy.deepcopy(PLAN)
    cpu["vram_source"] = "tracked"
    cpu["device"].update(name="cpu", vram_bytes=None)
    _open(page, synthetic_server)
    texts = {}
    for name, plan in (("gpu", gpu), ("cpu", cpu)):
        page.unroute("**/api/plan")
        page.route("**/api/plan", _answer(plan))
        texts[name] = page.evaluate(
            """async (config) => {
            const { planPanel } = await import('/static/js/plan.js');
            document.body.innerHTML = '';
            document.body.append(planPanel({getConfig: () => config}).el);
            document.getElementById('plan-run').click();
            for (let i = 0; i < 500 && !document.querySelector('#plan-host, .error-box'); i++) {
                await new Promise((r) => setTimeout(r, 20));
            }
            const host = document.getElementById('plan-host');
            return host ? host.textContent : document.getElementById('plan-errors').textContent;
        }""",
            config,
        )
    assert texts["gpu"].startswith("host RAM peak ")
    assert texts["cpu"].startswith("host RAM budget 9777.8 MiB (the worker with its pools ")
    assert "pools and host cache at their full size: 9384.0 MiB" in texts["cpu"]
    assert "on CPU nothing is pinned" in texts["cpu"]
    picture(page.locator("#plan-summary"), "plan-cpu-host-budget")


def test_calibration_of_a_cpu_run_labels_the_budget_rows(synthetic_server, page):
    _open(page, synthetic_server)
    labels = page.evaluate("""async () => {
        const { calibrationView } = await import('/static/js/calibration.js');
        const figures = {peak_vram_mb: 1.5, step_ms: 400, host_ram_mb: 9777.8, pinned_mb: 9384};
        const rows = (device) => {
            const { nodes } = calibrationView({device, family: 'qwenimage', run_id: 7,
                predicted: figures, measured: {...figures, host_ram_mb: 513}, ratios: {}});
            const table = nodes.find((n) => n.id === 'calibration-table');
            return Array.from(table.querySelectorAll('tbody tr'))
                .map((tr) => tr.firstElementChild.textContent);
        };
        return {cpu: rows('cpu'), gpu: rows('rtx4090')};
    }""")
    assert labels["gpu"] == ["peak VRAM (training)", "mean step time", "host RAM peak", "pinned"]
    assert labels["cpu"][2:] == [
        "host RAM peak (predicted: a budget, the pools at their full size; measured: RSS)",
        "pinned (the pools' sizes: budgets on CPU, nothing is pinned)",
    ]
