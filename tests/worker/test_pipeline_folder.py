"""Pipeline folders: inspection (family, components, streamed blocks), the Flux adapter against
the pipeline's own numbers, and every bad input named (file, field, what was expected)."""

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from workbench.contract.preset import MODEL_TYPES
from workbench.worker.pipelines import (
    PipelineFolderError,
    adapter_for,
    inspect_pipeline,
    inspect_preset,
)
from workbench.worker.pipelines.folder import safetensors_header, tensors_of, weight_files
from workbench.worker.preset import validate_preset


@pytest.fixture
def flux_copy(flux_pipeline_dir, tmp_path):
    """A writable copy of the tiny Flux pipeline folder."""
    return shutil.copytree(flux_pipeline_dir, tmp_path / "flux")


def test_inspection_names_components_and_streamed_blocks(flux_pipeline_dir):
    info = inspect_pipeline(flux_pipeline_dir)
    assert info.family == "flux" and info.pipeline_class == "FluxPipeline"
    assert info.experts == []  # one transformer: no model.expert
    classes = {c.name: c.class_name for c in info.components}
    assert classes == {
        "scheduler": "FlowMatchEulerDiscreteScheduler",
        "text_encoder": "CLIPTextModel",
        "text_encoder_2": "T5EncoderModel",
        "tokenizer": "CLIPTokenizer",
        "tokenizer_2": "T5Tokenizer",
        "transformer": "FluxTransformer2DModel",
        "vae": "AutoencoderKL",
    }
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(flux_pipeline_dir / "transformer")
    transformer = info.component("transformer")
    assert transformer.parameters == sum(p.numel() for p in model.parameters())
    assert transformer.dtype == "float32"
    # 3 double + 5 single blocks, each sized as its tensors in the checkpoint's shards.
    names = [b.name for b in info.blocks]
    assert names == [f"transformer_blocks.{i}" for i in range(3)] + [
        f"single_transformer_blocks.{i}" for i in range(5)
    ]
    header = tensors_of(weight_files(flux_pipeline_dir / "transformer"))
    for block in info.blocks:
        numel = [
            torch.Size(v["shape"]).numel()
            for k, v in header.items()
            if k.startswith(block.name + ".")
        ]
        assert block.nbytes == 4 * sum(numel) > 0
    assert info.as_dict()["largest_block_bytes"] == max(b.nbytes for b in info.blocks)


def test_folder_without_model_index_is_named(flux_copy):
    (flux_copy / "model_index.json").unlink()
    with pytest.raises(PipelineFolderError, match=r"model_index.json: not found; expected a"):
        inspect_pipeline(flux_copy)


def test_model_type_that_disagrees_names_both(flux_pipeline_dir):
    with pytest.raises(PipelineFolderError, match=r"model_type is 'qwenimage'.*'flux' pipeline"):
        inspect_pipeline(flux_pipeline_dir, model_type="qwenimage", aliases=MODEL_TYPES)
    # An alias of the folder's family agrees; an unset model_type is not compared.
    assert inspect_pipeline(flux_pipeline_dir, model_type="flux_dev", aliases=MODEL_TYPES)
    preset = validate_preset({"model": {"path": str(flux_pipeline_dir)}})
    assert inspect_preset(preset).family == "flux"


def test_missing_and_extra_components_are_named(flux_copy):
    shutil.rmtree(flux_copy / "text_encoder_2")
    with pytest.raises(PipelineFolderError, match=r"required component\(s\) \['text_encoder_2'\]"):
        inspect_pipeline(flux_copy)
    shutil.copytree(flux_copy / "text_encoder", flux_copy / "text_encoder_2")
    index = json.loads((flux_copy / "model_index.json").read_text())
    index["text_encoder_3"] = ["transformers", "T5EncoderModel"]
    (flux_copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(PipelineFolderError, match=r"\['text_encoder_3'\] are not taken by Flux"):
        inspect_pipeline(flux_copy)


def test_shard_missing_from_an_interrupted_download_is_named(flux_copy, flux_pipeline_dir):
    """Before, the inspection read the shards present, and the run failed with diffusers'
    FileNotFoundError when the transformer loaded, after the whole of stage 1."""
    for part in ("transformer", "vae"):
        shards = sorted((flux_copy / part).glob("*.safetensors"))
        assert len(shards) > 1  # the fixture is sharded as a downloaded folder is
        shards[1].unlink()
        index = next((flux_copy / part).glob("*.safetensors.index.json"))
        with pytest.raises(PipelineFolderError) as err:
            inspect_pipeline(flux_copy)
        assert str(err.value) == (
            f"{index}: shard(s) {[shards[1].name]} missing; expected every shard its "
            "weight_map names (download the folder again)"
        )
        shutil.copytree(flux_pipeline_dir / part, flux_copy / part, dirs_exist_ok=True)
    assert inspect_pipeline(flux_copy).family == "flux"


def test_unknown_pipeline_class_is_named(flux_copy):
    index = json.loads((flux_copy / "model_index.json").read_text())
    (flux_copy / "model_index.json").write_text(json.dumps({**index, "_class_name": "Nope"}))
    with pytest.raises(PipelineFolderError, match=r"_class_name is 'Nope'; expected one of"):
        inspect_pipeline(flux_copy)


def test_transformer_that_does_not_fit_the_family_is_named(flux_copy, tmp_path):
    config = json.loads((flux_copy / "transformer" / "config.json").read_text())
    config["joint_attention_dim"] = 32
    (flux_copy / "transformer" / "config.json").write_text(json.dumps(config))
    info = inspect_pipeline(flux_copy)
    with pytest.raises(
        PipelineFolderError,
        match=r"transformer/config.json: does not fit the flux pipeline: joint_attention_dim is "
        r"32 but text_encoder_2/config.json d_model is 24",
    ):
        adapter_for(info, tmp_path, torch.float32)


def test_single_file_transformer_loads_and_bad_keys_are_listed(flux_pipeline_dir, tmp_path):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(flux_pipeline_dir / "transformer")
    good = tmp_path / "flux-transformer.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(good))
    info = inspect_pipeline(flux_pipeline_dir, transformer_path=str(good))
    assert info.component("transformer").parameters == sum(p.numel() for p in model.parameters())
    adapter = adapter_for(info, tmp_path / "cache", torch.float32)
    assert adapter.transformer_dir.parent == tmp_path / "cache"
    converted = FluxTransformer2DModel.from_pretrained(adapter.transformer_dir)
    ours = converted.state_dict()
    assert sorted(ours) == sorted(model.state_dict())
    for name, a in model.state_dict().items():
        assert torch.equal(a, ours[name]), name
    assert len(weight_files(adapter.transformer_dir)) >= 1

    bad = tmp_path / "bad.safetensors"
    save_file({"foo.weight": torch.zeros(2), "bar.bias": torch.zeros(3)}, str(bad))
    info = inspect_pipeline(flux_pipeline_dir, transformer_path=str(bad))
    with pytest.raises(PipelineFolderError, match=r"its keys start \['bar.bias', 'foo.weight'\]"):
        adapter_for(info, tmp_path / "cache", torch.float32)
    with pytest.raises(PipelineFolderError, match=r"model.transformer_path: .* not a .safetensors"):
        inspect_pipeline(flux_pipeline_dir, transformer_path=str(tmp_path / "missing.ckpt"))
    assert safetensors_header(bad) == {
        "bar.bias": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
        "foo.weight": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
    }
    # A ComfyUI scaled fp8 file without SquareQ: its codes read without their scale would be
    # wrong weights (with SquareQ: test_single_file_fp8.py).
    scaled = tmp_path / "flux-fp8-scaled.safetensors"
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    key = "transformer_blocks.0.attn.to_q.weight"
    weights[key] = weights[key].to(torch.float8_e4m3fn)
    weights["transformer_blocks.0.attn.to_q.scale_weight"] = torch.ones(1)
    save_file(weights, str(scaled))
    info = inspect_pipeline(flux_pipeline_dir, transformer_path=str(scaled))
    with pytest.raises(
        PipelineFolderError,
        match=rf"'{key}' in flux-fp8-scaled.safetensors is torch.float8_e4m3fn \(\d+, \d+\) "
        r"with scale 'transformer_blocks.0.attn.to_q.scale_weight' of shape \(1,\): .* only "
        r"with memory.stagehand.squareq",
    ):
        adapter_for(info, tmp_path / "cache", torch.float32)


def _bound(flux_pipeline_dir, tmp_path):
    return adapter_for(inspect_pipeline(flux_pipeline_dir), tmp_path, torch.float32)


def test_training_sigmas_are_shifted_as_the_scheduler_shifts(flux_pipeline_dir, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    adapter = _bound(flux_pipeline_dir, tmp_path)
    u = torch.tensor([0.9, 0.6, 0.3, 0.1])
    shape = (2, 4, 16, 32)  # 8 x 16 = 128 packed tokens
    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(flux_pipeline_dir / "scheduler")
    sched.set_timesteps(sigmas=u.tolist(), mu=adapter.mu(128))
    assert torch.allclose(adapter.shift_sigmas(u, shape), sched.sigmas[:-1], atol=1e-6)
    assert adapter.mu(128) == pytest.approx(0.5 + (1.15 - 0.5) * (128 - 16) / (256 - 16))
    assert (adapter.shift_sigmas(u, shape) > u).all()  # mu > 0 shifts towards noise
    static = FlowMatchEulerDiscreteScheduler(shift=3.0)
    adapter._scheduler = static
    static_ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
    static_ref.set_timesteps(sigmas=u.tolist())
    assert torch.allclose(adapter.shift_sigmas(u, shape), static_ref.sigmas[:-1], atol=1e-6)


def test_predict_is_one_euler_step_of_the_pipeline(flux_pipeline_dir, tmp_path):
    """One-step ``__call__`` (sigma 1 -> 0) equals x - predict(x, 1): packing, position ids,
    guidance and timestep scaling are the pipeline's."""
    from diffusers import FluxPipeline

    from workbench.worker.families import Text

    adapter = _bound(flux_pipeline_dir, tmp_path)
    pipe = FluxPipeline.from_pretrained(flux_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    embeds, pooled, _ = pipe.encode_prompt("a photo of the digit one", max_sequence_length=16)
    x = torch.randn(1, 4, 6, 10, generator=torch.Generator().manual_seed(3))  # (B, C, h, w)
    out = pipe(
        prompt_embeds=embeds,
        pooled_prompt_embeds=pooled,
        latents=pipe._pack_latents(x, 1, 4, 6, 10),
        height=6 * pipe.vae_scale_factor,
        width=10 * pipe.vae_scale_factor,
        num_inference_steps=1,
        guidance_scale=adapter.guidance,
        output_type="latent",
    ).images
    text = Text(hidden=embeds, mask=torch.ones(1, embeds.shape[1]), pooled=pooled)
    with torch.no_grad():
        v = adapter.predict(pipe.transformer, x, torch.ones(1), text)
    expected = pipe._pack_latents(x - v, 1, 4, 6, 10)
    assert torch.allclose(out, expected, atol=1e-5)
    assert (v.abs() > 0).any()


def test_tokenizer_that_does_not_load_is_named(flux_copy, tmp_path):
    (flux_copy / "tokenizer_2" / "tokenizer.json").write_text("{not json")
    info = inspect_pipeline(flux_copy)
    with pytest.raises(PipelineFolderError, match=r"tokenizer_2: T5Tokenizer.from_pretrained fail"):
        adapter_for(info, tmp_path, torch.float32)


def test_tokenizer_larger_than_its_encoder_is_named(flux_copy, tmp_path):
    config = json.loads((flux_copy / "text_encoder" / "config.json").read_text())
    config["vocab_size"] = 10
    (flux_copy / "text_encoder" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        PipelineFolderError, match=r"token ids but text_encoder/config.json vocab_s"
    ):
        adapter_for(inspect_pipeline(flux_copy), tmp_path, torch.float32)


def test_bad_input_through_workbench_train_is_the_error_record(
    flux_copy, wide_images, tmp_path, monkeypatch, pipe_io
):
    """The error reaches the run's last record, before anything is cached or trained."""
    from workbench.worker.assets import ENV_VAR
    from workbench.worker.cli import main

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cache"))
    cases = {
        "float16": ({"model": {"dtype": "float16"}}, "float16 on the CPU is not supported"),
        "mismatch": ({"model_type": "wan"}, "model_type is 'wan' but model.path"),
    }
    for name, (over, message) in cases.items():
        preset = pipe_io.preset(tmp_path, flux_copy, wide_images, name=name, **over)
        run_dir = tmp_path / name
        assert main([str(preset), "--run-dir", str(run_dir)]) == 1
        last = pipe_io.records(run_dir)[-1]
        assert last["kind"] == "error" and message in last["message"], last["message"]
        assert not (run_dir / "lora").exists() and not (run_dir / "samples").exists()
    (flux_copy / "model_index.json").unlink()
    preset = pipe_io.preset(tmp_path, flux_copy, wide_images, name="no-index")
    assert main([str(preset), "--run-dir", str(tmp_path / "no-index")]) == 1
    last = pipe_io.records(tmp_path / "no-index")[-1]
    assert last["error_type"] == "PipelineFolderError"
    assert f"{flux_copy / 'model_index.json'}: not found" in last["message"]
    assert not (tmp_path / "cache").exists()  # nothing half-written


def huge_header(folder):
    """The transformer's first shard with a header length field of 2^62 (a corrupt file: read
    as is, a ``MemoryError`` with an empty message). Returns the shard."""
    shard = weight_files(folder / "transformer")[0]
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 2**62)
    shard.write_bytes(bytes(data))
    return shard


def test_a_header_length_past_the_file_is_named(flux_copy):
    shard = huge_header(flux_copy)
    with pytest.raises(PipelineFolderError) as info:
        inspect_pipeline(flux_copy)
    assert str(info.value).startswith(
        f"{shard}: header length 4611686018427387904 bytes, but the file holds "
    )


def test_a_header_length_past_the_file_is_the_runs_error_record(
    flux_copy, wide_images, tmp_path, monkeypatch, pipe_io
):
    from workbench.worker.assets import ENV_VAR
    from workbench.worker.cli import main

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cache"))
    shard = huge_header(flux_copy)
    preset = pipe_io.preset(tmp_path, flux_copy, wide_images, name="huge-header")
    assert main([str(preset), "--run-dir", str(tmp_path / "run")]) == 1
    last = pipe_io.records(tmp_path / "run")[-1]
    assert last["kind"] == "error" and last["error_type"] == "PipelineFolderError"
    assert last["message"].startswith(f"{shard}: header length 4611686018427387904 bytes")


def test_resolution_the_latent_patches_do_not_divide_is_named(
    flux_pipeline_dir, wide_images, tmp_path, monkeypatch, pipe_io
):
    """The error was only "flux packs 2x2 latent patches: latent h, w (25, 25) must be even",
    after the text encoders ran."""
    from workbench.worker.assets import ENV_VAR
    from workbench.worker.cli import main

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cache"))
    data = {"path": str(wide_images), "bucketing": False}
    preset = pipe_io.preset(tmp_path, flux_pipeline_dir, wide_images, resolution=100, data=data)
    assert main([str(preset), "--run-dir", str(tmp_path / "run")]) == 1
    last = pipe_io.records(tmp_path / "run")[-1]
    assert last["kind"] == "error" and last["message"] == (
        "resolution: 100 px gives latents of 25 x 25 (the VAE downscales 4x), and flux packs "
        "2x2 latent patches: latent h, w (25, 25) must be even; expected a multiple of 8 px, "
        "or data.bucketing"
    )
    assert not (tmp_path / "run" / "lora").exists()
    # Named before the text encoders ran (stage 1 encodes the latents first).
    stages = [r for r in pipe_io.records(tmp_path / "run") if r["kind"] == "stage"]
    assert [(r["done"], r["message"]) for r in stages] == [
        (0, "6 samples, 7 distinct texts"),
        (6, "encoding images"),
    ]


def test_single_file_transformer_trains_streamed_from_its_converted_copy(
    flux_pipeline_dir, wide_images, tmp_path, monkeypatch, pipe_io
):
    """``model.transformer_path``: the file's weights are the ones trained (a changed weight
    changes the first loss), streamed from the copy converted into the cache."""
    from diffusers import FluxTransformer2DModel

    from workbench.worker.assets import ENV_VAR
    from workbench.worker.cli import main

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cache"))
    model = FluxTransformer2DModel.from_pretrained(flux_pipeline_dir / "transformer")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    single = tmp_path / "flux1-tiny.safetensors"
    save_file(state, str(single))
    state["proj_out.weight"] = state["proj_out.weight"] * 2
    changed = tmp_path / "flux1-tiny-changed.safetensors"
    save_file(state, str(changed))
    first = {}
    for name, path in (("folder", None), ("single", single), ("changed", changed)):
        model_section = {"path": str(flux_pipeline_dir), "dtype": "float32"}
        if path is not None:
            model_section["transformer_path"] = str(path)
        preset = pipe_io.preset(
            tmp_path, flux_pipeline_dir, wide_images, name=name, model=model_section,
            max_steps=1, validation_every=None, samples={"prompts": []},
        )  # fmt: skip
        assert main([str(preset), "--run-dir", str(tmp_path / name)]) == 0
        recs = pipe_io.records(tmp_path / name)
        first[name] = pipe_io.of(recs, "trainer", "step")[0]["loss"]
        started = pipe_io.of(recs, "trainer", "run_started")[0]
        if path is not None:
            assert started["model"].startswith(str(tmp_path / "cache" / "trainer-cache"))
            train = [r for r in pipe_io.of(recs, "stagehand", "step") if r["step"] == 1]
            assert train and all(r["file_reads"] > 0 for r in train)
    assert first["single"] == first["folder"] and first["changed"] != first["folder"]


@pytest.mark.parametrize(
    ("fixture", "field", "value", "message"),
    [
        ("wan_pipeline_dir", "text_dim", 32, r"text_dim is 32 but text_encoder/config.json d_mod"),
        ("zimage_pipeline_dir", "cap_feat_dim", 32, r"cap_feat_dim is 32 but text_encoder/conf"),
        ("zimage_pipeline_dir", "in_channels", 8, r"in_channels is 8; expected vae latent_chan"),
    ],
)
def test_video_and_zimage_transformers_that_do_not_fit_are_named(
    request, fixture, field, value, message, tmp_path
):
    folder = shutil.copytree(request.getfixturevalue(fixture), tmp_path / "copy")
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(PipelineFolderError, match=message):
        adapter_for(inspect_pipeline(folder), tmp_path, torch.float32)
