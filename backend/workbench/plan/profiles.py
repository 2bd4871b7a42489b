"""Device profiles: what a plan's cost model needs to know about a device.

``PROFILES`` holds named GPUs with their vendor figures; ``cpu_profile()`` measures this
machine with a micro-benchmark (a plan on CPU predicts ``tracked`` bytes and host-side copies),
and a plan's ``cpu`` profile is the median of a few of those measurements, stored per machine
(``stored_cpu_profile``, NOTE [ One CPU profile per machine ]).
Efficiency (the share of peak TFLOPs a transformer block reaches) is the plan's parameter, not
the profile's.

Sources of the table (figures not measured here; the project's machines have no GPU):

- bf16 dense tensor TFLOPs with FP32 accumulate: NVIDIA Ampere GA102 whitepaper (RTX 3090:
  71), Ada Lovelace whitepaper (RTX 4090: 165.2), RTX Blackwell GPU architecture whitepaper
  (RTX 5090: 209.5), H100 Tensor Core GPU datasheet (H100 SXM5 80GB: 989.4; H100 PCIe 80GB:
  756.5, half its 1,513 "with sparsity").
- Memory GB/s: the same documents (936, 1008, 1792; H100 SXM5 HBM3 3350, H100 PCIe HBM2e
  2000).
- Pinned H2D GB/s: what CUDA's ``bandwidthTest --memory=pinned`` typically reports on the card's
  host link, about 80% of the link's raw rate: PCIe 4.0 x16 (32 GB/s raw) 25 GB/s; PCIe 5.0 x16
  (64 GB/s raw) 50 GB/s (both H100 forms have a PCIe 5.0 x16 host link; an H100 SXM5 80GB
  HBM3 measured 49.5 GB/s here, ``docs/perf-gpu.md``). Pass ``--h2d-gbps`` with your own
  measurement to replace it.
- Page cache -> pinned slab read GB/s (``read_gbps``): the same H100 host with 4 reader
  threads measured 13.9 GB/s (4.4 on 1, 22.8 on 8; ``docs/perf-gpu.md``); every GPU profile
  uses the 4-thread figure (the runtime's readers: half the host's cores, 2 to 8). A host's
  own figure replaces it (``read_gbps`` override); ``--disk-gbps`` says the files come from
  storage at that rate instead.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from stagehand.config.cache import cache_dir
from workbench.plan.calibrate import calibrate
from workbench.plan.inventory import PlanInputError


@dataclass(frozen=True)
class DeviceProfile:
    """A compute device for the cost model."""

    name: str
    vram_bytes: int
    """Memory the device has (bytes); on CPU the tracked budget is unbounded (0)."""
    tflops: float
    """Peak dense TFLOPs in the training dtype."""
    h2d_gbps: float
    """Host -> device copy bandwidth from a pinned buffer, GB/s (1e9 bytes/s)."""
    source: str
    mem_gbps: float = 0.0
    """Device memory bandwidth, GB/s: the cost of operations that are not matrix products."""
    op_us: float = 0.0
    """Fixed cost of one operation, us: what the host spends dispatching it where it is not
    hidden behind the device's queue (a CPU device); 0 on a GPU."""
    load_us: float = 0.0
    """Fixed cost of one block load beyond its bytes, us, where it is not hidden (a CPU device:
    a fresh allocation's page faults, the parameters re-viewed)."""
    disk_gbps: float | None = None
    """On a GPU: the storage read rate of file-backed blocks without a host-cache image (GB/s;
    None: the files are in the page cache, read at ``read_gbps``). On a CPU device: what
    reading the slab from the page cache costs beyond copying it from the host masters."""
    read_gbps: float = 13.9
    """Page cache -> pinned slab read rate of the weight runtime's reader threads (GB/s): a
    GPU's file-backed loads without a host-cache image (NOTE [ Where a load's bytes come from ]
    in ``simulate.py``)."""
    tracked: bool = False
    """A CPU "device": figures are the runtimes' tracked bytes."""
    synchronous_copies: bool = False
    """Copies run on the host in line with compute (no copy engine)."""
    measured: dict | None = field(default=None, hash=False)
    """A stored CPU profile's measurements (``stored_cpu_profile``): ``{path, count, wanted,
    values: {figure: [each measurement's value]}}``; None for a vendor profile or one
    measurement."""

    def to_dict(self) -> dict:
        return asdict(self)


GB = 10**9
GIB = 2**30

PROFILES: dict[str, DeviceProfile] = {
    "rtx3090": DeviceProfile(
        "rtx3090", 24 * GIB, 71.0, 25.0, "GA102 whitepaper; PCIe 4.0 x16 bandwidthTest", 936.0
    ),
    "rtx4090": DeviceProfile(
        "rtx4090",
        24 * GIB,
        165.2,
        25.0,
        "Ada Lovelace whitepaper; PCIe 4.0 x16 bandwidthTest",
        1008.0,
    ),
    "rtx5090": DeviceProfile(
        "rtx5090",
        32 * GIB,
        209.5,
        50.0,
        "RTX Blackwell whitepaper; PCIe 5.0 x16 bandwidthTest",
        1792.0,
    ),
    "h100": DeviceProfile(
        "h100",
        80 * GIB,
        989.4,
        50.0,
        "H100 SXM5 80GB HBM3 datasheet; PCIe 5.0 x16 host link, bandwidthTest",
        3350.0,
    ),
    "h100-pcie": DeviceProfile(
        "h100-pcie",
        80 * GIB,
        756.5,
        50.0,
        "H100 PCIe 80GB HBM2e datasheet; PCIe 5.0 x16 bandwidthTest",
        2000.0,
    ),
}


def _best_ms(fn, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


@functools.cache
def cpu_profile(dtype: str = "float32") -> DeviceProfile:
    """This machine as a CPU device, measured at the first call in a process (a few seconds).

    TFLOPs: a 512 x 512 x 512 matmul in ``dtype`` on the threads torch uses. Memory GB/s and
    the cost per operation: resident LoRA steps of the tiny and the small flux model (an
    in-place multiply of 64 MB when those disagree); per block load, fixed and per byte
    (``h2d_gbps``): streamed steps of both, module-backed; per byte read from a file
    (``disk_gbps``): the small one streamed from its folder (``workbench.plan.calibrate``, NOTE
    [ Block loads measured in a step ]). Where a solution is not positive, the copy benchmark:
    what the weight runtime does per block on CPU, a copy into a staging buffer, then a copy
    into a fresh allocation (whose first touch costs page faults), for a 16 MB block.
    """
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(512, 512, dtype=dt)
    b = torch.randn(512, 512, dtype=dt)
    ms = _best_ms(lambda: a @ b)
    tflops = 2 * 512**3 / (ms * 1e-3) / 1e12
    n = 16 * 2**20
    big = torch.ones(4 * n // 4)  # 64 MB: larger than the caches, as a model's weights are
    mem_ms = _best_ms(lambda: big.mul_(1.0001), repeat=3)
    src = torch.empty(n, dtype=torch.uint8).fill_(1)
    slab = torch.empty(n, dtype=torch.uint8)

    def staged() -> None:
        slab.copy_(src)
        torch.empty(n, dtype=torch.uint8).copy_(slab)

    copy_ms = _best_ms(staged)
    mem_gbps = 2 * 4 * n / (mem_ms * 1e-3) / GB
    copy_gbps = n / (copy_ms * 1e-3) / GB

    c = calibrate(tflops, mem_gbps, copy_gbps)
    return DeviceProfile(
        "cpu",
        0,
        round(tflops, 4),
        round(c["h2d_gbps"], 3),
        f"measured on this machine ({torch.get_num_threads()} threads, {dtype})",
        mem_gbps=round(c["mem_gbps"], 3),
        op_us=round(c["op_us"], 3),
        load_us=round(c["load_us"], 3),
        disk_gbps=None if c["disk_gbps"] is None else round(c["disk_gbps"], 3),
        tracked=True,
        synchronous_copies=True,
    )


# NOTE [ One CPU profile per machine ]
# A CPU profile measured once per process moved with the load of the moment: two servers on
# one machine measured 257.6 and 668.5 us per operation, and planned the same preset at 1,358
# and 437 ms; the calibration ratios stored by one were applied to plans of the other. So a
# plan's ``cpu`` profile is stored per machine (the workbench cache's ``cpu-profile.json``,
# keyed by the CPU, its cores, torch's threads and version, and the dtype): the first
# ``MEASUREMENTS`` processes that plan on ``cpu`` each add one measurement, and every figure is
# the median of those stored, so one disturbed measurement cannot move it once three are in
# and every later process plans with the same profile, measuring nothing. A new CPU, thread
# count or torch version starts again; deleting the file measures afresh. ``workbench bench``
# still measures at its own moment (``cpu_profile``), next to the rows it compares.
MEASUREMENTS = 3
"""Measurements of a machine whose per-figure median is its stored CPU profile."""
MEASURED_FIGURES = ("tflops", "h2d_gbps", "mem_gbps", "op_us", "load_us", "disk_gbps")
PROFILE_FILE = "cpu-profile.json"


def machine_key(dtype: str) -> dict:
    """What a stored CPU profile is of: the CPU model, logical cores, torch's threads and
    version, and ``dtype``."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model
            )
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": dtype,
    }


def _usable(measurement: object) -> bool:
    """Whether a stored measurement is a CPU profile's dict with its figures (a file edited by
    hand, or of an older layout, is measured again, not trusted)."""
    if not isinstance(measurement, dict) or measurement.get("name") != "cpu":
        return False
    needed = ("vram_bytes", "tflops", "h2d_gbps", "mem_gbps", "op_us", "load_us")
    return all(isinstance(measurement.get(f), (int, float)) for f in needed)


def _stored_measurements(path: Path, key: dict) -> list[dict]:
    """The usable measurements stored at ``path`` for the machine ``key`` (at most
    ``MEASUREMENTS``); none when the file is missing, unreadable or of another machine."""
    try:
        stored = json.loads(path.read_text())
        kept = stored["measurements"] if stored.get("machine") == key else []
        return [m for m in kept if _usable(m)][:MEASUREMENTS]
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return []


def stored_profile(path: Path, key: dict, measure: Callable[[], DeviceProfile]) -> DeviceProfile:
    """The CPU profile stored at ``path`` for the machine ``key``, with one more measurement
    (``measure()``, a ``DeviceProfile``) added and stored while fewer than ``MEASUREMENTS`` are
    in: each of ``MEASURED_FIGURES`` the median of the stored values (NOTE [ One CPU profile
    per machine ]). A file of another machine, or unreadable, starts again; one that cannot be
    written leaves the profile of what was measured."""
    kept = _stored_measurements(path, key)
    if len(kept) < MEASUREMENTS:
        start = time.monotonic()
        fresh = measure()
        took = round(time.monotonic() - start, 1)
        kept.append({**fresh.to_dict(), "measured_at": time.time(), "measure_s": took})
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"machine": key, "measurements": kept}, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass
    values = {f: [m.get(f) for m in kept] for f in MEASURED_FIGURES}
    figures = {}
    for f, got in values.items():
        numbers = [v for v in got if isinstance(v, (int, float))]
        figures[f] = round(statistics.median(numbers), 4) if numbers else None
    base = {k: v for k, v in kept[0].items() if k in DeviceProfile.__dataclass_fields__}
    n = len(kept)
    what = "one measurement" if n == 1 else f"median of {n} measurements"
    source = f"{what} of {MEASUREMENTS} on this machine ({key['threads']} threads, "
    source += f"{key['dtype']}), stored in {path}"
    measured = {"path": str(path), "count": n, "wanted": MEASUREMENTS, "values": values}
    return DeviceProfile(**{**base, **figures, "source": source, "measured": measured})


_MEASURED: dict[str, DeviceProfile] = {}
_MEASURING = threading.Lock()


def stored_cpu_profile(dtype: str = "float32") -> DeviceProfile:
    """This machine's stored CPU profile (``stored_profile`` in the workbench cache), read
    once per process; the first processes on a machine measure (``cpu_profile``: tens of
    seconds, ``cpu_profile_status``). Threads asking at once (the server's requests) wait for
    one measurement rather than each taking one: two at once on a 2-core machine would each
    take twice as long and disturb each other's figures."""
    with _MEASURING:
        if dtype not in _MEASURED:
            _MEASURED[dtype] = stored_profile(
                cache_dir() / PROFILE_FILE, machine_key(dtype), lambda: cpu_profile(dtype)
            )
        return _MEASURED[dtype]


stored_cpu_profile.cache_clear = _MEASURED.clear  # type: ignore[attr-defined]
"""Forget the profile read by this process (the next call reads, or measures, again)."""


def cpu_profile_status(dtype: str = "float32") -> dict:
    """Whether the next ``cpu`` plan in this process measures this machine first, read from
    the stored file without measuring: ``{"will_measure", "measuring", "measurements",
    "wanted", "measure_s"}`` (``measurements`` stored of ``wanted``; ``measure_s``: seconds
    the last stored measurement took, None before the first)."""
    if dtype in _MEASURED:
        return {
            "will_measure": False,
            "measuring": False,
            "measurements": (_MEASURED[dtype].measured or {}).get("count", 0),
            "wanted": MEASUREMENTS,
            "measure_s": None,
        }
    kept = _stored_measurements(cache_dir() / PROFILE_FILE, machine_key(dtype))
    took = [m["measure_s"] for m in kept if isinstance(m.get("measure_s"), (int, float))]
    return {
        "will_measure": len(kept) < MEASUREMENTS,
        "measuring": _MEASURING.locked(),
        "measurements": len(kept),
        "wanted": MEASUREMENTS,
        "measure_s": took[-1] if took else None,
    }


def profile(name: str, **overrides: float) -> DeviceProfile:
    """The profile ``name`` (a key of ``PROFILES``, or ``cpu``: ``stored_cpu_profile``) with
    ``overrides`` applied (``vram_bytes``, ``tflops``, ``h2d_gbps``, ``disk_gbps``,
    ``read_gbps``).

    Raises:
        PlanInputError: unknown name (field ``device``), or an override that is not a finite
            number > 0 (naming it).
    """

    if name == "cpu":
        base = stored_cpu_profile()
    elif name in PROFILES:
        base = PROFILES[name]
    else:
        known = ", ".join(["cpu", *PROFILES])
        raise PlanInputError(f"device: unknown profile {name!r}; known: {known}")
    given = {k: v for k, v in overrides.items() if v is not None}
    for key, value in given.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise PlanInputError(f"{key} must be a finite number > 0, got {value!r}")
    return replace(base, **given) if given else base
