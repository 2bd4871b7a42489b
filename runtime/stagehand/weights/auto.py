"""``"auto"`` weight watermarks: the weight runtime's budget from the card and the step's needs.

# NOTE [ Auto watermarks ]
A preset may give ``"auto"`` for ``vram_high_watermark_mb`` and ``vram_low_watermark_mb`` (the
24 GB family presets do). The weight runtime keeps a block on the device after its use while
usage is under the low watermark and loads ahead only under the high one (NOTE [ Eviction
policy ] in ``policy.py``), so the low watermark is what decides how many blocks stay resident
and the band between the two is the prefetch window's room. The rule (``auto_watermarks``):

    high = device - activation peak - trainable bytes - prefetch window - margin
    low  = high - prefetch window

- ``device``: the card's memory, or the Conductor's soft cap when one is enabled and lower
  (the runtimes must stay under it); on a CPU device the tracked budget the run was given;
- activation peak: the planner's estimate at build, the trace step's measured peak after it
  (the live-limits path carries the new figures to the runtime);
- trainable bytes: LoRA weights, their gradients and the optimizer's state (AdamW: two moments);
- prefetch window: the bytes of the largest ``prefetch_window_blocks`` blocks, loaded ahead of
  use while one computes;
- margin (``margin_bytes``): what neither runtime counts, the CUDA caching allocator's
  fragmentation and the cuBLAS / cuDNN workspaces: 1 GiB plus 5% of the card on CUDA, 0 on a
  CPU device whose figures are the runtimes' own tracked bytes.

On CUDA the runtimes compare the allocator's whole figure (activations and trainable bytes
included) with the watermarks, so the activation and trainable terms are counted on both sides:
the rule errs on the side of fewer resident blocks, never of an out-of-memory error.
"""

from __future__ import annotations

from stagehand.config.memory import MB

AUTO = "auto"
"""The value of a watermark field that asks for this rule."""

MARGIN_FIXED_BYTES = 2**30
"""The fixed part of the CUDA margin (1 GiB): cuBLAS / cuBLASLt and cuDNN workspaces and the
CUDA context's own allocations the allocator does not see."""
MARGIN_FRACTION = 0.05
"""The part of the CUDA margin that grows with the card: the caching allocator's fragmentation
(reserved but not allocated), which grows with what is allocated."""


def margin_bytes(device_bytes: int, cuda: bool) -> int:
    """The margin ``auto_watermarks`` leaves for what no runtime counts, in bytes:
    ``MARGIN_FIXED_BYTES + MARGIN_FRACTION x device_bytes`` on CUDA (2.2 GiB on a 24 GiB card),
    0 on a CPU device (tracked bytes: nothing uncounted)."""
    if not cuda:
        return 0
    return MARGIN_FIXED_BYTES + int(MARGIN_FRACTION * device_bytes)


def auto_watermarks(
    device_bytes: int,
    activation_peak_bytes: int,
    trainable_bytes: int,
    window_bytes: int,
    margin_bytes: int,
) -> tuple[int, int]:
    """The weight runtime's ``(high_bytes, low_bytes)`` watermarks (NOTE [ Auto watermarks ]).

    Args:
        device_bytes: the device's memory the runtimes may use (the card, or the Conductor's
            soft cap when lower; a CPU device's tracked budget), bytes.
        activation_peak_bytes: the step's activation peak (planned, then measured), bytes.
        trainable_bytes: trainable weights, their gradients and the optimizer state, bytes.
        window_bytes: the prefetch window's blocks, bytes.
        margin_bytes: allocator and workspace margin (``margin_bytes()``), bytes.

    Returns:
        ``(high, low)`` in bytes, ``low = high - window_bytes``, both >= 0.

    Raises:
        ValueError: a figure that is not an integer >= 0 (names it), or a budget too small for
            the window (names every figure, in MB).
    """
    figures = {
        "device_bytes": device_bytes,
        "activation_peak_bytes": activation_peak_bytes,
        "trainable_bytes": trainable_bytes,
        "window_bytes": window_bytes,
        "margin_bytes": margin_bytes,
    }
    for name, value in figures.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"auto watermarks: {name} must be an integer >= 0, got {value!r}")
    high = device_bytes - activation_peak_bytes - trainable_bytes - window_bytes - margin_bytes
    low = high - window_bytes
    if low < 0:
        raise ValueError(
            f"auto watermarks: the device's {device_bytes / MB:.0f} MB minus the activation peak "
            f"({activation_peak_bytes / MB:.0f} MB), trainable weights and optimizer state "
            f"({trainable_bytes / MB:.0f} MB), the prefetch window ({window_bytes / MB:.0f} MB) "
            f"and the margin ({margin_bytes / MB:.0f} MB) leave {high / MB:.0f} MB, less than "
            f"the window's {window_bytes / MB:.0f} MB: give vram_high_watermark_mb and "
            f"vram_low_watermark_mb in MB, a smaller prefetch_window_blocks, or lower the "
            f"activation peak (gradient checkpointing, activation spill, a smaller batch)"
        )
    return high, low
