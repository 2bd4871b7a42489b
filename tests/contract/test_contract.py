"""The contract read from both sides: what the server writes the worker reads, and the reverse
(``workbench.contract.control``, ``stagehand.config.wire``, ``workbench.contract.preset.merge``)."""

import json
import math

from stagehand.config.wire import decode, encode
from workbench.contract.control import LIMITS, STOP, ControlDir, write_request
from workbench.contract.preset.merge import merge_overrides


def test_requests_the_server_writes_are_read_by_the_worker_in_sending_order(tmp_path):
    worker = ControlDir(tmp_path)
    second = write_request(tmp_path, 2, {"command": STOP})
    first = write_request(tmp_path, 1, {"command": LIMITS, "limits": {"window": 3}})
    (worker.path / ".000003-x.json.tmp").write_text("{}")  # a request still being written
    got = worker.poll()
    assert [(r.command, r.request_id, r.error) for r in got] == [
        (LIMITS, first, None),
        (STOP, second, None),
    ]
    assert got[0].body == {"command": LIMITS, "limits": {"window": 3}, "request_id": first}
    assert len(first) == 12 and first != second
    assert sorted(p.name for p in worker.path.iterdir()) == [".000003-x.json.tmp"]
    assert worker.poll() == []
    assert write_request(tmp_path, 4, {"command": STOP, "request_id": "mine"}) == "mine"
    assert [r.request_id for r in worker.poll()] == ["mine"]


def test_a_record_the_worker_encodes_is_decoded_unchanged_but_for_non_finite_numbers():
    record = {"seq": 3, "loss": float("nan"), "peak": float("inf"), "lr": 1e-4, "ids": (1, 2)}
    line = encode(record)
    assert line == '{"seq":3,"loss":null,"peak":null,"lr":0.0001,"ids":[1,2]}'
    assert decode(line) == (json.loads(line), line)


def test_a_line_with_nan_nested_is_passed_on_with_null():
    line = json.dumps({"seq": 1, "losses": [1.5, math.nan], "x": {"y": -math.inf}})
    value, passed_on = decode(line)
    assert value == {"seq": 1, "losses": [1.5, None], "x": {"y": None}}
    assert passed_on == '{"seq":1,"losses":[1.5,null],"x":{"y":null}}'


def test_overrides_merge_key_by_key_and_share_nothing_with_either_side():
    base = {"memory": {"a": 1, "b": {"c": [1]}}, "steps": 5}
    overrides = {"memory": {"b": {"d": 2}}, "steps": None, "tags": ["x"]}
    merged = merge_overrides(base, overrides)
    assert merged == {"memory": {"a": 1, "b": {"c": [1], "d": 2}}, "steps": None, "tags": ["x"]}
    merged["memory"]["b"]["c"].append(2)
    merged["tags"].append("y")
    assert base["memory"]["b"]["c"] == [1] and overrides["tags"] == ["x"]


def test_the_watermark_rule_is_the_same_for_the_configs_the_server_and_the_worker():
    from pydantic import ValidationError

    from stagehand.config.limits import (
        ACTIVATION_PAIR,
        check_pair,
        check_watermarks,
        watermark_problem,
    )
    from stagehand.config.memory import LiveLimits, MemoryConfig, Watermarks
    from workbench.api.models import LimitsUpdate

    sentence = "vram_low_watermark_mb (300.0) must not be above vram_high_watermark_mb (200.0)"
    for refuse in (
        lambda: check_watermarks(200.0, 300.0),
        lambda: Watermarks(200.0, 300.0),
        lambda: LiveLimits(vram_high_watermark_mb=200.0, vram_low_watermark_mb=300.0),
        lambda: LimitsUpdate(vram_high_watermark_mb=200.0, vram_low_watermark_mb=300.0),
    ):
        try:
            refuse()
        except (ValueError, ValidationError) as exc:
            assert sentence in str(exc)
        else:
            raise AssertionError("a low watermark above the high one was accepted")
    check_watermarks(200.0, 200.0, ACTIVATION_PAIR)  # equal is fine
    check_pair("auto", "auto", ACTIVATION_PAIR)
    try:
        check_pair("auto", 5.0, ("vram_hard_cap_mb", "vram_soft_cap_mb"))
    except ValueError as exc:
        assert 'vram_hard_cap_mb and vram_soft_cap_mb must both be "auto"' in str(exc)
    else:
        raise AssertionError("one auto watermark was accepted")
    assert watermark_problem({"vram_low_watermark_mb": 300.0}, {"vram_high_watermark_mb": 200}) == (
        "vram_high_watermark_mb",
        "vram_high_watermark_mb (200) must not be below the low watermark in force, "
        "vram_low_watermark_mb (300)",
    )
    assert (
        watermark_problem({"vram_low_watermark_mb": 100.0}, {"vram_high_watermark_mb": 200}) is None
    )
    # Every live-limit field's path names a field of the memory section the worker reads.
    from stagehand.config.limits import PATHS

    config = MemoryConfig.model_validate(
        {"strategy": "stagehand", "stagehand": {"activation_stagehand": {"enabled": True}}}
    ).model_dump()
    for field, path in PATHS.items():
        node = {"memory": config}
        for key in path.split("."):
            assert key in node, f"{field}: {path} is not in a run's config"
            node = node[key]


def test_the_device_profiles_the_schema_lists_are_the_planners():
    """``POST /api/plan`` and ``POST /api/tunes`` list their ``device`` values in the schema
    from ``workbench.contract.plan_inputs.DEVICE_PROFILES`` (the server loads without the planner): the
    same names, in the same order, as ``cpu`` and ``workbench.plan.profiles.PROFILES``."""
    from workbench.contract.plan_inputs import DEVICE_PROFILES
    from workbench.plan.profiles import PROFILES

    assert list(DEVICE_PROFILES) == ["cpu", *PROFILES]
