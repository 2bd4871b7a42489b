"""Runtime tests run in their own temp folder: a runtime built without a ``Telemetry`` writes
its default JSONL file (``stagehand_telemetry.jsonl``...) into the working directory.

``STAGEHAND_TEST_LAG=N`` runs every test under the device double with a lag of N operations
(``device_double.py``: device memory apart from the host, copies and kernels late in stream order, a caching allocator per stream, freed memory poisoned)."""

import os

import pytest
import torch

from stagehand.common.attention import SETTINGS, apply_attention_backend
from workbench.contract.preset.schema import ModelSection

from .device_double import device_double


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _device_double(request):
    lag = os.environ.get("STAGEHAND_TEST_LAG")
    if not lag or request.node.get_closest_marker("sync_device"):
        yield
        return
    with device_double(int(lag)):
        yield


# -- GPU tests under the trainer's attention guard (issue 57 item 6) -------------------------------
# Tests marked ``gpu`` run with cuDNN SDPA as a run on the same GPU has it (``_cudnn_sdp_guard``,
# NOTE [ cuDNN SDPA guard ]); ``@pytest.mark.cudnn_sdp("on")`` or ``STAGEHAND_TEST_CUDNN_SDP``
# choose another setting.
CUDNN_SDP_ENV = "STAGEHAND_TEST_CUDNN_SDP"
"""Environment variable: the ``model.cudnn_sdp`` setting every gpu test without a ``cudnn_sdp``
marker runs under, in place of the preset's default (``./dev gpu-check diagnose`` sets it)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cudnn_sdp(setting): the model.cudnn_sdp setting (auto, on, off) a gpu test runs under "
        "instead of the preset's default; cudnn_sdp('on') keeps cuDNN SDPA on "
        "(NOTE [ cuDNN SDPA guard ])",
    )


def cudnn_sdp_setting(node: pytest.Item) -> str | None:
    """The ``model.cudnn_sdp`` setting the guard applies for the test ``node``: None for a test
    not marked ``gpu``; else its ``cudnn_sdp(setting)`` marker's, else ``$STAGEHAND_TEST_CUDNN_SDP``,
    else the preset's default (``ModelSection.cudnn_sdp``), as the trainer reads it.

    Raises:
        ValueError: the marker's argument or the environment variable is not one of ``auto``,
            ``on``, ``off`` (names the test or the variable).
    """
    if node.get_closest_marker("gpu") is None:
        return None
    marker = node.get_closest_marker("cudnn_sdp")
    if marker is not None:
        setting, source = (marker.args or (None,))[0], f"{node.nodeid}: cudnn_sdp marker"
    elif os.environ.get(CUDNN_SDP_ENV):
        setting, source = os.environ[CUDNN_SDP_ENV], f"${CUDNN_SDP_ENV}"
    else:
        return ModelSection.model_fields["cudnn_sdp"].default
    if setting not in SETTINGS:
        raise ValueError(f"{source} must be one of {list(SETTINGS)}, got {setting!r}")
    return setting


@pytest.fixture(autouse=True)
def _cudnn_sdp_guard(request):
    """A gpu test runs with cuDNN SDPA as a run on the GPU has it: ``apply_attention_backend``
    with the setting of ``cudnn_sdp_setting`` on device ``cuda``, as ``backend/workbench/worker/run.py`` applies
    it at a run's start (NOTE [ cuDNN SDPA guard ]: ``auto`` turns it off on sm90/sm100 with
    torch >= 2.11). The process-wide flag is put back after the test. Yields the
    ``AttentionChoice`` (None for a test not marked gpu)."""
    setting = cudnn_sdp_setting(request.node)
    if setting is None:
        yield None
        return
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    choice = apply_attention_backend(setting, "cuda")
    try:
        yield choice
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)
