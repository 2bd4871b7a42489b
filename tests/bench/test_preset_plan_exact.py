"""The composed preset (weight streaming + activation spill + the Conductor) on the CPU moves, step
by step, what the planner's simulation of the same section moves.

The tiny FLUX.1-dev preset row's section (``workbench bench --model flux-dev --size tiny --device
cpu --card-gb 24 --only preset``), run in this process and simulated. Before, the plan counted
kept activations at once (the run's activation runtime reports them to the weight runtime in
64 KiB batches, NOTE [ Tracked activations in the plan ]), ``temb`` once per block and after the
block's forward, and loaded the next step's first blocks at a step's end (the Conductor refuses
that prefetch, NOTE [ The Conductor at a step's end ]): 73, 29 and 42 loads against the run's
71, 31 and 41, 7,827,456 B of H2D a steady step against 7,522,304.
"""

from __future__ import annotations

import pytest
import torch

from stagehand.common.telemetry import ListSink, Telemetry
from stagehand.config.memory import MB
from stagehand.strategy import build_strategy
from workbench.bench.realmodel import load_lora_model, model_inventory, real_model
from workbench.bench.realsize import build_job, row_memory
from workbench.plan.plan import EFFICIENCY, check_memory
from workbench.plan.profiles import cpu_profile
from workbench.plan.simulate import Simulation
from workbench.plan.workload import train_steps
from workbench.worker.assets import example_inputs

CARD = 24 * 2**30  # --card-gb 24
STEPS = 3  # the trace step, the step after it, a steady step


@pytest.mark.sync_device  # the CPU's tracked accounting is what is compared
def test_each_step_of_the_composed_preset_moves_what_its_plan_simulates(flux_dev_tiny):
    spec = real_model("flux-dev")
    folder = flux_dev_tiny  # built once per session (conftest); build_job finds it built
    job = {"model": "flux-dev", "folder": str(folder), "size": "tiny", "device": "cpu"}
    assert build_job(job)["status"] == "ok"
    memory = row_memory("preset", "flux-dev", "tiny", card_bytes=CARD)
    sh = memory["stagehand"]
    assert sh["activation_stagehand"]["enabled"] and sh["conductor_config"]["enabled"]

    sink = ListSink()
    model = load_lora_model(spec, str(folder))
    strategy = build_strategy(
        model, memory, device="cpu", telemetry=Telemetry(sink), checkpoint_dir=str(folder)
    )
    latent_hw, text_len = spec.inputs_shape("tiny")
    inputs = example_inputs(
        model, latent_hw=latent_hw, text_len=text_len, device="cpu", dtype=torch.bfloat16
    )
    try:
        train_steps(strategy, model, inputs, warmup=0, steps=STEPS)
        counters = strategy.counters()
    finally:
        strategy.close()
    weights = sink.of("stagehand", "step")
    activations = sink.of("activation_stagehand", "step")

    config = check_memory(memory)
    sh = config.stagehand
    inv = model_inventory("flux-dev", "tiny", sh.block_pattern, sh.resident_trainable_max_fraction)
    sim = Simulation(inv, config, cpu_profile(), efficiency=EFFICIENCY["cpu"])
    planned = sim.run(STEPS)

    ran = [(r["blocks_loaded"], r["h2d_bytes"]) for r in weights]
    assert [(s.blocks_loaded, s.h2d_bytes) for s in planned] == ran
    assert ran[-1] == (41, 7_522_304)  # the bench's steady step, to the byte
    assert ran[0][0] == 71 and ran[1][0] == 31  # the Conductor moved 2 loads to step 1
    # The same accounting: the tracked peak of each step (kept activations as reported).
    assert [s.peak_bytes for s in planned] == [round(r["vram_peak_mb"] * MB) for r in activations]
    assert weights[-1]["resident_blocks"] == sum(b.on_device for b in sim.blocks) == 31
    # Not vacuous: blocks streamed under the Conductor's grants, activations kept and counted
    # (none spilled on this card), the steady step's loads are prefetches that did not wait.
    assert counters["grants"] == 41 and counters["denials"] == 0
    assert all(r["activations_kept"] > 3 * len(inv.blocks) for r in activations)
    assert counters["tensors_spilled"] == 0 == planned[-1].spilled_bytes
    assert counters["prefetch_misses"] == planned[-1].misses == 0
