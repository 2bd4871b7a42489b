"""What a plan's inputs beside the preset may be: the overrides of a device profile and the
text length, shared by ``workbench plan`` (its argparse types) and ``POST /api/plan`` (its
pydantic fields), torch-free so the server loads without the planner.

Anything outside these bounds is a typo or an attack whose plan means nothing: ``1e-300``
TFLOPs gave a 1.7e300 ms trace step beside a 0.0 ms steady one, ``--vram-gb 1e308`` an integer
overflow, and a VRAM that rounds to 0 bytes plans as if the card had no limit (0 is a CPU's
untracked budget). NaN compares false with every bound, so it is refused by name.
"""

from __future__ import annotations

import math

OVERRIDES: dict[str, tuple[float, float, str]] = {
    "vram_gb": (2**-10, 4096.0, "GiB, 1/1024 (1 MiB) to 4096 (4 TiB)"),
    "tflops": (1e-3, 1e5, "TFLOPs, 0.001 (1 GFLOP/s: under one CPU core) to 1e5 (100 PFLOP/s)"),
    "h2d_gbps": (1e-2, 4096.0, "GB/s, 0.01 (10 MB/s: USB 2) to 4096 (past any host link)"),
    "disk_gbps": (1e-2, 4096.0, "GB/s, 0.01 (10 MB/s: an SD card) to 4096"),
    "efficiency": (1e-2, 1.0, "the share of peak TFLOPs a block reaches, 0.01 to 1"),
}
"""Override name -> (lowest, highest, its unit and bounds in words)."""
DEVICE_PROFILES = ("cpu", "rtx3090", "rtx4090", "rtx5090", "h100", "h100-pcie")
"""The device profiles a plan may name: ``cpu`` (this machine's measured profile) and the named
GPUs of ``workbench.plan.profiles.PROFILES`` (tests/contract/test_contract.py holds the two equal). Here, not
there, so the server's schema can list them without importing the planner (and torch)."""
TEXT_LEN = (1, 4096)
"""Text tokens a plan's inputs may have: ``data.max_caption_tokens``' bounds."""


def override_problem(name: str, value: float) -> str | None:
    """What ``value`` should have been as the override ``name`` (a key of ``OVERRIDES``):
    ``expected a finite number: GiB, ...``, or None when it is fine.

    Raises:
        KeyError: ``name`` is not an override.
    """
    low, high, why = OVERRIDES[name]
    if not (math.isfinite(value) and low <= value <= high):
        return f"expected a finite number: {why}"
    return None
