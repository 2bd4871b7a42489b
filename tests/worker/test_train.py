"""End to end: tiny-ci trains, resumes with the same losses, fails loudly, LoRA loads back."""

import json
import shutil

import pytest
import torch

from workbench.worker.assets import ENV_VAR
from workbench.worker.cli import main


def _losses(recs, of):
    return {r["step"]: r["loss"] for r in of(recs, "trainer", "step")}


@pytest.fixture(scope="module")
def tiny_run(asset_cache, tmp_path_factory):
    """One tiny-ci run the tests below read (none writes into it), trained once."""
    run_dir = tmp_path_factory.mktemp("tiny-run") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_VAR, str(asset_cache))
        assert main(["tiny-ci", "--run-dir", str(run_dir)]) == 0
    return run_dir


def test_tiny_ci_trains_end_to_end(tiny_run, run_io):
    recs = run_io.records(tiny_run)
    assert [r["seq"] for r in recs] == list(range(len(recs)))
    started = run_io.of(recs, "trainer", "run_started")[0]
    assert started["preset"] == "tiny-ci" and started["max_steps"] == 8
    # The attention backend guard, applied once at start; CPU: not applicable.
    assert started["attention"]["cudnn_sdp"] == "auto"
    assert started["attention"]["cudnn_sdp_enabled"] is False
    assert started["attention"]["device"] == "cpu"
    stages = run_io.of(recs, "trainer", "stage")
    cache = [s for s in stages if s["stage"] == "cache"]
    assert cache[-1]["done"] == cache[-1]["total"] == 64 + 10  # 64 images + 10 captions
    steps = run_io.of(recs, "trainer", "step")
    assert [s["step"] for s in steps] == list(range(1, 9))
    for s in steps:
        assert s["loss"] > 0 and s["grad_norm"] > 0 and s["lr"] == pytest.approx(1e-3)
        assert s["rss_mb"] > 50 and s["vram_source"] == "tracked"
        assert set(s["phase_ms"]) == {"forward", "backward", "optimizer"}
    # tiny-ci runs the composed strategy: every runtime reports each training step.
    for source in ("stagehand", "activation_stagehand", "conductor"):
        assert [r["step"] for r in run_io.of(recs, source, "step") if r["step"]] == list(
            range(1, 9)
        )
    spilled = sum(r["activations_spilled"] for r in run_io.of(recs, "activation_stagehand", "step"))
    evicted = sum(r["blocks_evicted"] for r in run_io.of(recs, "stagehand", "step"))
    assert spilled > 0 and evicted > 0
    assert all(s["pinned_mb"] > 0 for s in steps)
    # Stage 1 ran the text encoder block-swapped as step 0 (or reused the cache).
    finished = recs[-1]
    assert finished["kind"] == "run_finished" and finished["status"] == "succeeded"
    assert finished["steps_done"] == 8
    assert (tiny_run / finished["lora_path"]).is_file()
    assert json.loads((tiny_run / "config.json").read_text())["adapter"]["rank"] == 4
    assert sorted(p.name for p in (tiny_run / "checkpoints").iterdir()) == ["step-4", "step-8"]


def test_second_run_reuses_the_stage1_cache(tiny_run, cache_env, tmp_path, run_io):
    again = tmp_path / "again"
    assert main(["tiny-ci", "--run-dir", str(again)]) == 0
    messages = [s["message"] for s in run_io.of(run_io.records(again), "trainer", "stage")]
    assert any(m.startswith("text embeddings reused") for m in messages)
    assert any(m.startswith("latents reused") for m in messages)
    # Same seed, same cache: the same losses.
    assert _losses(run_io.records(again), run_io.of) == _losses(run_io.records(tiny_run), run_io.of)


def test_samples_during_training_leave_the_losses_unchanged(
    tiny_run, cache_env, tmp_path, run_io, make_preset
):
    """``samples.every`` draws samples through the training strategy before the first step
    (step 0) and mid-run (steps 3 and 6 of tiny-ci's 8), then the final ones: files and records
    for each, and not one loss moves."""
    prompts = ["a handwritten digit three", "a handwritten digit seven"]
    preset = make_preset("every", samples={"every": 3, "prompts": prompts})
    run_dir = tmp_path / "every"
    assert main([str(preset), "--run-dir", str(run_dir)]) == 0
    recs = run_io.records(run_dir)
    n = len(prompts)
    want = [f"samples/step-{s:06d}-{i:02d}.png" for s in (0, 3, 6) for i in range(n)]
    want += [f"samples/sample-{i:02d}.png" for i in range(n)]
    assert [r["path"] for r in run_io.of(recs, "trainer", "sample")] == want
    assert all((run_dir / path).is_file() for path in want)
    assert _losses(recs, run_io.of) == _losses(run_io.records(tiny_run), run_io.of)
    # The sampling steps' runtime records share the training step's number and say so.
    sampled = [r["step"] for r in run_io.of(recs, "stagehand", "step") if r.get("sampling")]
    assert sampled == [0, 3, 6]
    assert not any(r.get("sampling") for r in run_io.of(recs, "trainer", "step"))


def test_resume_continues_with_the_same_losses(tiny_run, cache_env, tmp_path, run_io):
    """Killed after step 6, resumed from its own config.json (as ``POST /api/runs/{id}/resume``
    starts it) and its step-4 checkpoint: steps 5-8 repeat the uninterrupted run's losses, and
    a ``trainer/resumed`` record before them says steps 5 and 6 are trained again."""
    full = _losses(run_io.records(tiny_run), run_io.of)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(tiny_run / "config.json", resumed / "config.json")
    shutil.copytree(tiny_run / "checkpoints" / "step-4", resumed / "checkpoints" / "step-4")
    # The stream as a worker killed after step 6 left it.
    recs = run_io.records(tiny_run)
    killed = next(r for r in run_io.of(recs, "trainer", "step") if r["step"] == 6)
    head = recs[: recs.index(killed) + 1]
    (resumed / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in head))
    assert main([str(resumed / "config.json"), "--run-dir", str(resumed), "--resume"]) == 0
    recs = run_io.records(resumed)
    assert [r["seq"] for r in recs] == list(range(len(recs)))  # seq continues
    after = {k: v for k, v in _losses(recs[len(head) :], run_io.of).items()}
    assert sorted(after) == [5, 6, 7, 8]
    for step in after:
        assert after[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7)
    assert recs[-1]["status"] == "succeeded" and recs[-1]["steps_done"] == 8
    (mark,) = run_io.of(recs, "trainer", "resumed")
    assert (mark["step"], mark["checkpoint"]) == (4, "checkpoints/step-4")
    # Before it: every record of steps 5-6 the killed worker wrote; after it: the new ones.
    replayed = [r for r in recs if r["kind"] == "step" and r["step"] in (5, 6)]
    assert {r["source"] for r in replayed} >= {"trainer", "stagehand", "conductor"}
    assert all((r["seq"] < mark["seq"]) == (r["seq"] <= killed["seq"]) for r in replayed)
    assert [r["step"] for r in run_io.of(recs, "trainer", "step") if r["seq"] > mark["seq"]] == [
        5, 6, 7, 8
    ]  # fmt: skip


def test_saved_lora_loads_back_with_diffusers_and_changes_the_output(tiny_run, tiny_flux):
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    from workbench.worker.assets import example_inputs, output_tensor

    model = FluxTransformer2DModel.from_pretrained(tiny_flux).eval()
    inputs = example_inputs(model, batch_size=1, seed=0, latent_hw=(8, 8))
    with torch.no_grad():
        base = output_tensor(model(**inputs)).clone()
        lora_file = tiny_run / "lora" / "pytorch_lora_weights.safetensors"
        model.load_lora_adapter(str(lora_file), prefix="transformer", adapter_name="run")
        tuned = output_tensor(model(**inputs))
    saved = load_file(str(lora_file))
    name = "transformer.transformer_blocks.0.attn.to_q.lora_B.weight"
    loaded = model.transformer_blocks[0].attn.to_q.lora_B["run"].weight
    assert torch.equal(loaded, saved[name]) and saved[name].abs().sum() > 0
    assert (tuned - base).abs().max() > 1e-4


def test_corrupt_model_folder_writes_the_error_record(
    cache_env, tiny_flux, tmp_path, make_preset, run_io
):
    bad = tmp_path / "corrupt-model"
    shutil.copytree(tiny_flux, bad)
    for shard in bad.glob("*.safetensors"):
        shard.write_bytes(b"not a safetensors file")
    vae = tmp_path / "vae"
    preset = make_preset(
        model={"factory": None, "path": str(bad), "vae_path": str(vae)},
    )
    from workbench.worker.assets import build_model

    shutil.copytree(build_model("vae", "tiny"), vae)
    run_dir = tmp_path / "failed"
    assert main([str(preset), "--run-dir", str(run_dir)]) == 1
    last = run_io.records(run_dir)[-1]
    assert last["source"] == "trainer" and last["kind"] == "error"
    assert last["oom"] is False and last["error_type"]
    assert "Traceback" in last["traceback"] and "safetensors" in last["traceback"].lower()
    assert not (run_dir / "lora").exists()  # no step ran: nothing to save


def test_invalid_preset_file_exits_nonzero_with_path_named_error(
    cache_env, make_preset, tmp_path, run_io
):
    preset = make_preset(memory={"layer_offload_fraction": 1.5})
    run_dir = tmp_path / "invalid"
    assert main([str(preset), "--run-dir", str(run_dir)]) == 1
    last = run_io.records(run_dir)[-1]
    assert last["kind"] == "error" and last["error_type"] == "PresetError"
    assert "memory.layer_offload_fraction: found 1.5" in last["message"]


def test_sample_prompts_use_their_own_text_rows(cache_env, make_preset, tmp_path):
    """Stage 1 caches each distinct text once: a prompt that is also a caption shares that
    caption's row, another prompt gets a row after the captions; samples are drawn from those."""
    from workbench.worker.families import family
    from workbench.worker.preset import load_preset, validate_preset
    from workbench.worker.run import Run
    from workbench.worker.setup import resolve_assets

    prompts = ["a handwritten digit seven", "a red bicycle", "a handwritten digit three"]
    path = make_preset("rows", samples={"prompts": prompts}, data={"limit": 10})
    preset = validate_preset(load_preset(str(path))[1])
    (tmp_path / "rows").mkdir()
    run = Run(str(path), tmp_path / "rows", torch.device("cpu"), resume=False)
    run.family = family(preset.family)  # chosen before the scan, as Run.execute does
    samples = run.scan(preset)
    _, vae_dir, encoder_dir, _ = resolve_assets(preset)
    data = run.stage1(preset, vae_dir, encoder_dir, samples)
    rows = {s.caption: data.caption_rows[i] for i, s in enumerate(samples)}
    assert len(rows) == 10 and len(data.text["hidden"]) == 11  # 10 digit captions + the bicycle
    assert data.prompt_rows == [rows[prompts[0]], 10, rows[prompts[2]]]
