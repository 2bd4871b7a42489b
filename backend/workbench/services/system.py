"""Device, VRAM, RAM and library versions, probed once without importing torch here.

The server must stay torch-free (fast start, no CUDA context in the process that supervises
the GPU's workers), so torch is asked in a short-lived subprocess, started in the background at
start-up; ``info()`` waits for it at most ``timeout_s``. A CPU-only build of torch (its
``torch/version.py`` names no CUDA, ROCm or XPU) has no device but the CPU to report: its
figures are read from that file, without the subprocess (~3 s of CPU importing torch).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

MB = 2**20

_PROBE = r"""
import json, torch
out = {"torch_version": torch.__version__, "cuda_version": torch.version.cuda,
       "device": "cpu", "device_name": None, "vram_total_mb": None, "cuda_devices": 0}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out.update(device="cuda:0", device_name=p.name, vram_total_mb=p.total_memory / 2**20,
               cuda_devices=torch.cuda.device_count())
print(json.dumps(out))
"""


def cpu_build_info(version_py: Path | None = None) -> dict[str, Any] | None:
    """The probe's answer for a CPU-only torch build, read from its ``torch/version.py``
    (``version_py``, else the installed torch's; its literal assignments only, nothing is
    imported or run): ``{torch_version, cuda_version: None, device: "cpu", ...}``. None when
    torch is missing, the file unreadable, or the build has CUDA, ROCm (``hip``) or XPU support
    (or predates those fields), which only importing torch can probe."""
    try:
        if version_py is None:
            spec = importlib.util.find_spec("torch")
            version_py = Path(list(spec.submodule_search_locations or [])[0]) / "version.py"
        tree = ast.parse(version_py.read_text())
    except (AttributeError, ImportError, IndexError, OSError, SyntaxError, ValueError):
        return None
    values: dict[str, Any] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and getattr(node, "value", None) is not None:
            try:
                values[target.id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    if not isinstance(values.get("__version__"), str) or any(
        values.get(key, "unknown") is not None for key in ("cuda", "hip", "xpu")
    ):
        return None
    return {
        "torch_version": values["__version__"],
        "cuda_version": None,
        "device": "cpu",
        "device_name": None,
        "vram_total_mb": None,
        "cuda_devices": 0,
    }


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


class SystemProbe:
    """Runs the torch probe once; thread-safe. ``executor``'s cluster is asked on each
    ``info`` (a Ray cluster's free GPUs change)."""

    def __init__(self, executor: Any = None) -> None:
        self.executor = executor
        self._done = threading.Event()
        self._result: dict[str, Any] = {}
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._probe, name="system-probe", daemon=True).start()

    def _probe(self) -> None:
        cpu = cpu_build_info()
        if cpu is not None:
            self._result = cpu
            self._done.set()
            return
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
            )
            self._result = json.loads(proc.stdout.strip().splitlines()[-1])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            self._result = {}
        finally:
            self._done.set()

    def default_device(self) -> str | None:
        """This machine's default worker device (``"cuda:0"`` or ``"cpu"``), without waiting:
        None until the probe has answered, and when it failed."""
        return self._result.get("device") if self._done.is_set() else None

    def info(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """``{device, device_name, vram_total_mb, cuda_devices, ram_total_mb, torch_version,
        cuda_version, version, executor, cluster}`` (MB of 2**20 bytes); torch figures are None
        when the probe failed; ``cuda_devices`` counts the CUDA devices a run may name
        (``cuda:N``); ``cluster`` is None for the local executor."""
        self.start()
        self._done.wait(timeout_s)
        probe = self._result
        return {
            "device": probe.get("device", "unknown"),
            "device_name": probe.get("device_name"),
            "vram_total_mb": probe.get("vram_total_mb"),
            "cuda_devices": probe.get("cuda_devices", 0),
            "ram_total_mb": psutil.virtual_memory().total / MB,
            "torch_version": probe.get("torch_version") or _version("torch"),
            "cuda_version": probe.get("cuda_version"),
            "version": _version("stagehand-workbench") or "0.0.0",
            "executor": self.executor.name if self.executor is not None else "local",
            "cluster": self.executor.cluster() if self.executor is not None else None,
        }
