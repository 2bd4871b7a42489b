"""The trainer runs the seed's layer-offload memory section end to end on the tiny model."""

import json

from workbench.contract.preset import PRESETS_DIR
from workbench.worker.assets import ENV_VAR
from workbench.worker.cli import main

SEED_MEMORY = {  # presets/flux-2048-layer-offload.json's memory section
    "strategy": "layer_offload",
    "layer_offload_fraction": 0.9,
    "enable_activation_offloading": True,
    "gradient_checkpointing": "on",
}


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]


def test_tiny_flux_trains_with_the_seeds_memory_section(asset_cache, monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, str(asset_cache))
    preset = json.loads((PRESETS_DIR / "tiny-ci.json").read_text())
    preset.update(name="tiny-layer-offload", memory=SEED_MEMORY, max_steps=4, checkpoint_every=2)
    path = tmp_path / "tiny-layer-offload.json"
    path.write_text(json.dumps(preset))
    run_dir = tmp_path / "run"
    assert main([str(path), "--run-dir", str(run_dir)]) == 0

    recs = _records(run_dir)
    started = [r for r in recs if r["kind"] == "run_started"][0]
    assert started["strategy"] == "layer_offload"
    steps = [r for r in recs if r["source"] == "trainer" and r["kind"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["loss"] > 0 and s["grad_norm"] > 0 for s in steps)
    # Block events in the same stream as block streaming: 3 of 4 blocks offloaded, each
    # loaded and evicted once in forward and once in backward.
    block = [r for r in recs if r["source"] == "stagehand" and r["kind"] == "block"]
    for step in (1, 2, 3):
        events = [r["event"] for r in block if r["step"] == step]
        assert events.count("load") == events.count("evict") == 6
    # close() after step 4 evicts the resident block too (the model is restored).
    last = [r["event"] for r in block if r["step"] == 4]
    assert last.count("load") == 6 and last.count("evict") == 7
    act = [r for r in recs if r["source"] == "activation_stagehand" and r["kind"] == "step"]
    assert [r["step"] for r in act] == [1, 2, 3, 4]
    assert all(r["activations_spilled"] > 0 for r in act)
    finished = recs[-1]
    assert finished["kind"] == "run_finished" and finished["status"] == "succeeded"
    lora = run_dir / finished["lora_path"]
    assert lora.is_file()
    # The checkpoint written while the wrappers were installed uses the plain names.
    names = json.loads((run_dir / "config.json").read_text())
    assert names["memory"]["strategy"] == "layer_offload"
    from safetensors.torch import load_file

    keys = load_file(str(run_dir / "checkpoints" / "step-2" / "trainable.safetensors"))
    assert keys and all(".layer." not in k for k in keys)
    assert any(k.startswith("single_transformer_blocks.1.") for k in keys)
