"""Downsampling for the charts: buckets keep the peaks."""

from __future__ import annotations

from workbench.services.downsample import bucketize


def test_buckets_keep_peaks():
    records = [{"seq": i, "step": i, "loss": 1.0, "phase_ms": {"forward": 2.0}} for i in range(100)]
    records[37]["loss"] = 99.0
    records[80]["loss"] = -5.0
    out = bucketize(records, 10)
    assert len(out) == 10 and sum(b["count"] for b in out) == 100
    assert out[3]["max"]["loss"] == 99.0 and out[3]["seq"] == 30 and out[3]["seq_last"] == 39
    assert out[8]["min"]["loss"] == -5.0
    assert out[0]["max"]["phase_ms.forward"] == 2.0 and "seq" not in out[0]["max"]
    assert len(bucketize(records[:3], 10)) == 3
