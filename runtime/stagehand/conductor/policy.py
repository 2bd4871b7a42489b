"""HeuristicPolicyBridge: the three v0 rules turning pressure into ``RuntimeLimitHints``.

Source: "Conductor: Resource Arbitration Across Memory Runtimes" ("Policy Rules (v0)"). Hints are computed at every phase
boundary (and after each full slot check, for Rule 3) and pushed to the adapters.

- Rule 1, backward pressure: in BACKWARD, when VRAM usage / ``vram_soft_cap_mb`` exceeds
  ``backward_pressure_threshold`` (0.8): suppress speculation, prefetch window cap 1.
- Rule 2, optimizer protection: in OPTIMIZER: suppress speculation, ``max_inflight_h2d`` 1,
  ``max_inflight_d2h`` 0 (no activation spill while the optimizer needs headroom), prefetch
  window cap 1 (the weight adapter sets the window to 1 on suppression anyway; keeping the cap
  equal makes "suppressed implies window <= 1" an invariant of the hints).
- Rule 3, contention: after more than ``contention_checks`` (3) consecutive checks that found
  every slot held, the prefetch window cap drops by one (not below 1) and the run of checks
  starts again, so continued contention keeps backing off.

Monotonicity (the seed's guarantee): within a step every hint only tightens: caps are
non-increasing and ``suppress_speculative`` never goes from True back to False. ``reset`` at
STEP_BEGIN is the only way back to the base values.
"""

from __future__ import annotations

import dataclasses

from stagehand.common.phases import Phase
from stagehand.config.memory import ConductorConfig

DEFAULT_PREFETCH_WINDOW = 2
"""Base window when no weight runtime reports one (``StagehandConfig.prefetch_window_blocks``)."""


@dataclasses.dataclass(frozen=True)
class RuntimeLimitHints:
    """Caps the adapters translate into runtime knobs (seed table "What Gets Tuned").

    ``max_inflight_h2d``/``max_inflight_d2h``: copies in flight per direction;
    ``prefetch_window_cap``: blocks the weight runtime may load ahead;
    ``suppress_speculative``: no speculative work (weight window 1; no D2H in OPTIMIZER).
    """

    max_inflight_h2d: int
    max_inflight_d2h: int
    prefetch_window_cap: int
    suppress_speculative: bool = False

    def tighten(self, other: RuntimeLimitHints) -> RuntimeLimitHints:
        """The tighter of ``self`` and ``other`` field by field (the monotone combination)."""
        return RuntimeLimitHints(
            max_inflight_h2d=min(self.max_inflight_h2d, other.max_inflight_h2d),
            max_inflight_d2h=min(self.max_inflight_d2h, other.max_inflight_d2h),
            prefetch_window_cap=min(self.prefetch_window_cap, other.prefetch_window_cap),
            suppress_speculative=self.suppress_speculative or other.suppress_speculative,
        )

    def at_most(self, other: RuntimeLimitHints) -> bool:
        """True when ``self`` is as tight as ``other`` or tighter in every field."""
        return (
            self.max_inflight_h2d <= other.max_inflight_h2d
            and self.max_inflight_d2h <= other.max_inflight_d2h
            and self.prefetch_window_cap <= other.prefetch_window_cap
            and self.suppress_speculative >= other.suppress_speculative
        )

    def as_dict(self) -> dict[str, int | bool]:
        return dataclasses.asdict(self)


class HeuristicPolicyBridge:
    """Computes ``RuntimeLimitHints`` from the phase, VRAM usage (MB) and slot contention.

    ``fired`` lists the rules that tightened the hints in the current step
    (``"backward_pressure"``, ``"optimizer_protection"``, ``"contention"``).
    """

    def __init__(self, config: ConductorConfig) -> None:
        self.config = config
        self.base = RuntimeLimitHints(
            config.h2d_slots, config.d2h_slots, DEFAULT_PREFETCH_WINDOW, False
        )
        self.hints = self.base
        self.fired: list[str] = []

    def reset(self, base_prefetch_window: int | None = None) -> RuntimeLimitHints:
        """STEP_BEGIN: back to the base hints (window: the weight runtime's own setting)."""
        window = DEFAULT_PREFETCH_WINDOW if base_prefetch_window is None else base_prefetch_window
        if window < 0:
            raise ValueError(f"base_prefetch_window must be >= 0, got {window}")
        self.base = dataclasses.replace(self.base, prefetch_window_cap=window)
        self.hints = self.base
        self.fired = []
        return self.hints

    def pressure(self, vram_usage_mb: float) -> float:
        """VRAM usage as a fraction of the soft cap (inf when the soft cap is 0)."""
        soft = self.config.vram_soft_cap_mb
        return vram_usage_mb / soft if soft > 0 else float("inf")

    def on_phase(
        self, phase: Phase, vram_usage_mb: float, consecutive_full: int = 0
    ) -> RuntimeLimitHints:
        """Hints for the phase now starting (STEP_BEGIN resets; call ``reset`` for the window)."""
        if phase is Phase.STEP_BEGIN:
            return self.reset(self.base.prefetch_window_cap)
        h = self.hints
        if phase is Phase.BACKWARD and (
            self.pressure(vram_usage_mb) > self.config.backward_pressure_threshold
        ):
            h = self._fire(h, "backward_pressure", suppress_speculative=True, prefetch_window_cap=1)
        if phase is Phase.OPTIMIZER:
            h = self._fire(
                h,
                "optimizer_protection",
                suppress_speculative=True,
                max_inflight_h2d=1,
                max_inflight_d2h=0,
                prefetch_window_cap=1,
            )
        self.hints = self._contention(h, consecutive_full)
        return self.hints

    def on_contention(self, consecutive_full: int) -> bool:
        """Rule 3 between phase boundaries; True when the hints tightened."""
        before = self.hints
        self.hints = self._contention(before, consecutive_full)
        return self.hints != before

    def contended(self, consecutive_full: int) -> bool:
        """Whether ``consecutive_full`` checks trigger Rule 3 (more than ``contention_checks``)."""
        return consecutive_full > self.config.contention_checks

    def _contention(self, h: RuntimeLimitHints, consecutive_full: int) -> RuntimeLimitHints:
        if not self.contended(consecutive_full) or h.prefetch_window_cap <= 1:
            return h
        return self._fire(h, "contention", prefetch_window_cap=h.prefetch_window_cap - 1)

    def _fire(self, h: RuntimeLimitHints, rule: str, **tighter: int | bool) -> RuntimeLimitHints:
        new = h.tighten(dataclasses.replace(h, **tighter))
        if new != h and rule not in self.fired:
            self.fired.append(rule)
        return new
