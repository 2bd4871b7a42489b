"""``workbench plan`` shows SquareQ's quantization error of the model's real weights:
the table the run's first ``squareq/step`` record carries, read from SquareQ's cache or
quantized into it once (the run then reuses it), "not measured" with the reason for a folder
whose weights cannot be read, and the fp8 weights a checkpoint stores counted apart.

The tiny FLUX pipeline (``tests/fixtures/pipelines.py``) is planned with ``train_dtype``
bfloat16 over a float32 folder, so the entries' dtypes (part of the cache key) must be the
run's, not ``model.dtype``'s.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stagehand.squareq import store
from workbench.cli.plan import main
from workbench.plan import plan_preset, profile

TABLE = ("quantized_layers", "rel_rms_mean", "rel_rms_max", "worst_layer", "worst_layers")


def _preset(folder, fmt: str, cache) -> dict:
    return {
        "model": {"path": str(folder), "dtype": "float32"},
        "train_dtype": "bfloat16",
        "resolution": 64,
        "batch_size": 1,
        "memory": {
            "strategy": "stagehand",
            "stagehand": {"squareq": {"format": fmt, "cache_dir": str(cache)}},
        },
        "data": {"path": "/nowhere", "max_caption_tokens": 16},
    }


@pytest.fixture
def quantized(monkeypatch):
    """Counts the weights SquareQ's store quantizes (``store.quantize`` calls)."""
    calls = []
    real = store.quantize

    def counting(weight, fmt):
        calls.append(fmt)
        return real(weight, fmt)

    monkeypatch.setattr(store, "quantize", counting)
    return calls


def first_record(data: dict) -> dict:
    """The run's set-up as ``Run.stage2`` does it (the transformer loaded in ``train_dtype``,
    the family's LoRA targets, the adapter, the strategy over the transformer folder) and the
    first ``squareq/step`` record of its weight runtime."""
    import torch

    from stagehand.strategy import build_strategy
    from workbench.worker import loop
    from workbench.worker.preset import validate_preset
    from workbench.worker.setup import family_targets, pipeline_family

    preset = validate_preset(data)
    family = pipeline_family(preset, torch.device("cpu"))
    model = loop.load_transformer(family, family.transformer_dir, loop.DTYPES[preset.train_dtype])
    preset = family_targets(preset, family)
    loop.attach_adapter(model, preset)
    strategy = build_strategy(
        model, preset.memory, device="cpu", checkpoint_dir=family.transformer_dir
    )
    try:
        return strategy.weights.squareq.step_record()
    finally:
        strategy.close()


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_plan_error_is_the_runs_first_record_and_its_cache(asset_cache, tmp_path, fmt, quantized):
    """The plan quantizes the checkpoint into SquareQ's cache once (a second plan and the run
    quantize nothing: same key), and its table is the one a run's first record computes on
    its own from the same folder (a fresh cache: every figure equal)."""
    from tests.fixtures.pipelines import build_pipeline

    folder = build_pipeline("flux", asset_cache)
    data = _preset(folder, fmt, tmp_path / "plan")
    # The New run page's plan reads the cache only: nothing there yet.
    before = plan_preset(data, profile("cpu")).quant_error
    assert before["measured"] is False and "not in the SquareQ cache yet" in before["reason"]
    assert quantized == []
    got = plan_preset(data, profile("cpu"), quant_error="compute").quant_error
    n = got["quantized_layers"]
    assert got["measured"] and got["cached"] is False and got["format"] == fmt
    assert len(quantized) == n == 72  # 3 double + 5 single tiny FLUX blocks' linear weights
    again = plan_preset(data, profile("cpu"), quant_error="compute").quant_error
    assert again["cached"] is True and len(quantized) == n  # read, not quantized again
    assert {k: again[k] for k in TABLE} == {k: got[k] for k in TABLE}
    reused = first_record(data)  # the run on the plan's cache: its key is the plan's
    assert reused["cached"] is True and len(quantized) == n
    fresh = first_record(_preset(folder, fmt, tmp_path / "run"))  # computed by the run alone
    assert fresh["cached"] is False and len(quantized) == 2 * n
    assert (
        {k: fresh[k] for k in TABLE} == {k: reused[k] for k in TABLE} == {k: got[k] for k in TABLE}
    )
    assert len(got["worst_layers"]) == 5 and got["worst_layers"][0][0] == got["worst_layer"]
    assert 0 < got["rel_rms_mean"] <= got["rel_rms_max"] < (0.01 if fmt == "int8" else 0.05)


def test_a_cache_that_does_not_verify_is_named_then_replaced(asset_cache, tmp_path, quantized):
    """A garbage ``squareq.json`` was ``Expecting value: line 1 column 1`` on every later plan:
    the New run page's plan (cache only) names the folder and how to clear it, ``workbench
    plan`` quantizes into a fresh one, with the same table."""
    from tests.fixtures.pipelines import build_pipeline

    data = _preset(build_pipeline("flux", asset_cache), "int8", tmp_path / "sq")
    got = plan_preset(data, profile("cpu"), quant_error="compute").quant_error
    cache = Path(got["folder"])
    (cache / "squareq.json").write_text("garbage")
    named = plan_preset(data, profile("cpu")).quant_error
    assert named["measured"] is False and len(quantized) == 72
    assert named["reason"].startswith(
        f"not measured: SquareQ cache {cache} does not verify: squareq.json is not readable JSON"
    )
    assert f"delete it (rm -r '{cache}')" in named["reason"]
    again = plan_preset(data, profile("cpu"), quant_error="compute").quant_error
    assert again["measured"] and again["cached"] is False and len(quantized) == 2 * 72
    assert again["replaced"].startswith(f"SquareQ cache {cache} did not verify")
    assert {k: again[k] for k in TABLE} == {k: got[k] for k in TABLE}
    assert plan_preset(data, profile("cpu")).quant_error["cached"] is True


def test_cli_table_and_no_quant_error(asset_cache, tmp_path, capsys):
    """The CLI prints the table (percent, the worst layer, the five worst) and writes it in the
    JSON; ``--no-quant-error`` says not measured and quantizes nothing."""
    from tests.fixtures.pipelines import build_pipeline

    folder = build_pipeline("flux", asset_cache)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_preset(folder, "int8", tmp_path / "sq")))
    out = tmp_path / "o.json"
    args = [str(path), "--no-calibration", "--json", str(out)]
    assert main([*args, "--no-quant-error"]) == 0
    assert "SquareQ      int8: not measured: turned off" in capsys.readouterr().out
    assert not (tmp_path / "sq").exists()
    assert main(args) == 0
    q = json.loads(out.read_text())["quant_error"]
    text = capsys.readouterr().out
    line = (
        f"SquareQ      int8: {q['quantized_layers']} layers, relative RMS error mean "
        f"{100 * q['rel_rms_mean']:.3f}%, worst {100 * q['rel_rms_max']:.3f}% "
        f"({q['worst_layer']}); quantized now in"
    )
    assert line in text and f"five worst: {q['worst_layer']} " in text
    assert Path(q["folder"]).parent == tmp_path / "sq"


def test_sparse_folder_is_not_measured(asset_cache, tmp_path, quantized):
    """A folder whose safetensors are holes (the planner's real-size test folders) plans as
    before, its error "not measured" with the file named; nothing is quantized."""
    from stagehand.weights.sources import SafetensorsCheckpoint
    from tests.fixtures.pipelines import build_pipeline
    from tests.fixtures.sparse_pipelines import DTYPES, write_sparse_safetensors

    folder = tmp_path / "flux"
    shutil.copytree(build_pipeline("flux", asset_cache), folder)
    transformer = folder / "transformer"
    source = SafetensorsCheckpoint(transformer)
    shapes = {k: (e.shape, DTYPES[e.dtype]) for k, e in source.entries.items()}
    source.close()
    for f in [*transformer.glob("*.safetensors"), *transformer.glob("*.index.json")]:
        f.unlink()
    write_sparse_safetensors(transformer / "diffusion_pytorch_model.safetensors", shapes)
    plan = plan_preset(
        _preset(folder, "int8", tmp_path / "sq"), profile("cpu"), quant_error="compute"
    )
    q = plan.quant_error
    assert q["measured"] is False and quantized == []
    assert q["reason"].startswith("not measured: diffusion_pytorch_model.safetensors is a sparse")
    assert plan.to_dict()["quant_error"] == q and len(plan.inventory.blocks) == 8


def test_fp8_checkpoint_has_no_source_to_compare(asset_cache, tmp_path, quantized):
    """A checkpoint storing its block linear weights in float8_e4m3fn streams them as stored:
    the plan counts them apart (no higher-precision source to measure against)."""
    from tests.fixtures.pipelines import build_pipeline
    from tests.runtime.test_squareq_prequantized import fp8_folder
    from workbench.plan.table import quant_lines

    folder = tmp_path / "flux"
    shutil.copytree(
        build_pipeline("flux", asset_cache), folder, ignore=shutil.ignore_patterns("transformer")
    )
    stored = fp8_folder(build_pipeline("flux", asset_cache) / "transformer", folder / "transformer")
    q = plan_preset(
        _preset(folder, "int8", tmp_path / "sq"), profile("cpu"), quant_error="compute"
    ).quant_error
    assert q["measured"] and q["quantized_layers"] == 0 and quantized == []
    assert q["prequantized_layers"] == len(stored) == 72
    (line,) = quant_lines(q)
    assert "72 layers stored in 8 bits in the checkpoint (no source to compare)" in line
