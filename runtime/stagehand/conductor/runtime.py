"""ConductorRuntime: phases, budget, transfer slots, policy and adapters behind one object.

Source: "Conductor: Resource Arbitration Across Memory Runtimes". Lifecycle, driven by the composed strategy::

    conductor.begin_step(step)      # STEP_BEGIN: hints reset, limits re-applied
    conductor.enter_forward()
    conductor.enter_backward()      # Rule 1 looks at VRAM pressure here
    conductor.enter_optimizer()     # Rule 2
    conductor.end_step()            # STEP_END: conductor/step record when due

Runtimes ask for PCIe slots duck-typed: ``conductor.request_transfer("h2d", "speculative")``.

Zero-cost disable: ``ConductorRuntime(ConductorConfig(enabled=False))`` stores ``_enabled`` and
returns; no budget, transfer manager, policy, coordinator or telemetry hub exists, and every
method returns at once (``request_transfer`` an always-granted token that holds nothing).
"""

from __future__ import annotations

from typing import Any

from stagehand.common.memory import DeviceMemory
from stagehand.common.phases import Phase
from stagehand.common.telemetry import Telemetry
from stagehand.conductor.adapter import ConductorAdapter
from stagehand.conductor.budget import BudgetManager, Reservation
from stagehand.conductor.coordinator import PhaseCoordinator
from stagehand.conductor.policy import HeuristicPolicyBridge, RuntimeLimitHints
from stagehand.conductor.telemetry import ConductorTelemetry
from stagehand.conductor.transfer import TransferGrant, TransferManager, parse_direction
from stagehand.conductor.types import BudgetMode, GrantOutcome, Priority
from stagehand.config.memory import MB, ConductorConfig

# Shared answers of a disabled Conductor: allocated once at import, never per call.
_OPEN = {d: TransferGrant(None, -1, d, Priority.CRITICAL, None) for d in ("h2d", "d2h")}


class ConductorRuntime:
    """Arbitrates VRAM headroom, pinned host memory and PCIe slots between the runtimes.

    Args:
        config: ``ConductorConfig``; None means the defaults (disabled).
        memory: the strategy's shared ``DeviceMemory`` (VRAM figure for the budget and Rule 1).
        telemetry: the run's one stream; None writes ``config.telemetry_file`` (JSONL), closed by
            ``shutdown``. A disabled Conductor writes nothing.
    """

    def __init__(
        self,
        config: ConductorConfig | None = None,
        *,
        memory: DeviceMemory | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        config = config if config is not None else ConductorConfig()
        self._enabled = config.enabled
        if not self._enabled:
            return
        self.config = config
        self.memory = memory
        self.hub = ConductorTelemetry(config, telemetry)
        usage = memory.usage_bytes if memory is not None else None
        self.budget = BudgetManager(config, usage, on_event=self.hub.event)
        self.transfer = TransferManager(config.h2d_slots, config.d2h_slots, on_event=self.hub.event)
        self.policy = HeuristicPolicyBridge(config)
        self.coordinator = PhaseCoordinator()
        self.adapters: list[ConductorAdapter] = []
        self.step_id: int | None = None
        self._shut = False

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def phase(self) -> Phase | None:
        return self.coordinator.phase if self._enabled else None

    @property
    def hints(self) -> RuntimeLimitHints | None:
        """The hints in force (None when disabled)."""
        return self.policy.hints if self._enabled else None

    # -- adapters -------------------------------------------------------------------------------
    def register_adapter(self, adapter: ConductorAdapter) -> None:
        """Attach ``adapter`` (saves its runtime's knobs) and broadcast phases to it."""
        if not self._enabled:
            return
        adapter.attach(self)
        self.adapters.append(adapter)
        self.coordinator.register(adapter)
        if self.coordinator.phase is not None:
            adapter.on_phase(self.coordinator.phase, self.policy.hints)

    def unregister_adapter(self, adapter: ConductorAdapter) -> None:
        """Detach ``adapter``: its runtime's knobs get their originals back."""
        if not self._enabled or adapter not in self.adapters:
            return
        self.coordinator.unregister(adapter)
        self.adapters.remove(adapter)
        adapter.detach()

    # -- phases ---------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        if not self._enabled:
            return
        self._enter(Phase.STEP_BEGIN)
        self.step_id = step

    def enter_forward(self) -> None:
        if self._enabled:
            self._enter(Phase.FORWARD)

    def enter_backward(self) -> None:
        if self._enabled:
            self._enter(Phase.BACKWARD)

    def enter_optimizer(self) -> None:
        if self._enabled:
            self._enter(Phase.OPTIMIZER)

    def end_step(self) -> dict[str, Any] | None:
        """STEP_END; returns the ``conductor/step`` record when one was due."""
        if not self._enabled:
            return None
        self._enter(Phase.STEP_END)
        if self.step_id is not None and self.hub.due(self.step_id):
            return self.hub.step(self.step_record())
        return None

    def abort_step(self) -> int:
        """After a step left by an error, once the runtimes drained their copies (NOTE
        [ Aborted step ] in ``runtime/stagehand/weights/abort.py``): every transfer slot still held is
        released; returns how many were (0 when the copies handed theirs back)."""
        if not self._enabled:
            return 0
        return self.transfer.release_held()

    def _enter(self, phase: Phase) -> None:
        if self._shut:
            raise RuntimeError("the Conductor is shut down")
        old = self.coordinator.advance(phase)  # raises PhaseError before anything changes
        if old is not None:
            self.budget.end_phase(old)
        self.budget.begin_phase(phase)
        if phase is Phase.STEP_BEGIN:
            self.budget.reset_counts()
            self.transfer.reset_counts()
            self.transfer.consecutive_full = 0
            windows = [w for a in self.adapters if (w := a.base_prefetch_window()) is not None]
            self.policy.reset(max(windows) if windows else None)
            hints = self.policy.hints
        else:
            hints = self.policy.on_phase(
                phase, self.budget.vram_usage_mb(), self.transfer.consecutive_full
            )
            self._rearm_contention()
        self._push(hints)
        self.hub.event("phase", {"phase": phase.value, "from": old.value if old else None})

    def _push(self, hints: RuntimeLimitHints) -> None:
        self.transfer.set_limits(
            hints.max_inflight_h2d, hints.max_inflight_d2h, hints.suppress_speculative
        )
        self.budget.suppress_speculative = hints.suppress_speculative
        self.coordinator.broadcast(hints)
        self.hub.event("hints", {**hints.as_dict(), "rules": list(self.policy.fired)})

    def _rearm_contention(self) -> None:
        # Rule 3 is progressive: once a run of full checks has been acted on, a new run must
        # build up before the window shrinks again.
        if self.policy.contended(self.transfer.consecutive_full):
            self.transfer.consecutive_full = 0

    # -- requests -------------------------------------------------------------------------------
    def request_transfer(self, direction: str, priority: Priority | str) -> TransferGrant:
        """A PCIe slot for one copy, or a typed denial (see ``stagehand.conductor.transfer``).
        When the pool looks full, the adapters first hand back the slots of copies that
        already finished (NOTE [ Reclaiming finished copies ] in ``stagehand.strategy.adapters``).

        Raises:
            ValueError: bad ``direction`` or ``priority`` (enabled Conductor only).
        """
        if not self._enabled:
            return _OPEN.get(direction) or _OPEN["h2d"]
        direction = parse_direction(direction)
        if self.transfer.looks_full(direction):
            for adapter in self.adapters:
                adapter.reclaim(direction)
        grant = self.transfer.request_transfer(direction, priority)
        if self.policy.contended(self.transfer.consecutive_full):
            tightened = self.policy.on_contention(self.transfer.consecutive_full)
            self._rearm_contention()
            if tightened:
                self._push(self.policy.hints)
        return grant

    def reserve(
        self,
        resource: str,
        mb: float,
        *,
        mode: BudgetMode | str = BudgetMode.SOFT,
        priority: Priority | str = Priority.REQUIRED,
        owner: str = "",
        phase_scoped: bool = False,
        min_mb: float = 0.0,
    ) -> Reservation:
        """``BudgetManager.reserve``; a disabled Conductor grants everything in full."""
        if not self._enabled:
            return Reservation(
                None,
                id=-1,
                resource=resource,
                owner=owner,
                mode=BudgetMode.parse(mode),
                priority=Priority.parse(priority),
                requested_mb=mb,
                granted_mb=mb,
                outcome=GrantOutcome.FULL,
                reason=None,
                scope=None,
            )
        return self.budget.reserve(
            resource,
            mb,
            mode=mode,
            priority=priority,
            owner=owner,
            phase_scoped=phase_scoped,
            min_mb=min_mb,
        )

    # -- figures --------------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """This step's answers: ``grants`` and ``denials`` of budget reservations and transfer
        slots together (a partial reservation counts in neither)."""
        b, t = self.budget.counts, self.transfer.counts
        return {"grants": b["grant"] + t["grant"], "denials": b["deny"] + t["deny"]}

    def step_record(self) -> dict[str, Any]:
        """The seed's per-step record (MB, seconds in ``phase_durations``), plus ``hints`` and
        ``rules_fired``. Counts are this step's budget and transfer answers together."""
        counters = self.counters()
        allocated = (
            self.memory.allocated_bytes() / MB
            if self.memory is not None
            else self.budget.vram_usage_mb()
        )
        return {
            "step_id": self.step_id,
            "vram_allocated_mb": allocated,
            "vram_headroom_mb": self.budget.vram_headroom_mb(),
            "pinned_granted_mb": self.budget.held_mb("pinned"),
            "h2d_inflight": self.transfer.inflight("h2d"),
            "d2h_inflight": self.transfer.inflight("d2h"),
            "grant_count": counters["grants"],
            "deny_count": counters["denials"],
            "partial_count": self.budget.counts["partial"],
            "phase_durations": {  # seconds, as the seed's record has them
                k: ms / 1e3
                for k, ms in self.coordinator.durations_ms.items()
                if k in ("forward", "backward", "optimizer")
            },
            "runtime_snapshots": {a.name: a.snapshot() for a in self.adapters},
            "hints": self.policy.hints.as_dict(),
            "rules_fired": list(self.policy.fired),
        }

    def shutdown(self) -> None:
        """Detach every adapter (originals restored) and release every reservation."""
        if not self._enabled or self._shut:
            return
        for adapter in list(self.adapters):
            self.unregister_adapter(adapter)
        self.budget.release_all()
        self.hub.close()
        self._shut = True
