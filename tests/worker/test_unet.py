"""The UNet family: DDPM noise-prediction loss, the unet-tiny preset end to end, LoRA load-back."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from workbench.contract.preset import PRESETS_DIR, PresetError
from workbench.worker.assets import ENV_VAR
from workbench.worker.cli import main
from workbench.worker.families import Text, family
from workbench.worker.preset import load_preset, validate_preset


def _write(tmp_path, name: str, **over) -> str:
    data = json.loads((PRESETS_DIR / "unet-tiny.json").read_text())
    for key, value in over.items():
        if isinstance(value, dict):
            data[key] = {**data.get(key, {}), **value}
        else:
            data[key] = value
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({**data, "name": name}))
    return str(path)


def _losses(recs, of):
    return {r["step"]: r["loss"] for r in of(recs, "trainer", "step")}


def _abar(t: torch.Tensor) -> torch.Tensor:
    """SD 1.x's alpha-bar by hand: scaled_linear betas sqrt-spaced 0.00085..0.012, 1000 steps."""
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float32) ** 2
    return torch.cumprod(1 - betas, 0)[t].view(-1, 1, 1, 1)  # (B, 1, 1, 1)


def test_unet_tiny_preset_validates():
    name, raw = load_preset("unet-tiny")
    preset = validate_preset(raw)
    assert name == "unet-tiny"
    assert preset.family == "unet" and preset.model.factory == "unet"
    assert preset.prediction_type == "epsilon"
    assert preset.memory.strategy == "stagehand"
    assert validate_preset({**raw, "model_type": "sd15", "model": {"path": "/x"}}).family == "unet"
    assert validate_preset({**raw, "prediction_type": "v_prediction"}).prediction_type == (
        "v_prediction"
    )
    flux = json.loads((PRESETS_DIR / "tiny-ci.json").read_text())
    with pytest.raises(PresetError, match="prediction_type 'v_prediction' applies to the unet"):
        validate_preset({**flux, "prediction_type": "v_prediction"})
    with pytest.raises(PresetError, match="prediction_type"):
        validate_preset({**raw, "prediction_type": "sample"})


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_unet_loss_is_ddpm_noise_prediction(prediction):
    from types import SimpleNamespace

    from workbench.worker.assets import instantiate

    unet = instantiate("unet", "tiny")
    fam = family("unet")
    g0 = torch.Generator().manual_seed(7)
    x0 = torch.randn(3, 4, 8, 8, generator=g0)  # (B, C, h, w) latents
    noise = torch.randn(3, 4, 8, 8, generator=g0)
    ehs = torch.randn(3, 6, 384, generator=g0)  # (B, T, 384) MiniLM hidden states
    text = Text(hidden=ehs, mask=torch.ones(3, 6), pooled=ehs.mean(1))
    preset = SimpleNamespace(prediction_type=prediction)

    x_t, t, target = fam.training_pair(x0, noise, torch.Generator().manual_seed(11), preset)
    with torch.no_grad():
        loss = F.mse_loss(fam.predict(unet, x_t, t, text).float(), target.float())

    t_ref = torch.randint(0, 1000, (3,), generator=torch.Generator().manual_seed(11))
    assert t.dtype == torch.int64 and torch.equal(t, t_ref)
    a = _abar(t_ref)
    noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
    want_target = noise if prediction == "epsilon" else a.sqrt() * noise - (1 - a).sqrt() * x0
    with torch.no_grad():
        want = F.mse_loss(unet(noisy, t_ref, ehs).sample, want_target)
    torch.testing.assert_close(x_t, noisy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(target, want_target, rtol=1e-5, atol=1e-6)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert 0.5 < float(want) < 3.0  # an untrained net against unit-variance targets


@pytest.fixture(scope="module")
def unet_run(asset_cache, tmp_path_factory):
    """One unet-tiny run (8 steps, a sample prompt) the tests below read, trained once."""
    tmp = tmp_path_factory.mktemp("unet-run")
    run_dir = tmp / "run"
    preset = _write(tmp, "unet-e2e", samples={"prompts": ["a handwritten digit seven"]})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_VAR, str(asset_cache))
        assert main([preset, "--run-dir", str(run_dir)]) == 0
    return run_dir


def test_unet_tiny_trains_end_to_end(unet_run, cache_env, tmp_path, run_io):
    recs = run_io.records(unet_run)
    steps = run_io.of(recs, "trainer", "step")
    assert [s["step"] for s in steps] == list(range(1, 9))
    for s in steps:
        assert 0.2 < s["loss"] < 5 and s["grad_norm"] > 0 and s["lr"] == pytest.approx(1e-3)
        assert s["step_time_ms"] > 0 and s["samples_per_s"] > 0 and s["rss_mb"] > 50
        assert set(s["phase_ms"]) == {"forward", "backward", "optimizer"}
        assert s["pinned_mb"] > 0
    # The weight runtime streamed the UNet's stages (down, up and mid blocks); activations
    # spilled.
    evicted = sum(r["blocks_evicted"] for r in run_io.of(recs, "stagehand", "step"))
    spilled = sum(r["activations_spilled"] for r in run_io.of(recs, "activation_stagehand", "step"))
    assert evicted > 0 and spilled > 0
    blocks = {r["block_name"] for r in run_io.of(recs, "stagehand", "block")}
    unet_blocks = {b for b in blocks if not b.startswith("encoder.")}  # not MiniLM's layers
    assert unet_blocks == {
        "down_blocks.0",
        "down_blocks.1",
        "mid_block",
        "up_blocks.0",
        "up_blocks.1",
    }
    samples = [r["path"] for r in run_io.of(recs, "trainer", "sample")]
    assert samples == ["samples/step-000000-00.png", "samples/sample-00.png"]  # step 0, the end
    assert all((unet_run / path).is_file() for path in samples)
    assert recs[-1]["status"] == "succeeded" and recs[-1]["steps_done"] == 8

    # The same run without any memory strategy computes the same losses (streaming is exact).
    plain = tmp_path / "plain"
    preset = _write(
        tmp_path, "unet-plain", memory={"strategy": "none", "gradient_checkpointing": "off"}
    )
    assert main([preset, "--run-dir", str(plain)]) == 0
    full = _losses(recs, run_io.of)
    for step, loss in _losses(run_io.records(plain), run_io.of).items():
        assert loss == pytest.approx(full[step], rel=1e-4), step

    # Resume from step 4 continues with the same losses.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(unet_run / "checkpoints" / "step-4", resumed / "checkpoints" / "step-4")
    preset = _write(tmp_path, "unet-e2e")
    assert main([preset, "--run-dir", str(resumed), "--resume"]) == 0
    after = _losses(run_io.records(resumed), run_io.of)
    assert sorted(after) == [5, 6, 7, 8]
    for step in after:
        assert after[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7)


def test_unet_lora_loads_back_and_changes_output(unet_run, cache_env):
    from diffusers import UNet2DConditionModel

    from workbench.worker.assets import build_model, example_inputs

    lora = unet_run / "lora" / "pytorch_lora_weights.safetensors"
    unet = UNet2DConditionModel.from_pretrained(build_model("unet", "tiny")).eval()
    kwargs = example_inputs(unet, batch_size=2, seed=3)
    with torch.no_grad():
        before = unet(**kwargs).sample
    unet.load_lora_adapter(str(lora), prefix="unet")
    loaded = {n: p for n, p in unet.named_parameters() if "lora_B" in n}
    assert len(loaded) == 48  # to_q, to_k, to_v, to_out.0 of 6 transformer blocks x 2 attns
    assert all(p.abs().sum() > 0 for p in loaded.values())
    with torch.no_grad():
        after = unet(**kwargs).sample
    assert (after - before).abs().max() > 1e-4
