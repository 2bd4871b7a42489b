"""The attention backend guard: whether cuDNN's fused attention (an SDPA backend) may run.

# NOTE [ cuDNN SDPA guard ]
Evidence (measured): with torch 2.11+cu130 on an H100, the plain
all-resident LoRA step of a FLUX.1-dev-sized transformer at 1024 px (4096 image + 512 text
tokens, bf16) crashed in backward with "CUDA error: an illegal memory access" until
``torch.backends.cuda.enable_cudnn_sdp(False)``; with it off every configuration ran. Why 2.11:
PyTorch prefers the cuDNN backend on sm90/sm100 once the bundled cuDNN is newer than 9.15
(``check_prefer_cudnn_attention`` in ``sdp_utils.cpp``, present since 2.10); the cuDNN that
2.11 bundles crosses that line, so from 2.11 cuDNN is the *default* SDPA backend on Hopper and
Blackwell (huggingface/transformers#48163). Other cuDNN SDPA defects reported since then:
NaN ``grad_q`` in backward on H100/H200 with a mask (pytorch/pytorch#196678, "regression
since 2.11"), silently wrong results on B200 reproduced with 2.13.0+cu130
(pytorch/pytorch#193893). The pinned torch (2.13) bundles a cuDNN past the threshold too: it
has the same default, and whether it still crashes at this size is **unverified** (no GPU ran
it here). So ``auto`` turns cuDNN SDPA off on a CUDA device of compute capability 9.x or 10.x
with torch >= 2.11 (``CUDNN_DEFAULT_SINCE``); SDPA then picks flash or memory-efficient
attention, as on torch <= 2.10. ``on`` leaves PyTorch's choice, ``off`` turns it off on any CUDA
device. The setting is ``model.cudnn_sdp`` of the preset; the trainer applies it once at start
and records the choice in ``trainer/run_started`` (``attention``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch

CudnnSdp = Literal["auto", "on", "off"]
SETTINGS: tuple[str, ...] = ("auto", "on", "off")

CUDNN_DEFAULT_SINCE = (2, 11)
"""First torch release whose bundled cuDNN makes cuDNN the default SDPA backend on sm90/sm100."""
CUDNN_DEFAULT_MAJORS = (9, 10)
"""Compute capability majors where PyTorch prefers cuDNN attention (Hopper, Blackwell)."""


@dataclass(frozen=True)
class AttentionChoice:
    """What the guard decided: the setting, whether cuDNN SDPA is enabled after it, and why."""

    cudnn_sdp: str
    """The setting (``auto``, ``on``, ``off``)."""
    cudnn_sdp_enabled: bool
    """``torch.backends.cuda.cudnn_sdp_enabled()`` once the choice is applied."""
    reason: str
    torch: str
    device: str

    def as_record(self) -> dict[str, object]:
        return asdict(self)


def torch_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.13.0+cu130"`` -> ``(2, 13)``).

    Raises:
        ValueError: the string does not start with ``MAJOR.MINOR``.
    """
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"torch version must start with MAJOR.MINOR, got {version!r}") from None


def choose_cudnn_sdp(
    setting: str, *, torch_version: str, device_type: str, capability: tuple[int, int] | None
) -> tuple[bool | None, str]:
    """The decision for ``setting`` (NOTE [ cuDNN SDPA guard ]): ``(enable, reason)`` where
    ``enable`` is False to turn cuDNN SDPA off, True to leave PyTorch's choice in force, and
    None when it does not apply (no CUDA device: SDPA never runs cuDNN there).

    Raises:
        ValueError: ``setting`` is not ``auto``, ``on`` or ``off`` (names ``model.cudnn_sdp``).
    """
    if setting not in SETTINGS:
        raise ValueError(f"model.cudnn_sdp must be one of {list(SETTINGS)}, got {setting!r}")
    if device_type != "cuda":
        return None, f"{device_type} device: cuDNN attention does not run there"
    if setting == "off":
        return False, "model.cudnn_sdp is off"
    if setting == "on":
        return True, "model.cudnn_sdp is on: PyTorch's backend choice"
    release = torch_release(torch_version)
    major = capability[0] if capability is not None else None
    if release >= CUDNN_DEFAULT_SINCE and major in CUDNN_DEFAULT_MAJORS:
        return False, (
            f"auto: torch {torch_version} makes cuDNN the default SDPA backend on sm{major}x; "
            "torch 2.11+cu130 crashed in its backward at FLUX.1-dev size on an H100 "
            "(illegal memory access), the pinned 2.13 is unverified"
        )
    return True, f"auto: torch {torch_version} on sm{major}x does not default to cuDNN attention"


def apply_attention_backend(setting: str, device: torch.device | str) -> AttentionChoice:
    """Apply ``setting`` for a run on ``device`` (process-wide: call once, at start) and return
    the choice for the run's record.

    Raises:
        ValueError: ``setting`` is not ``auto``, ``on`` or ``off``.
    """
    device = torch.device(device)
    capability = None
    if device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
    enable, reason = choose_cudnn_sdp(
        setting, torch_version=torch.__version__, device_type=device.type, capability=capability
    )
    if enable is not None:
        torch.backends.cuda.enable_cudnn_sdp(enable)
    return AttentionChoice(
        cudnn_sdp=setting,
        cudnn_sdp_enabled=bool(torch.backends.cuda.cudnn_sdp_enabled()) and enable is not None,
        reason=reason,
        torch=torch.__version__,
        device=str(device),
    )
