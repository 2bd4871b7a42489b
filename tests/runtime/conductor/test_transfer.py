"""TransferManager: separate H2D/D2H pools, typed denials, slots returned on every path."""

import threading

import pytest

from stagehand.conductor.transfer import TransferManager
from stagehand.conductor.types import DenialReason, Priority


def test_pools_are_separate_and_exhaustion_is_typed():
    tm = TransferManager(h2d_slots=2, d2h_slots=1)
    h1, h2 = tm.request_transfer("h2d", "required"), tm.request_transfer("H2D", Priority.REQUIRED)
    assert h1.granted and h2.granted and tm.inflight("h2d") == 2
    h3 = tm.request_transfer("h2d", "critical")
    assert not h3.granted and h3.reason is DenialReason.H2D_SLOTS_EXHAUSTED
    d1 = tm.request_transfer("d2h", "required")  # the D2H pool is untouched by H2D traffic
    d2 = tm.request_transfer("d2h", "required")
    assert d1.granted and d2.reason is DenialReason.D2H_SLOTS_EXHAUSTED
    assert (tm.inflight("h2d"), tm.inflight("d2h")) == (2, 1)
    h1.release()
    h1.release()  # idempotent: the second call must not free h2's slot
    assert tm.inflight("h2d") == 1
    assert tm.request_transfer("h2d", "speculative").granted
    assert tm.counts == {"grant": 4, "deny": 2}


def test_denial_is_never_a_bare_false():
    tm = TransferManager(1, 1)
    tm.request_transfer("h2d", "required")
    denied = tm.request_transfer("h2d", "required")
    assert denied.granted is False and isinstance(denied.reason, DenialReason)
    denied.release()  # releasing a denial is a no-op
    assert tm.inflight("h2d") == 1


def test_context_manager_returns_the_slot_when_the_copy_raises():
    tm = TransferManager(1, 1)
    with pytest.raises(RuntimeError, match="copy failed"):
        with tm.request_transfer("d2h", "required") as grant:
            assert grant.granted and tm.inflight("d2h") == 1
            raise RuntimeError("copy failed")
    assert tm.inflight("d2h") == 0 and grant.released
    # and a try/finally release after an error
    grant = tm.request_transfer("h2d", "required")
    try:
        raise ValueError("boom")
    except ValueError:
        pass
    finally:
        grant.release()
    assert tm.inflight("h2d") == 0


def test_policy_limits_and_suppression():
    tm = TransferManager(h2d_slots=3, d2h_slots=2)
    tm.set_limits(max_inflight_h2d=1, max_inflight_d2h=0, suppress=True)
    spec = tm.request_transfer("h2d", "speculative")
    bg = tm.request_transfer("h2d", "background")
    assert spec.reason is bg.reason is DenialReason.PHASE_RULE_SUPPRESSED_SPECULATIVE
    first = tm.request_transfer("h2d", "required")
    second = tm.request_transfer("h2d", "required")
    assert first.granted and second.reason is DenialReason.POLICY_H2D_LIMIT
    assert tm.request_transfer("d2h", "required").reason is DenialReason.POLICY_D2H_LIMIT
    # CRITICAL work is held only to the physical pool
    assert tm.request_transfer("h2d", "critical").granted
    assert tm.request_transfer("d2h", "critical").granted
    assert tm.inflight("h2d") == 2


def test_consecutive_full_checks_count_only_pool_exhaustion():
    tm = TransferManager(1, 1)
    held = tm.request_transfer("h2d", "required")
    for expected in (1, 2, 3, 4):
        tm.request_transfer("h2d", "required")
        assert tm.consecutive_full == expected
    held.release()
    tm.request_transfer("h2d", "required")
    assert tm.consecutive_full == 0


@pytest.mark.parametrize(
    ("direction", "priority", "match"),
    [("up", "required", "direction must be"), ("h2d", "soon", "priority must be one of")],
)
def test_bad_arguments_raise(direction, priority, match):
    with pytest.raises(ValueError, match=match):
        TransferManager(1, 1).request_transfer(direction, priority)


def test_slots_never_oversubscribed_across_threads():
    tm = TransferManager(h2d_slots=2, d2h_slots=1)
    peak = [0]
    lock = threading.Lock()

    def worker():
        for _ in range(300):
            with tm.request_transfer("h2d", "required") as g:
                if g.granted:
                    with lock:
                        peak[0] = max(peak[0], tm.inflight("h2d"))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] <= 2 and tm.inflight("h2d") == 0
