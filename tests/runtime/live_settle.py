"""Shared by the live-settle tests (NOTE [ Live watermarks ] in ``runtime/stagehand/weights/policy.py``):
the tiny Flux + LoRA under the ``default`` preset's three runtimes (weight streaming, activation
spill, the Conductor), trained with limits given at the start or set live, and each step's
figures on the CPU's tracked counters."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, NamedTuple

import torch

from stagehand.common.telemetry import ListSink, Telemetry
from stagehand.config.limits import PATHS
from stagehand.strategy import build_strategy
from tests.runtime import exact
from workbench.worker.assets import example_inputs, output_tensor

DEFAULT = Path(__file__).resolve().parents[2] / "presets" / "default.json"
STEPS = 6
CHANGE_AT = 2
"""The step a live change applies at (queued before it begins)."""
STEADY = slice(CHANGE_AT + 2, STEPS)
"""The steps compared: after the change's trace step and the one that follows it."""


class Figures(NamedTuple):
    """One step's figures: blocks on the device at its end, H2D bytes of block weights, saved
    tensors spilled and their bytes, the tracked peak (bytes)."""

    resident_blocks: int
    h2d_bytes: int
    tensors_spilled: int
    spill_bytes: int
    peak_bytes: int


def memory(limits: dict[str, Any]) -> dict[str, Any]:
    """The ``default`` preset's ``memory`` section with ``limits`` (LiveLimits fields, MB) written
    at their config paths (``stagehand.config.limits.PATHS``)."""
    section = copy.deepcopy(json.loads(DEFAULT.read_text())["memory"])
    section.pop("gradient_checkpointing")  # the model's own (``exact.make_model``), not a field
    for field, value in limits.items():
        node = {"memory": section}
        *parents, name = PATHS[field].split(".")
        for key in parents:
            node = node[key]
        node[name] = value
    return section


def train(
    folder: Path,
    start: dict[str, Any],
    live: dict[str, Any] | None = None,
    checkpointing: str | None = None,
) -> tuple[list[Figures], ListSink]:
    """``STEPS`` LoRA steps of the tiny Flux in ``folder`` under ``memory(start)``; ``live`` is
    set with ``strategy.set_limits`` before step ``CHANGE_AT``. Returns each step's figures and
    the records."""
    model = exact.make_model("flux", folder, "lora", checkpointing, ordinary=True)
    sink = ListSink()
    strategy = build_strategy(
        model, memory(start), device="cpu", telemetry=Telemetry(sink), checkpoint_dir=folder
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    figures = []
    try:
        for step in range(STEPS):
            if live is not None and step == CHANGE_AT:
                strategy.set_limits(live, request_id="live")
            inputs = example_inputs(model, seed=step)
            with strategy.step(step):
                with strategy.forward():
                    loss = output_tensor(model(**inputs)).pow(2).mean()
                with strategy.backward():
                    loss.backward()
                with strategy.optimizer(optimizer):
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            c = strategy.counters()
            figures.append(
                Figures(
                    c["resident_blocks"],
                    c["h2d_bytes"],
                    c["tensors_spilled"],
                    c["spill_bytes"],
                    strategy.memory.peak_bytes(),
                )
            )
    finally:
        strategy.close()
    return figures, sink
