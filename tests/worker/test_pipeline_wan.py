"""Wan from a pipeline folder, end to end through ``workbench train`` with weight streaming,
activation spill and the Conductor on: Wan 2.1 on MPEG-4 clips decoded with PyAV (and an image
as a one-frame clip), and Wan 2.2's two experts, one per run."""

import json
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


def _preset(pipe_io, tmp, folder, clips, name="wan", **over):
    data = {"path": str(clips), "bucketing": True, "max_caption_tokens": 16, "frames": 5}
    defaults = {"batch_size": 1, "adapter": {"rank": 4, "alpha": 8}, "data": data}
    return pipe_io.preset(tmp, folder, clips, name=name, **{**defaults, **over})


@pytest.fixture(scope="module")
def wan_run(wan_pipeline_dir, wide_clips, tmp_path_factory, pipe_io):
    tmp = tmp_path_factory.mktemp("wan-run")
    preset = _preset(pipe_io, tmp, wan_pipeline_dir, wide_clips)
    return pipe_io.train_twice(preset, tmp)


def test_wan_trains_on_clips_with_every_runtime_on_and_reuses_the_cache(wan_run, pipe_io):
    records, of = pipe_io.records, pipe_io.of
    first, second = wan_run
    recs = records(first)
    assert recs[-1]["status"] == "succeeded"
    steps = of(recs, "trainer", "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert [s["step"] for s in steps if "val_loss" in s] == [2, 4]
    stage = [r["message"] for r in of(recs, "trainer", "stage")]
    assert "4 samples, 5 distinct texts" in stage and "encoding clips" in stage
    stage1 = stage1_steps(recs)
    assert len(stage1) == 1 and stage1[0]["blocks_loaded"] == 3 and stage1[0]["file_reads"] > 0
    assert_streamed_and_spilled(recs)
    paths = [s["path"] for s in of(recs, "trainer", "sample")]
    assert paths == [f"samples/{n}-00.png" for n in ("step-000000", "step-000002", "sample")]
    assert_cache_reused(second, steps)


def _generate(pipe):
    return pipe(
        "a photo of the digit seven",
        height=64,
        width=128,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=1.0,
        max_sequence_length=16,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).frames


def test_wan_lora_and_its_comfyui_copy_load_and_agree(wan_run, wan_pipeline_dir):
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    run_dir, _ = wan_run
    lora = run_dir / "lora"
    comfy = load_file(str(lora / COMFY_FILE))
    # Wan's original names, as ComfyUI has them.
    assert "diffusion_model.blocks.0.self_attn.q.lora_A.weight" in comfy
    assert "diffusion_model.blocks.2.cross_attn.o.lora_B.weight" in comfy
    assert "diffusion_model.blocks.1.ffn.0.lora_A.weight" in comfy
    assert not any(k.endswith(".alpha") for k in comfy)  # alpha 8 / rank 4 folded into B

    pipe = WanPipeline.from_pretrained(wan_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    base = _generate(pipe)
    pipe.load_lora_weights(lora, adapter_name="diffusers")
    tuned = _generate(pipe)
    assert tuned.shape == (1, 5, 3, 64, 128)
    assert (tuned - base).abs().max() > 1e-4
    pipe.delete_adapters("diffusers")
    pipe.load_lora_weights(lora, weight_name=COMFY_FILE, adapter_name="comfyui")
    assert torch.allclose(_generate(pipe), tuned, atol=1e-6)


def test_wan_parts_match_the_pipeline(wan_pipeline_dir, tmp_path):
    """One UniPC step (flow sigmas: from the shifted s0 near 1 to 0; the transformer sees the
    integer timestep t) is x - s0 * predict(x, t / 1000); the static flow_shift; latents are
    what ``__call__`` decodes."""
    from diffusers import WanPipeline

    from workbench.worker.families import Text
    from workbench.worker.pipelines import adapter_for, inspect_pipeline

    adapter = adapter_for(inspect_pipeline(wan_pipeline_dir), tmp_path, torch.float32)
    pipe = WanPipeline.from_pretrained(wan_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    embeds = pipe._get_t5_prompt_embeds(["a photo of the digit one"], max_sequence_length=16)
    x = torch.randn(1, 4, 2, 6, 10, generator=torch.Generator().manual_seed(3))
    out = pipe(
        prompt_embeds=embeds,
        latents=x,
        height=6 * 8,
        width=10 * 8,
        num_frames=5,
        num_inference_steps=1,
        guidance_scale=1.0,
        output_type="latent",
    ).frames
    mask = torch.ones(1, 16)
    s0 = pipe.scheduler.sigmas[0].reshape(1)
    assert 0.99 < float(s0) < 1.0
    with torch.no_grad():
        t = pipe.scheduler.timesteps[0].float().reshape(1) / 1000
        v = adapter.predict(pipe.transformer, x, t, Text(embeds, mask, embeds[:, 0, :0]))
    assert torch.allclose(out, x - s0 * v, atol=1e-5)
    u = torch.tensor([0.2, 0.5, 0.8])
    assert torch.allclose(adapter.shift_sigmas(u, x.shape), 3 * u / (1 + 2 * u))  # flow_shift 3
    clip = torch.rand(1, 3, 5, 16, 24) * 2 - 1
    with torch.no_grad():
        z = adapter.encode_pixels(pipe.vae, clip)  # (1, 4, 2, 2, 3)
        raw = pipe.vae.encode(clip).latent_dist.mean
    cfg = pipe.vae.config
    std = 1.0 / torch.tensor(cfg.latents_std).view(1, 4, 1, 1, 1)  # as __call__ computes it
    mean = torch.tensor(cfg.latents_mean).view(1, 4, 1, 1, 1)
    assert z.shape == (1, 4, 2, 2, 3) and torch.allclose(z / std + mean, raw, atol=1e-5)


def test_wan22_trains_one_expert_in_its_sigma_range(
    wan22_pipeline_dir, wide_clips, tmp_path, monkeypatch, pipe_io
):
    from diffusers import WanPipeline
    from safetensors import safe_open

    from workbench.worker.pipelines import PipelineFolderError, adapter_for, inspect_pipeline
    from workbench.worker.preset import validate_preset

    info = inspect_pipeline(wan22_pipeline_dir)
    assert info.experts == ["high_noise", "low_noise"]
    with pytest.raises(PipelineFolderError, match=r"two experts .* expected high_noise or low"):
        adapter_for(info, tmp_path, torch.float32)
    preset = validate_preset({"model": {"path": "x"}, "timestep_distribution": "uniform"})
    x0 = torch.zeros(64, 4, 2, 4, 4)
    for expert, (lo, hi) in {"high_noise": (0.875, 1.0), "low_noise": (0.0, 0.875)}.items():
        adapter = adapter_for(info, tmp_path, torch.float32, expert=expert)
        assert adapter.transformer_dir.name == ("transformer" if lo else "transformer_2")
        _, sigma, _ = adapter.training_pair(x0, x0, torch.Generator().manual_seed(0), preset)
        assert lo <= float(sigma.min()) and float(sigma.max()) <= hi
        assert float(sigma.max() - sigma.min()) > 0.5 * (hi - lo)  # spread over the range

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cache"))
    path = _preset(pipe_io, tmp_path, wan22_pipeline_dir, wide_clips, name="low", model={
        "path": str(wan22_pipeline_dir), "dtype": "float32", "expert": "low_noise"
    })  # fmt: skip
    assert main([str(path), "--run-dir", str(tmp_path / "low")]) == 0
    pipe_io.assert_resumes(tmp_path / "low")  # the expert, not transformer/, resumes
    lora = tmp_path / "low" / "lora"
    with safe_open(str(lora / "pytorch_lora_weights.safetensors"), "pt") as f:
        assert f.metadata()["stagehand.expert"] == "low_noise"
    pipe = WanPipeline.from_pretrained(wan22_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    base = _generate(pipe)
    pipe.load_lora_weights(lora, load_into_transformer_2=True)
    assert pipe.transformer_2.peft_config and not getattr(pipe.transformer, "peft_config", None)
    assert (_generate(pipe) - base).abs().max() > 1e-4


def test_clip_that_cannot_be_decoded_or_wrong_frames_is_named(
    wan_pipeline_dir, wide_clips, tmp_path, monkeypatch, pipe_io
):
    import shutil

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cache"))
    clips = shutil.copytree(wide_clips, tmp_path / "clips")
    (clips / "02.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    cases = {  # the scan names an undecodable clip (left out unless on_bad_file is fail)
        "bad": (clips, 5, "  02.mp4: unreadable clip (InvalidDataError"),
        "frames": (wide_clips, 4, "data.frames is 4; the Wan VAE compresses 4 frames"),
        "short": (wide_clips, 13, "data.frames: clip '01.mp4' has 9 frames, expected >= 13"),
    }
    for name, (folder, frames, message) in cases.items():
        data = {"path": str(folder), "frames": frames, "max_caption_tokens": 16}
        data["on_bad_file"] = "fail"
        path = _preset(pipe_io, tmp_path, wan_pipeline_dir, folder, name=name, data=data)
        assert main([str(path), "--run-dir", str(tmp_path / name)]) == 1
        last = pipe_io.records(tmp_path / name)[-1]
        assert last["kind"] == "error" and message in last["message"], last["message"]
        assert not (tmp_path / name / "lora").exists()
    assert json.loads((tmp_path / "bad" / "config.json").read_text())["data"]["frames"] == 5


def test_wan_resumes_from_its_checkpoint_with_the_same_adapter_and_losses(wan_run, pipe_io):
    """Wan 2.1 killed after step 3 resumes from its own config.json and step-2 checkpoint."""
    pipe_io.assert_resumes(wan_run[0])
