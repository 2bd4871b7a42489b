"""The layer offload benchmark line runs (figures are printed, not asserted as speeds)."""

from workbench.bench.layer_offload import bench_layer_offload


def test_bench_line_prints_every_row(asset_cache):
    lines = []
    rows = bench_layer_offload(
        "flux",
        "tiny",
        (0.5, 0.9),
        steps=1,
        warmup=0,
        cache_dir=str(asset_cache),
        print_fn=lines.append,
    )
    labels = [r["label"] for r in rows]
    assert labels == [
        "plain",
        "plain + checkpointing",
        "block streaming + ckpt",
        "layer offload 0.5",
        "layer offload 0.9",
        "layer offload 0.9 keep",
    ]
    assert len(lines) == len(rows) + 1 and lines[0].startswith("# flux-tiny: 4 blocks")
    by = {r["label"]: r for r in rows}
    assert by["plain"]["ratio"] == 1.0 and all(r["step_ms"] > 0 for r in rows)
    assert by["layer offload 0.9"]["peak_source"] == "tracked"
    assert by["layer offload 0.9"]["peak_mb"] < by["layer offload 0.5"]["peak_mb"]
