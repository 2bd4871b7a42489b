"""Plans against a benchmark: ``python -m workbench.plan.check bench.json`` (the JSON of
``workbench bench --quick``) plans every row that ran the stagehand, layer-offload or no strategy, with the
row's own memory section, model folder and input shape, on this machine's CPU profile, and
prints predicted against measured peak tracked VRAM and median step time.

The profile is the one the bench measured in its own worker just before its rows
(``cpu_profile`` in its JSON), when it has one: on a shared machine the load, and with it every
measured rate, changes between the bench and the check.

Peer rows are left out: the planner does not model them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from stagehand.config.memory import MB, MemoryConfig
from workbench.plan.inventory import add_lora, folder_model, inventory
from workbench.plan.plan import EFFICIENCY, simulate
from workbench.plan.profiles import DeviceProfile, cpu_profile
from workbench.plan.workload import LORA_RANK, LORA_TARGETS, latent_hw_for
from workbench.worker.assets import example_inputs


def _inventory(folder: str, size: str, cache: dict):
    if folder not in cache:
        model = folder_model(folder)
        add_lora(model, LORA_RANK, LORA_TARGETS)
        inputs = example_inputs(model, latent_hw=latent_hw_for(size), device="meta")
        cache[folder] = inventory(model, inputs)
    return cache[folder]


def compare(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per planned benchmark row: name, blocks, predicted and measured peak (MB) and
    step time (ms), and the relative errors."""

    # The profile the bench measured before its rows, when it recorded one: the rows ran under
    # that machine's load, not this one's.
    stored = bench.get("cpu_profile")
    profile = DeviceProfile(**stored) if stored else cpu_profile()
    cache: dict = {}
    out = []
    model = bench["model"]
    for row in bench["rows"] + bench.get("scale_rows", []):
        memory = row.get("memory_config")
        if row.get("status") != "ok" or not memory:
            continue
        if row["section"] == "main":
            folder, size = model["folder"], model["size"]
        else:
            folder = str(
                Path(model["folder"]).parent
                / f"{model['arch']}-{bench['scale_size']}-scale{row['blocks']}"
            )
            size = bench["scale_size"]
        inv = _inventory(folder, size, cache)
        steady = simulate(inv, MemoryConfig.model_validate(memory), profile, EFFICIENCY["cpu"])[-1]
        peak = row["summary"]["peak_vram_mb"]
        step = row["step_ms_median"]
        out.append(
            {
                "section": row["section"],
                "blocks": row["blocks"],
                "name": row["name"],
                "peak_mb": [round(steady.peak_bytes / MB, 3), round(peak, 3)],
                "peak_error": steady.peak_bytes / MB / peak - 1,
                "step_ms": [round(steady.step_ms, 1), round(step, 1)],
                "step_error": steady.step_ms / step - 1,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m workbench.plan.check BENCH_JSON", file=sys.stderr)
        return 2
    bench = json.loads(Path(argv[0]).read_text())
    bench.setdefault("scale_size", "tiny" if bench.get("quick") else "small")
    print(
        f"{'row':<28}{'peak MB pred':>13}{'meas':>9}{'err':>8}{'step ms pred':>14}{'meas':>8}{'err':>8}"
    )
    source = "measured by the bench before its rows" if bench.get("cpu_profile") else "measured now"
    print(f"cpu profile: {source}")
    for r in compare(bench):
        name = f"{r['section']} {r['blocks']:>2} {r['name']}"
        print(
            f"{name:<28}{r['peak_mb'][0]:>13.3f}{r['peak_mb'][1]:>9.3f}{r['peak_error']:>8.1%}"
            f"{r['step_ms'][0]:>14.1f}{r['step_ms'][1]:>8.1f}{r['step_error']:>8.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
