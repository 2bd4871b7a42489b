"""The weight runtime's step counts: life figures become the step's share."""

from stagehand.strategy.base import COUNTERS
from stagehand.weights.counts import StepCounts, Totals


def test_counters_and_record_are_the_step_share_of_the_life_figures():
    counts = StepCounts(
        at_begin=Totals(
            h2d_bytes=100,
            d2h_bytes=8,
            file_reads=3,
            file_read_bytes=40,
            host_cache_hits=2,
            host_waits=1,
            resident_blocks=2,
        )
    )
    counts.blocks_loaded, counts.blocks_evicted, counts.prefetch_hits = 4, 3, 2
    counts.prefetch_misses, counts.prefetch_skipped, counts.stall_time_ms = 1, 5, 2.5
    counts.copy_waits, counts.copy_wait_ms = 3, 1.25
    now = Totals(
        h2d_bytes=164,
        d2h_bytes=30,
        file_reads=7,
        file_read_bytes=90,
        pageable_copies=1,
        host_waits=3,
        host_cache_hits=5,
        file_reads_avoided=12,
        resident_blocks=6,
    )
    assert counts.counters(now) == {
        "blocks_loaded": 4,
        "blocks_evicted": 3,
        "prefetch_hits": 2,
        "prefetch_misses": 1,
        "file_reads": 4,
        "h2d_bytes": 64,
        "resident_blocks": 6,  # a state: the figure now, not a difference
        "pageable_copies": 1,
        "host_waits": 2,
    }
    assert set(counts.counters(now)) <= set(COUNTERS)
    assert counts.record(now) == {
        **counts.counters(now),
        "prefetch_skipped": 5,
        "stall_time_ms": 2.5,
        "copy_waits": 3,
        "copy_wait_ms": 1.25,
        "d2h_bytes": 22,
        "file_read_bytes": 50,
        "host_cache_hits": 3,
        "file_reads_avoided": 12,
    }
