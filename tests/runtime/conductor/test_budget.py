"""BudgetManager: the mode x priority table of runtime/stagehand/conductor/budget.py, case by case."""

import pytest

from stagehand.common.memory import DeviceMemory
from stagehand.common.phases import Phase
from stagehand.conductor.budget import BudgetManager
from stagehand.conductor.types import BudgetMode, DenialReason, GrantOutcome, Priority
from stagehand.config.memory import MB, ConductorConfig

# soft 1000 / hard 1200 MB, background limit 0.8 x 1000 = 800 MB; pinned budget 500 MB.
CONFIG = ConductorConfig(
    enabled=True, vram_soft_cap_mb=1000, vram_hard_cap_mb=1200, pinned_budget_mb=500
)
USED_MB = 900  # soft room 100 MB, hard room 300 MB, background room -100 MB

F, P, D = GrantOutcome.FULL, GrantOutcome.PARTIAL, GrantOutcome.DENIED
VRAM, PINNED = DenialReason.VRAM_BUDGET_EXHAUSTED, DenialReason.PINNED_BUDGET_EXHAUSTED

VRAM_TABLE = [
    # mode, priority, requested MB -> outcome, granted MB, reason
    ("hard", "critical", 250, F, 250, None),
    ("hard", "critical", 350, D, 0, VRAM),
    ("hard", "required", 50, F, 50, None),
    ("hard", "required", 150, D, 0, VRAM),
    ("hard", "speculative", 150, D, 0, VRAM),
    ("hard", "background", 10, D, 0, VRAM),
    ("soft", "critical", 350, P, 300, VRAM),
    ("soft", "required", 80, F, 80, None),
    ("soft", "required", 150, P, 100, VRAM),
    ("soft", "speculative", 150, P, 100, VRAM),
    ("soft", "background", 10, D, 0, VRAM),
    ("burst", "critical", 350, P, 300, VRAM),
    ("burst", "required", 250, F, 250, None),
    ("burst", "required", 350, P, 300, VRAM),
    ("burst", "speculative", 250, P, 100, VRAM),
    ("burst", "background", 10, D, 0, VRAM),
    ("floor", "critical", 300, F, 300, None),
    ("floor", "required", 250, F, 250, None),
    ("floor", "required", 350, D, 0, VRAM),
    ("floor", "speculative", 150, D, 0, VRAM),
    ("floor", "background", 10, D, 0, VRAM),
    ("ceiling", "required", 5000, F, 0, None),
    ("ceiling", "background", 5000, F, 0, None),
]


def _budget() -> tuple[BudgetManager, DeviceMemory]:
    memory = DeviceMemory("cpu")
    memory.track(USED_MB * MB)
    return BudgetManager(CONFIG, memory.usage_bytes), memory


@pytest.mark.parametrize(("mode", "priority", "mb", "outcome", "granted", "reason"), VRAM_TABLE)
def test_vram_table(mode, priority, mb, outcome, granted, reason):
    budget, _ = _budget()
    res = budget.reserve("vram", mb, mode=mode, priority=priority)
    assert (res.outcome, res.granted_mb, res.reason) == (outcome, granted, reason)
    # Only real grants hold MB; CEILING reserves nothing.
    assert budget.held_mb("vram") == granted


PINNED_TABLE = [
    ("hard", "required", 500, F, 500, None),
    ("hard", "required", 600, D, 0, PINNED),
    ("soft", "required", 600, P, 500, PINNED),
    ("soft", "background", 600, P, 400, PINNED),
    ("burst", "required", 600, P, 500, PINNED),  # pinned soft cap == hard cap
    ("floor", "critical", 600, D, 0, PINNED),
]


@pytest.mark.parametrize(("mode", "priority", "mb", "outcome", "granted", "reason"), PINNED_TABLE)
def test_pinned_table(mode, priority, mb, outcome, granted, reason):
    budget, _ = _budget()
    res = budget.reserve("pinned", mb, mode=mode, priority=priority)
    assert (res.outcome, res.granted_mb, res.reason) == (outcome, granted, reason)
    assert budget.held_mb("pinned") == granted


def test_held_reservations_count_against_later_ones_and_release_is_idempotent():
    budget, memory = _budget()
    first = budget.reserve("vram", 60, mode="hard")
    second = budget.reserve("vram", 60, mode="hard")
    assert first.granted and not second.granted and second.reason is VRAM
    assert budget.vram_headroom_mb() == pytest.approx(1000 - 900 - 60)
    first.release()
    first.release()
    assert budget.held_mb("vram") == 0
    assert budget.reserve("vram", 60, mode="hard").granted
    # device usage moves the room too
    memory.untrack(500 * MB)
    assert budget.reserve("vram", 300, mode="hard").outcome is F
    assert budget.counts == {"grant": 3, "partial": 0, "deny": 1}


def test_min_mb_turns_a_small_partial_into_a_denial():
    budget, _ = _budget()
    assert budget.reserve("vram", 150, mode="soft", min_mb=120).outcome is D
    assert budget.reserve("vram", 150, mode="soft", min_mb=100).granted_mb == 100


def test_ceiling_clips_the_owner_only_and_goes_with_release():
    budget, _ = _budget()
    ceiling = budget.reserve("pinned", 120, mode="ceiling", owner="act")
    assert budget.reserve("pinned", 100, mode="hard", owner="act").outcome is F
    over = budget.reserve("pinned", 50, mode="hard", owner="act")
    assert (over.outcome, over.reason) == (D, DenialReason.CEILING_EXCEEDED)
    clipped = budget.reserve("pinned", 50, mode="soft", owner="act")
    assert (clipped.outcome, clipped.granted_mb, clipped.reason) == (
        P,
        20,
        DenialReason.CEILING_EXCEEDED,
    )
    assert budget.reserve("pinned", 200, mode="hard", owner="weights").outcome is F
    ceiling.release()
    assert budget.reserve("pinned", 50, mode="hard", owner="act").outcome is F


def test_suppression_denies_speculative_and_background_only():
    budget, _ = _budget()
    budget.suppress_speculative = True
    for priority in ("speculative", "background"):
        res = budget.reserve("vram", 1, mode="soft", priority=priority)
        assert res.reason is DenialReason.PHASE_RULE_SUPPRESSED_SPECULATIVE
    assert budget.reserve("vram", 1, mode="soft", priority="required").outcome is F


def test_phase_scoped_reservations_end_with_their_phase():
    budget, _ = _budget()
    budget.begin_phase(Phase.FORWARD)
    scoped = budget.reserve("vram", 40, mode="hard", phase_scoped=True)
    kept = budget.reserve("vram", 30, mode="hard")
    budget.begin_phase(Phase.BACKWARD)
    later = budget.reserve("vram", 20, mode="hard", phase_scoped=True)
    assert budget.end_phase(Phase.FORWARD) == 1
    assert scoped.released and not kept.released and not later.released
    assert budget.held_mb("vram") == 50
    with budget.reserve("vram", 10, mode="hard") as ctx:
        assert budget.held_mb("vram") == 60
    assert ctx.released and budget.held_mb("vram") == 50


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"resource": "disk", "mb": 1}, "resource must be one of"),
        ({"resource": "vram", "mb": -1}, "mb must be a finite number"),
        ({"resource": "vram", "mb": float("nan")}, "mb must be a finite number"),
        ({"resource": "vram", "mb": 1, "mode": "elastic"}, "budget mode must be one of"),
        ({"resource": "vram", "mb": 1, "priority": "urgent"}, "priority must be one of"),
    ],
)
def test_bad_requests_raise_naming_the_field(kwargs, match):
    budget, _ = _budget()
    with pytest.raises(ValueError, match=match):
        budget.reserve(**kwargs)


def test_enum_and_string_arguments_agree():
    a, _ = _budget()
    b, _ = _budget()
    by_name = a.reserve("vram", 250, mode="burst", priority="required")
    by_enum = b.reserve("vram", 250, mode=BudgetMode.BURST, priority=Priority.REQUIRED)
    assert (
        (by_name.outcome, by_name.granted_mb) == (by_enum.outcome, by_enum.granted_mb) == (F, 250)
    )
