"""The runtime's example (``runtime/examples/lora_stream.py``) runs as documented: a LoRA trains,
blocks stream from the checkpoint, activations spill, the Conductor grants, the numbers are the
plain model's, and the library alone is imported (never ``workbench``)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "runtime" / "examples" / "lora_stream.py"


def load_example():
    spec = importlib.util.spec_from_file_location("lora_stream", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_trains_a_lora_with_every_runtime_on_and_imports_no_workbench():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--device", "cpu", "--steps", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert [line.split(":")[0] for line in lines[:-1]] == ["step 0", "step 1", "step 2"]
    assert figures["workbench_imported"] is False  # the library reads alone
    losses = figures["losses"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[2] < losses[0]  # one batch, three AdamW steps: it learns
    assert figures["lora_tensors"] == 24 and figures["lora_changed"] == 24  # 4 blocks x q/k/v x A/B
    # The last step's work: blocks loaded from the file ahead of use, every one evicted after
    # it (low watermark 0), saved activations spilled and restored, the Conductor's grants.
    assert figures["blocks_loaded"] > 0 and figures["blocks_evicted"] > 0
    assert figures["prefetch_hits"] > 0 and figures["prefetch_misses"] == 0
    assert figures["file_reads"] > 0 and figures["h2d_bytes"] > 0
    assert figures["tensors_spilled"] > 0 and figures["spill_bytes"] > 0
    assert figures["tensors_restored"] == figures["tensors_spilled"]
    assert figures["grants"] > 0 and figures["pageable_copies"] == 0
    assert figures["records"] > 0  # telemetry reached the sink


def test_the_example_computes_what_the_plain_model_computes():
    """NOTE [ Exact numbers ] (``runtime/stagehand/__init__.py``) on the example itself: the same
    run with ``strategy: "none"`` gives the same losses, bit for bit, and does no runtime work."""
    example = load_example()
    streamed = example.run("cpu", steps=3)
    plain = example.run("cpu", steps=3, memory={"strategy": "none"})
    assert streamed["losses"] == plain["losses"]
    assert streamed["blocks_loaded"] > 0 and streamed["spill_bytes"] > 0
    assert plain["blocks_loaded"] == plain["spill_bytes"] == plain["grants"] == 0
