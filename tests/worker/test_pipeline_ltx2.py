"""LTX-2 from a pipeline folder, end to end through ``workbench train`` with weight streaming,
activation spill and the Conductor on: MPEG-4 clips (and an image as a one-frame clip) on the
video stream, the audio stream fed noise (NOTE [ LTX-2 audio ] in ``pipelines/ltx2.py``)."""

import math

import pytest
import torch

from tests.worker.conftest import (
    assert_cache_reused,
    assert_streamed_and_spilled,
    stage1_steps,
)
from workbench.worker.assets import ENV_VAR
from workbench.worker.cli import main
from workbench.worker.outputs import COMFY_FILE


def _preset(pipe_io, tmp, folder, clips, name="ltx2", **over):
    data = {"path": str(clips), "bucketing": True, "max_caption_tokens": 16, "frames": 5}
    defaults = {"batch_size": 1, "adapter": {"rank": 4, "alpha": 8}, "data": data}
    return pipe_io.preset(tmp, folder, clips, name=name, **{**defaults, **over})


@pytest.fixture(scope="module")
def ltx2_run(ltx2_pipeline_dir, wide_clips, tmp_path_factory, pipe_io):
    tmp = tmp_path_factory.mktemp("ltx2-run")
    preset = _preset(pipe_io, tmp, ltx2_pipeline_dir, wide_clips)
    return pipe_io.train_twice(preset, tmp)


def test_ltx2_trains_on_clips_with_every_runtime_on_and_reuses_the_cache(ltx2_run, pipe_io):
    records, of = pipe_io.records, pipe_io.of
    first, second = ltx2_run
    recs = records(first)
    assert recs[-1]["status"] == "succeeded"
    steps = of(recs, "trainer", "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert [s["step"] for s in steps if "val_loss" in s] == [2, 4]
    stage = [r["message"] for r in of(recs, "trainer", "stage")]
    assert "4 samples, 5 distinct texts" in stage and "encoding clips" in stage
    # Stage 1 streamed Gemma's 3 decoder layers from its safetensors.
    stage1 = stage1_steps(recs)
    assert len(stage1) == 1 and stage1[0]["blocks_loaded"] == 3 and stage1[0]["file_reads"] > 0
    assert_streamed_and_spilled(recs)
    paths = [s["path"] for s in of(recs, "trainer", "sample")]
    assert paths == [f"samples/{n}-00.png" for n in ("step-000000", "step-000002", "sample")]
    assert_cache_reused(second, steps)


def _generate(pipe):
    from workbench.worker.pipelines.ltx2 import PLAIN_SAMPLING

    return pipe(
        "a photo of the digit seven",
        height=64,
        width=128,
        num_frames=5,
        num_inference_steps=2,
        max_sequence_length=16,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        **PLAIN_SAMPLING,
    ).frames


def test_ltx2_lora_and_its_comfyui_copy_load_and_agree(ltx2_run, ltx2_pipeline_dir):
    from diffusers import LTX2Pipeline
    from safetensors import safe_open
    from safetensors.torch import load_file

    run_dir, _ = ltx2_run
    lora = run_dir / "lora"
    with safe_open(str(lora / "pytorch_lora_weights.safetensors"), "pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    assert meta["stagehand.family"] == "ltx2" and meta["stagehand.pipeline_class"] == "LTX2Pipeline"
    # The video stream only: 10 targets in each of the 3 blocks, A and B.
    assert len(keys) == 3 * 10 * 2
    assert "transformer.transformer_blocks.2.attn2.to_out.0.lora_B.weight" in keys
    assert not any("audio" in k for k in keys)
    comfy = load_file(str(lora / COMFY_FILE))
    assert "diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight" in comfy
    assert not any(k.endswith(".alpha") for k in comfy)  # alpha 8 / rank 4 folded into B

    pipe = LTX2Pipeline.from_pretrained(ltx2_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    base = _generate(pipe)
    pipe.load_lora_weights(lora, adapter_name="diffusers")
    tuned = _generate(pipe)
    assert tuned.shape == (1, 5, 3, 64, 128)
    assert (tuned - base).abs().max() > 1e-4
    pipe.delete_adapters("diffusers")
    pipe.load_lora_weights(lora, weight_name=COMFY_FILE, adapter_name="comfyui")
    assert torch.allclose(_generate(pipe), tuned, atol=1e-6)


def test_ltx2_parts_match_the_pipeline(ltx2_pipeline_dir, tmp_path):
    """One ``__call__`` step from sigma 1 (the audio at sigma 1 too, fed the adapter's noise) is
    x - predict(x, 1) in normalised latents; the shift is the pipeline's ``mu`` of the packed
    video length; latents are normalised as ``__call__`` denormalises them."""
    from diffusers import LTX2Pipeline
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    from workbench.worker.families import Text
    from workbench.worker.pipelines import adapter_for, inspect_pipeline
    from workbench.worker.pipelines.ltx2 import PLAIN_SAMPLING, PassThroughConnectors, _gemma_pass

    info = inspect_pipeline(ltx2_pipeline_dir)
    assert [b.name for b in info.blocks] == [f"transformer_blocks.{i}" for i in range(3)]
    adapter = adapter_for(info, tmp_path, torch.float32)
    pipe = LTX2Pipeline.from_pretrained(ltx2_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    ids = pipe.tokenizer("a photo of the digit one").input_ids
    assert ids[0] == pipe.tokenizer.bos_token_id and len(ids) == 7  # <bos> + one token a word
    with torch.no_grad():
        text = _gemma_pass(pipe, ["a photo of the digit one"], torch.device("cpu"), 16)
        video, audio, mask = pipe.connectors(*pipe._get_gemma_prompt_embeds("a photo of the digit one", max_sequence_length=16, device="cpu"))  # fmt: skip
    assert text["hidden"].shape == (1, 16, 40)
    assert torch.equal(text["hidden"], torch.cat([video, audio], -1))
    embeds, mask = text["hidden"], text["mask"]
    x = torch.randn(1, 4, 3, 8, 12, generator=torch.Generator().manual_seed(3))
    noise, length = adapter.audio_noise(pipe.transformer, 1, 5, "cpu", torch.float32)
    assert length == round(5 / 24 * 16000 / 160 / 4)  # as __call__ sizes the audio
    pipe.connectors = PassThroughConnectors(20)
    with torch.no_grad():
        out = pipe(
            prompt_embeds=embeds,
            prompt_attention_mask=mask,
            latents=x,
            audio_latents=noise,
            height=64,
            width=96,
            num_frames=5,
            num_inference_steps=1,
            output_type="latent",
            **PLAIN_SAMPLING,
        ).frames
        vae = pipe.vae
        args = (vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        xn = pipe._normalize_latents(x, *args)
        v = adapter.predict(
            pipe.transformer, xn, torch.ones(1), Text(embeds, mask, embeds[:, 0, :0])
        )
    assert float(pipe.scheduler.sigmas[0]) == 1.0
    assert torch.allclose(out, pipe._denormalize_latents(xn - v, *args), atol=1e-5)
    u = torch.tensor([0.2, 0.5, 0.8])
    mu = calculate_shift(3 * 8 * 12, 64, 1024, 0.95, 2.05)
    assert torch.allclose(adapter.shift_sigmas(u, x.shape), pipe.scheduler.time_shift(mu, 1.0, u))
    clip = torch.rand(1, 3, 5, 16, 24) * 2 - 1
    with torch.no_grad():
        z = adapter.encode_pixels(vae, clip)
        raw = vae.encode(clip).latent_dist.mean
    assert z.shape == (1, 4, 3, 2, 3)
    assert torch.allclose(pipe._denormalize_latents(z, *args), raw, atol=1e-5)


def test_bad_ltx2_input_is_named(ltx2_pipeline_dir, wide_clips, tmp_path, monkeypatch, pipe_io):
    import json
    import shutil

    from workbench.worker.pipelines import PipelineFolderError, adapter_for, inspect_pipeline

    folder = shutil.copytree(ltx2_pipeline_dir, tmp_path / "bad-pipe")
    config = folder / "transformer" / "config.json"
    cfg = json.loads(config.read_text())
    config.write_text(json.dumps({**cfg, "caption_channels": 24, "audio_in_channels": 6}))
    with pytest.raises(PipelineFolderError) as info:
        adapter_for(inspect_pipeline(folder), tmp_path, torch.float32)
    message = str(info.value)
    assert message.startswith(f"{config}: does not fit the ltx2 pipeline")
    assert (
        "text inputs are 24 (video) and 24 (audio) wide but the connectors give 20 and 20"
        in message
    )
    assert (
        "audio_in_channels is 6; expected audio_vae latent_channels x mel_bins / 4 (4)" in message
    )

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cache"))
    cases = {
        "tokens": ({"max_caption_tokens": 12}, "data.max_caption_tokens is 12; LTX-2's text"),
        "frames": ({"frames": 4}, "data.frames is 4; the LTX-2 VAE compresses 2 frames"),
    }
    for name, (over, expected) in cases.items():
        data = {"path": str(wide_clips), "frames": 5, "max_caption_tokens": 16, **over}
        path = _preset(pipe_io, tmp_path, ltx2_pipeline_dir, wide_clips, name=name, data=data)
        assert main([str(path), "--run-dir", str(tmp_path / name)]) == 1
        last = pipe_io.records(tmp_path / name)[-1]
        assert last["kind"] == "error" and expected in last["message"], last["message"]
        assert not (tmp_path / name / "lora").exists()


def test_ltx2_resumes_from_its_checkpoint_with_the_same_adapter_and_losses(ltx2_run, pipe_io):
    """LTX-2 killed after step 3 resumes from its own config.json and step-2 checkpoint."""
    pipe_io.assert_resumes(ltx2_run[0])
