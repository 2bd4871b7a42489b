"""The server's device probe (``workbench.services.system``): on a CPU-only torch build it
reads ``torch/version.py`` and starts no subprocess; what it says is what the subprocess's
import of torch says."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from workbench.services import system
from workbench.services.system import _PROBE, SystemProbe, cpu_build_info

CPU_BUILD = """from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']
__version__ = '{version}'
debug = False
cuda: Optional[str] = {cuda}
git_version = 'cf30153c4c131c8164ee7798e5022d810682e2cb'
hip: Optional[str] = {hip}
rocm: Optional[str] = None
xpu: Optional[str] = None
"""


def test_the_installed_torch_reads_as_its_import_says():
    read = cpu_build_info()
    if torch.version.cuda or torch.version.hip:
        assert read is None  # only importing torch can tell the devices of a GPU build
        return
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300
    )
    assert read == json.loads(out.stdout.strip().splitlines()[-1])
    assert read["torch_version"] == torch.__version__ and read["device"] == "cpu"


@pytest.mark.parametrize(
    ("cuda", "hip", "expected"),
    [("None", "None", "cpu"), ("'12.8'", "None", None), ("None", "'6.4.1'", None)],
)
def test_only_a_build_without_cuda_rocm_or_xpu_is_read_from_its_version_file(
    tmp_path, cuda, hip, expected
):
    path = tmp_path / "version.py"
    path.write_text(CPU_BUILD.format(version="2.13.0+cpu", cuda=cuda, hip=hip))
    read = cpu_build_info(path)
    assert (read and read["device"]) == expected
    if expected:
        assert read == {
            "torch_version": "2.13.0+cpu",
            "cuda_version": None,
            "device": "cpu",
            "device_name": None,
            "vram_total_mb": None,
            "cuda_devices": 0,
        }
    # A build from before the xpu field, a damaged file, none: the subprocess asks torch.
    path.write_text(CPU_BUILD.format(version="2.4.0", cuda="None", hip="None").replace("xpu", "x"))
    assert cpu_build_info(path) is None
    path.write_text("__version__ = ")
    assert cpu_build_info(path) is None
    assert cpu_build_info(tmp_path / "missing.py") is None


def test_a_cpu_build_is_probed_without_a_subprocess(monkeypatch):
    if cpu_build_info() is None:
        pytest.skip("torch here is a GPU build: the subprocess probes it")

    def refuse(*args, **kwargs):
        raise AssertionError(f"subprocess started: {args}")

    monkeypatch.setattr(system.subprocess, "run", refuse)
    probe = SystemProbe()
    info = probe.info(timeout_s=5)
    assert probe.default_device() == "cpu"
    assert (info["device"], info["torch_version"], info["cuda_devices"]) == (
        "cpu",
        torch.__version__,
        0,
    )
