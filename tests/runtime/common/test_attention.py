"""The cuDNN SDPA guard: the choice per torch version, device and setting, and its
application (process-wide: each test restores the flag)."""

import pytest
import torch

from stagehand.common.attention import apply_attention_backend, choose_cudnn_sdp, torch_release


@pytest.fixture(autouse=True)
def _restore_flag():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def choose(setting, version, device="cuda", capability=(9, 0)):
    return choose_cudnn_sdp(
        setting, torch_version=version, device_type=device, capability=capability
    )[0]


def test_auto_turns_cudnn_off_where_torch_makes_it_the_default():
    # torch 2.11+cu130 on an H100 (sm90) crashed; the pinned 2.13 has the same default.
    assert choose("auto", "2.11.0+cu130") is False
    assert choose("auto", "2.13.0+cu130") is False
    assert choose("auto", "2.13.0", capability=(10, 0)) is False  # Blackwell prefers cuDNN too
    assert choose("auto", "2.10.1+cu128") is True  # bundled cuDNN below the threshold
    assert choose("auto", "2.13.0+cu130", capability=(8, 0)) is True  # A100: not the default


def test_on_and_off_are_the_users_and_cpu_is_not_applicable():
    assert choose("off", "2.10.0", capability=(8, 6)) is False
    assert choose("on", "2.13.0+cu130") is True
    assert choose("auto", "2.13.0", device="cpu", capability=None) is None


def test_bad_setting_and_version_name_the_field():
    with pytest.raises(ValueError, match="model.cudnn_sdp must be one of"):
        choose("maybe", "2.13.0")
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        torch_release("nightly")
    assert torch_release("2.13.0+cu130") == (2, 13)


def test_apply_on_cpu_records_the_choice_and_leaves_the_flag():
    torch.backends.cuda.enable_cudnn_sdp(True)
    choice = apply_attention_backend("off", "cpu")
    assert torch.backends.cuda.cudnn_sdp_enabled()  # nothing to do on a CPU device
    record = choice.as_record()
    assert record["cudnn_sdp"] == "off" and record["cudnn_sdp_enabled"] is False
    assert record["device"] == "cpu" and record["torch"] == torch.__version__
    assert "does not run there" in record["reason"]
