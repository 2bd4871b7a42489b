"""Who gives way when the step needs more VRAM than planned: resident weights or activations.

# NOTE [ Who gives way ]
Both runtimes compare the same device figure (``DeviceMemory.usage_bytes``) with their own
watermarks: the weight runtime keeps blocks resident while usage is under its low watermark
(NOTE [ Eviction policy ] in ``runtime/stagehand/weights/policy.py``), the activation runtime spills saved
tensors above its high one. With ``"auto"`` the two are set together (``auto_limits``) so they
never chase the same bytes: when the measured activation peak outgrows the plan, the runtime
whose giving way moves fewer bytes gives way first.

- Evicting a resident frozen block frees its bytes for one H2D: its reload, the next time the
  trace needs it (prefetched, overlapped with compute). 1 byte moved per byte freed.
- Spilling a saved tensor frees its bytes for a D2H now and an H2D when backward restores it.
  2 bytes moved per byte freed. (A trainable block, streamed in a full fine-tune, also costs
  2: its gradient copy back and its reload; equal cost, the weights still go first, since
  their reload is prefetched along the trace while a restore waits on backward.)

So the weight band sits below the activation watermarks: the activation runtime's high
watermark is the Conductor's soft cap, the card less the margin, which usage reaches only when
the weight runtime has evicted every block it may (its low watermark is far below); its low one
is a prefetch window below. Rule 1 (backward pressure) measures against the same soft cap: with
``"auto"`` its threshold is 1.0, since usage near the soft cap is the plan working (blocks kept
resident), not pressure; past the soft cap speculation stops, which is the weights giving way
again (no prefetch beyond the block in use). The hard cap is the card.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO_PRESSURE_THRESHOLD = 1.0
"""Rule 1's threshold with ``"auto"`` caps: usage past the soft cap (NOTE above)."""


@dataclass(frozen=True)
class AutoLimits:
    """The activation runtime's watermarks and the Conductor's caps, in bytes."""

    activation_high_bytes: int
    activation_low_bytes: int
    soft_cap_bytes: int
    hard_cap_bytes: int


def auto_limits(device_bytes: int, window_bytes: int, margin_bytes: int) -> AutoLimits:
    """The limits set beside ``"auto"`` weight watermarks (NOTE [ Who gives way ]).

    Args:
        device_bytes: the budget the weights are fitted into (the card, or the Conductor's numeric
            soft cap when lower; bytes).
        window_bytes: the prefetch window's blocks (bytes).
        margin_bytes: the allocator and workspace margin (``stagehand.weights.auto.margin_bytes``).

    Returns:
        soft cap = activation high = ``device - margin``; activation low = soft cap less the
        window (0 at least); hard cap = ``device``.

    Raises:
        ValueError: the margin is not below the device's memory (names both, in MB).
    """
    soft = device_bytes - margin_bytes
    if soft <= 0:
        raise ValueError(
            f"auto caps: the margin ({margin_bytes / 2**20:.0f} MB) leaves nothing of the "
            f"device's {device_bytes / 2**20:.0f} MB"
        )
    return AutoLimits(soft, max(0, soft - window_bytes), soft, device_bytes)
