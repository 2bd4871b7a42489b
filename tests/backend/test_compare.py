"""Compare's config diff: only the paths whose values differ."""

from __future__ import annotations

from workbench.api.compare import config_diff


def test_config_diff_lists_only_differing_paths():
    a = {"memory": {"strategy": "none", "x": 1}, "lr": 1e-4, "name": "a"}
    b = {"memory": {"strategy": "stagehand", "x": 1}, "lr": 1e-4, "name": "a", "new": True}
    diff = config_diff({1: a, 2: b})
    assert diff == [
        {"path": "memory.strategy", "values": {"1": "none", "2": "stagehand"}},
        {"path": "new", "values": {"1": None, "2": True}},
    ]
