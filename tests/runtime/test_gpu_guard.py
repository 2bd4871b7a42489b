"""The GPU tests' attention guard (``_cudnn_sdp_guard`` in ``tests/runtime/conftest.py``, issue
57 item 6), checked on the CPU: ``torch.backends.cuda``'s cuDNN SDPA flag exists on a CPU build.

The guard only acts for tests marked ``gpu``, which are skipped here, so a small test session is
run in-process (pytester) with the real fixture: its tests write the flag they saw into a real
JSON file, and the flag is read again after each one."""

import json

import pytest
import torch

from tests.runtime import conftest as guard
from workbench.contract.preset.schema import ModelSection

pytest_plugins = ["pytester"]

INNER = """
import json, os, pathlib
import pytest
import torch

def _seen(name, choice):
    path = pathlib.Path(os.environ["GUARD_LOG"])
    log = json.loads(path.read_text()) if path.exists() else []
    log.append({"test": name, "enabled": torch.backends.cuda.cudnn_sdp_enabled(),
                "setting": choice and choice.cudnn_sdp})
    path.write_text(json.dumps(log))

def test_plain(_cudnn_sdp_guard):
    _seen("plain", _cudnn_sdp_guard)

@pytest.mark.gpu
def test_guarded(_cudnn_sdp_guard):
    _seen("guarded", _cudnn_sdp_guard)

def test_between(_cudnn_sdp_guard):
    _seen("between", _cudnn_sdp_guard)

@pytest.mark.gpu
@pytest.mark.cudnn_sdp("on")
def test_kept_on(_cudnn_sdp_guard):
    _seen("kept_on", _cudnn_sdp_guard)
"""


@pytest.fixture
def cudnn_sdp_flag():
    """The process-wide flag, put back as it was after the test."""
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(enabled)


@pytest.fixture
def hopper(monkeypatch):
    """The CUDA device ``apply_attention_backend`` asks about reports sm90 (an H100/H200): the
    one fact of a GPU the guard reads, so its decision on the lent machine is taken here."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def run_inner(pytester, monkeypatch, calls=None):
    """Run ``INNER`` under the real guard; returns the log of what each test saw."""
    pytester.makeconftest(
        "from tests.runtime.conftest import _cudnn_sdp_guard, pytest_configure  # noqa: F401\n"
    )
    pytester.makepyfile(test_inner=INNER)
    log = pytester.path / "guard-log.json"
    monkeypatch.setenv("GUARD_LOG", str(log))
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # hypothesis, anyio...: seconds
    if calls is not None:
        real = guard.apply_attention_backend

        def spy(setting, device):
            calls.append((setting, str(torch.device(device))))
            return real(setting, device)

        monkeypatch.setattr(guard, "apply_attention_backend", spy)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-W", "error")
    result.assert_outcomes(passed=4)
    return {row["test"]: (row["enabled"], row["setting"]) for row in json.loads(log.read_text())}


def test_on_hopper_gpu_tests_run_with_cudnn_sdp_off_and_the_opt_out_keeps_it_on(
    pytester, monkeypatch, cudnn_sdp_flag, hopper
):
    """torch 2.13 on sm90: the preset's default (``auto``) turns cuDNN SDPA off for a gpu test,
    as the trainer does on an H200; the flag is back on after it; a gpu test marked
    ``cudnn_sdp("on")`` runs with it on; a test not marked gpu is left alone."""
    assert guard.apply_attention_backend.__module__ == "stagehand.common.attention"
    torch.backends.cuda.enable_cudnn_sdp(True)  # PyTorch's own default
    calls: list[tuple[str, str]] = []
    seen = run_inner(pytester, monkeypatch, calls)
    assert seen == {
        "plain": (True, None),
        "guarded": (False, "auto"),
        "between": (True, None),  # restored after the guarded test
        "kept_on": (True, "on"),
    }
    # The trainer's call: apply_attention_backend(preset.model.cudnn_sdp, device) on cuda.
    assert ModelSection(factory="flux").cudnn_sdp == "auto"
    assert calls == [("auto", "cuda"), ("on", "cuda")]
    assert torch.backends.cuda.cudnn_sdp_enabled() is True


def test_the_guard_restores_the_flag_it_found(pytester, monkeypatch, cudnn_sdp_flag):
    """Without a CUDA device ``auto`` leaves PyTorch's choice (cuDNN SDPA enabled): starting
    from off, the gpu tests see it on and every other test, before and after, sees it off."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    seen = run_inner(pytester, monkeypatch)
    assert seen == {
        "plain": (False, None),
        "guarded": (True, "auto"),
        "between": (False, None),
        "kept_on": (True, "on"),
    }
    assert torch.backends.cuda.cudnn_sdp_enabled() is False


def test_the_environment_chooses_the_setting_of_unmarked_gpu_tests(
    pytester, monkeypatch, cudnn_sdp_flag
):
    """``STAGEHAND_TEST_CUDNN_SDP=off`` (``./dev gpu-check diagnose`` part b) turns cuDNN SDPA
    off for every gpu test on any device; a ``cudnn_sdp`` marker still wins."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    monkeypatch.setenv(guard.CUDNN_SDP_ENV, "off")
    seen = run_inner(pytester, monkeypatch)
    assert seen["guarded"] == (False, "off")
    assert seen["kept_on"] == (True, "on")
    assert seen["between"] == (True, None)


def test_a_bad_setting_names_its_source(request, monkeypatch):
    request.node.add_marker(pytest.mark.gpu)
    assert guard.cudnn_sdp_setting(request.node) == "auto"
    monkeypatch.setenv(guard.CUDNN_SDP_ENV, "maybe")
    with pytest.raises(ValueError, match=r"\$STAGEHAND_TEST_CUDNN_SDP must be one of .*'maybe'"):
        guard.cudnn_sdp_setting(request.node)
    request.node.add_marker(pytest.mark.cudnn_sdp("always"))
    with pytest.raises(ValueError, match=r"test_a_bad_setting_names_its_source: cudnn_sdp marker"):
        guard.cudnn_sdp_setting(request.node)
