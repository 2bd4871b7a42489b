"""LTX-2 text-to-video (``LTX2Pipeline``): Gemma 3's stacked hidden states through the
pipeline's text connectors, the video VAE normalised by ``latents_mean`` / ``latents_std`` and
``scaling_factor``, ``_pack_latents`` into the transformer's tokens, the dynamic shift ``mu`` of
the packed video sequence length, and ``__call__`` for samples. Everything is the pipeline's own
code: ``_get_gemma_prompt_embeds`` (left padding, ``<bos>``, every layer's hidden state),
``connectors(...)`` (masked mean/range normalisation, learnable registers),
``_normalize_latents``, ``_pack_latents`` / ``_unpack_latents``, ``calculate_shift``.

Text cache: stage 1 runs Gemma block-swapped and the connectors (resident, ``text_helpers``)
on each batch, and keeps the connectors' outputs, not Gemma's: Gemma's stacked states are
``(T, 3840 x 49)`` per prompt in LTX-2 (385 MB in bf16 at 1024 tokens), the connectors' are
``(T, 3840 + 3840)``. ``hidden`` is the video and audio text side by side (B, T, Dv + Da),
``mask`` the connectors' mask (all ones once the registers fill the padding).

Audio (NOTE [ LTX-2 audio ]): LTX-2 denoises video and audio together and its transformer
takes both streams in every block. A LoRA here is trained on video latents only (clips carry no
audio track through PyAV here, and the loss is the video velocity). The audio stream gets what
``__call__`` starts every generation from: Gaussian audio latents, of the length the pipeline
computes for the clip's duration at ``FRAME_RATE``; since they carry no audio, they are fed as
pure noise at audio sigma 1 (``audio_timestep`` 1000), the only sigma at which pure noise is
a correctly distributed audio input. The noise is fixed (seed 0) so that a step is a function of its
seed. The LoRA targets the video modules only (``attn1``, ``attn2``, ``ff``); the audio branch
and the audio-video cross attention stay as they are.
"""

from __future__ import annotations

import torch

from workbench.worker.pipelines.base import PipelineFamily, load_component
from workbench.worker.pipelines.folder import read_json

PIPELINE_MODULE = "diffusers.pipelines.ltx2.pipeline_ltx2"
FRAME_RATE = 24.0
"""``__call__``'s default ``frame_rate``: the rotary positions of the frames and the audio
length follow it."""
AUDIO_SEED = 0
PLAIN_SAMPLING = {
    "guidance_scale": 1.0,
    "audio_guidance_scale": 1.0,
    "stg_scale": 0.0,
    "audio_stg_scale": 0.0,
    "modality_scale": 1.0,
    "audio_modality_scale": 1.0,
    "guidance_rescale": 0.0,
    "audio_guidance_rescale": 0.0,
    "spatio_temporal_guidance_blocks": None,
}
"""``__call__`` without its guidance terms (its defaults are LTX-2.3's CFG, STG on block 28
and modality guidance): one conditional transformer pass per step, since no negative prompt is
cached, and the same for any block count."""


def _gemma_pass(pipe, texts, device, max_tokens):
    embeds, mask = pipe._get_gemma_prompt_embeds(
        prompt=texts, max_sequence_length=max_tokens, device=device, dtype=pipe.text_encoder.dtype
    )  # (b, T, D x (layers + 1)), (b, T) left-padded
    connectors = pipe.connectors
    video, audio, mask = connectors(
        embeds.to(connectors.dtype), mask, padding_side=pipe.tokenizer.padding_side
    )  # (b, T, Dv), (b, T, Da), (b, T)
    return {"hidden": torch.cat([video, audio], dim=-1), "mask": mask}


class PassThroughConnectors(torch.nn.Module):
    """Stands in for ``pipe.connectors`` in ``__call__`` when the prompt embeddings given are
    the cached connector outputs (B, T, Dv + Da): splits them back into video and audio."""

    def __init__(self, video_dim: int) -> None:
        super().__init__()
        self.video_dim = video_dim
        self.register_buffer("anchor", torch.zeros(0), persistent=False)

    @property
    def device(self) -> torch.device:  # the pipeline asks each component for its device
        return self.anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    def forward(self, embeds, mask, padding_side="left", scale_factor=8):
        return embeds[..., : self.video_dim], embeds[..., self.video_dim :], mask


class LTX2PipelineFamily(PipelineFamily):
    name, model_class, lora_mixin = "ltx2", "LTX2VideoTransformer3DModel", "LTX2LoraLoaderMixin"
    pipeline_class = "LTX2Pipeline"
    shift_module = PIPELINE_MODULE
    shift_defaults = (1024, 4096, 0.95, 2.05)
    """``__call__``'s defaults for ``mu`` (of the packed video length). A scheduler
    ``shift_terminal`` is not applied to training sigmas: it stretches a whole inference
    schedule so that its last sigma lands there, which a single draw has not."""
    video = True
    tokenizers = ("tokenizer",)
    text_passes = (("text_encoder", _gemma_pass),)
    text_helpers = ("connectors",)
    lora_targets = (
        "attn1.to_q",
        "attn1.to_k",
        "attn1.to_v",
        "attn1.to_out.0",
        "attn2.to_q",
        "attn2.to_k",
        "attn2.to_v",
        "attn2.to_out.0",
        "ff.net.0.proj",
        "ff.net.2",
    )
    """The video stream's self attention, text cross attention and feed-forward (PEFT matches
    whole name parts: ``audio_attn1`` and ``audio_ff`` are not matched); see the module doc."""
    comfy_prefix = "diffusion_model"
    """LTX-2's original block module names are diffusers' (its converter only renames modules
    outside these targets), so ComfyUI's copy is the same names under ``diffusion_model.``; it
    has no ``.alpha`` keys, which diffusers' LTX-2 loader would refuse (no ``lora`` in them)."""

    use_cross_timestep = True
    """``__call__``'s default: cross-modal modulation uses the other stream's sigma."""

    def __init__(self) -> None:
        super().__init__()
        self._temporal: int | None = None

    # -- components ---------------------------------------------------------------------------
    def _configs(self):
        root = self.root
        return (
            read_json(self.transformer_dir / "config.json", "the transformer's config"),
            read_json(root / "text_encoder" / "config.json", "the text encoder's config"),
            read_json(root / "connectors" / "config.json", "the connectors' config"),
            read_json(root / "vae" / "config.json", "the VAE's config"),
            read_json(root / "audio_vae" / "config.json", "the audio VAE's config"),
        )

    def check_components(self) -> None:
        """The transformer's text, video and audio inputs must be what the connectors, the VAE
        and the audio VAE give; the connectors' input what Gemma gives."""
        tcfg, enc, conn, vae, audio = self._configs()
        text = enc.get("text_config", enc)
        problems = []
        width = conn.get("caption_channels")
        if width != text.get("hidden_size"):
            problems.append(
                f"connectors/config.json caption_channels is {width} but text_encoder/"
                f"config.json hidden_size is {text.get('hidden_size')}"
            )
        layers = conn.get("text_proj_in_factor")
        if layers != (text.get("num_hidden_layers") or 0) + 1:
            problems.append(
                f"connectors/config.json text_proj_in_factor is {layers}; expected the text "
                f"encoder's num_hidden_layers + 1 ({text.get('num_hidden_layers')} + 1)"
            )
        video, audio_dim = _connector_dims(conn)
        want = _text_dims(tcfg)
        if (video, audio_dim) != want:
            problems.append(
                f"its text inputs are {want[0]} (video) and {want[1]} (audio) wide but the "
                f"connectors give {video} and {audio_dim}"
            )
        patch = (tcfg.get("patch_size") or 1) ** 2 * (tcfg.get("patch_size_t") or 1)
        if tcfg.get("in_channels") != patch * (vae.get("latent_channels") or 0):
            problems.append(
                f"in_channels is {tcfg.get('in_channels')}; expected vae latent_channels "
                f"({vae.get('latent_channels')}) x {patch} for its patches"
            )
        mel = audio.get("mel_bins") or 0
        packed = (audio.get("latent_channels") or 0) * (mel // 4)  # the audio VAE's 4x mel
        if tcfg.get("audio_in_channels") != packed:
            problems.append(
                f"audio_in_channels is {tcfg.get('audio_in_channels')}; expected audio_vae "
                f"latent_channels x mel_bins / 4 ({packed})"
            )
        self.check_fit(problems)

    def _vae_meta(self):
        from diffusers import AutoencoderKLLTX2Video

        cfg = read_json(self.root / "vae" / "config.json", "the VAE's config")
        with torch.device("meta"):
            return AutoencoderKLLTX2Video.from_config(cfg)

    def temporal_ratio(self) -> int:
        """Pixel frames per latent frame after the first (the VAE's, 8 in LTX-2)."""
        if self._temporal is None:
            self._temporal = int(self._vae_meta().temporal_compression_ratio)
        return self._temporal

    def check_frames(self, frames):
        temporal = self.temporal_ratio()
        if frames is None or frames % temporal != 1 % temporal:
            raise ValueError(
                f"data.frames is {frames}; the LTX-2 VAE compresses {temporal} frames into one "
                f"after the first, so expected {temporal}k + 1 frames (1, {temporal + 1}, "
                f"{2 * temporal + 1}, ...)"
            )

    def check_caption_tokens(self, tokens):
        conn = read_json(self.root / "connectors" / "config.json", "the connectors' config")
        registers = {
            conn.get(f"{stream}_connector_num_learnable_registers", 128)
            for stream in ("video", "audio")
        } - {None}
        for n in registers:
            if tokens % n:
                raise ValueError(
                    f"data.max_caption_tokens is {tokens}; LTX-2's text connectors "
                    f"({self.root / 'connectors' / 'config.json'}) replace padding with {n} "
                    f"learnable registers, so expected a multiple of {n} (the pipeline's "
                    "default is 1024)"
                )

    def check_latents(self, shape):
        if len(shape) != 4:
            raise ValueError(f"ltx2 trains on clips: latents (C, F, h, w) expected, got {shape}")

    def encode_pixels(self, vae, pixels):
        """(n, 3, F, H, W) -> ``_normalize_latents`` of the latent mean (n, C, F', h, w), which
        ``__call__`` inverts with ``_denormalize_latents`` before decoding."""
        z = vae.encode(pixels).latent_dist.mean
        norm = self.pipeline_cls()._normalize_latents
        return norm(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)

    # -- training ---------------------------------------------------------------------------
    def text_dim(self, model):
        return sum(_text_dims(model.config))

    def image_seq_len(self, latent_shape):
        cfg = read_json(self.transformer_dir / "config.json", "the transformer's config")
        f, h, w = latent_shape[-3:]
        p, pt = cfg.get("patch_size") or 1, cfg.get("patch_size_t") or 1
        return (f // pt) * (h // p) * (w // p)

    def audio_noise(self, model, batch, num_frames, device, dtype) -> tuple[torch.Tensor, int]:
        """``(noise, L)``: (B, L, audio_in_channels) packed audio latents of pure noise for a
        clip of ``num_frames`` pixel frames (NOTE [ LTX-2 audio ]), ``L`` as ``__call__``
        computes it."""
        cfg = model.config
        per_second = cfg.audio_sampling_rate / cfg.audio_hop_length / cfg.audio_scale_factor
        length = max(round(num_frames / FRAME_RATE * per_second), 1)
        g = torch.Generator().manual_seed(AUDIO_SEED)
        noise = torch.randn(1, length, cfg.audio_in_channels, generator=g)
        return noise.expand(batch, -1, -1).to(device, dtype), length

    def predict(self, model, x_t, sigma, text):
        f, h, w = x_t.shape[2:]
        kwargs = self.transformer_kwargs(model, x_t, sigma, text, self.temporal_ratio())
        out, _ = model(**kwargs)
        cfg = model.config
        return self.pipeline_cls()._unpack_latents(out, f, h, w, cfg.patch_size, cfg.patch_size_t)

    def transformer_kwargs(self, model, x_t, sigma, text, temporal: int) -> dict:
        """The transformer's keyword arguments for latents ``x_t`` (B, C, F, H, W) at ``sigma``
        (B,) with ``text`` (``hidden`` (B, T, Dv + Da), ``mask`` (B, T)), the VAE compressing
        ``temporal`` frames into one after the first: what ``predict`` calls the transformer
        with, and what the planner (``workbench.plan.reference``) measures on ``meta``."""
        pipe = self.pipeline_cls()
        cfg = model.config
        b, c, f, h, w = x_t.shape
        audio, audio_frames = self.audio_noise(
            model, b, (f - 1) * temporal + 1, x_t.device, x_t.dtype
        )
        video_dim = _text_dims(cfg)[0]
        t = sigma * 1000  # the scheduler's timestep, as __call__ passes it
        audio_t = torch.full_like(t, 1000.0)  # noise: audio sigma 1
        return dict(
            hidden_states=pipe._pack_latents(x_t, cfg.patch_size, cfg.patch_size_t),  # (B, N, C)
            audio_hidden_states=audio,  # (B, L, Ca)
            encoder_hidden_states=text.hidden[..., :video_dim],  # (B, T, Dv)
            audio_encoder_hidden_states=text.hidden[..., video_dim:],  # (B, T, Da)
            timestep=t,
            sigma=t,
            audio_timestep=audio_t,
            audio_sigma=audio_t,
            encoder_attention_mask=text.mask,
            audio_encoder_attention_mask=text.mask,
            num_frames=f,
            height=h,
            width=w,
            fps=FRAME_RATE,
            audio_num_frames=audio_frames,
            use_cross_timestep=self.use_cross_timestep,
            return_dict=False,
        )

    # -- outputs ----------------------------------------------------------------------------
    def sample(self, model, text, spec):
        """First frames (PIL) of clips from ``__call__``, with the cached connector outputs
        fed through ``PassThroughConnectors`` (``__call__`` runs the connectors itself)."""
        parts = {
            name: load_component(self.root, name, torch.float32).to(spec.device)
            for name in ("vae", "audio_vae", "vocoder")
        }
        connectors = PassThroughConnectors(_text_dims(model.config)[0])
        pipe = self.pipeline(transformer=model, connectors=connectors, **parts)
        pipe.set_progress_bar_config(disable=True)
        c, f, h, w = spec.latent_shape
        frames = pipe(
            prompt_embeds=text.hidden,
            prompt_attention_mask=text.mask,
            height=h * pipe.vae_spatial_compression_ratio,
            width=w * pipe.vae_spatial_compression_ratio,
            num_frames=(f - 1) * pipe.vae_temporal_compression_ratio + 1,
            frame_rate=FRAME_RATE,
            num_inference_steps=spec.steps,
            use_cross_timestep=self.use_cross_timestep,
            generator=torch.Generator().manual_seed(spec.seed),
            output_type="pil",
            **PLAIN_SAMPLING,
        ).frames
        return [clip[0] for clip in frames]


def _text_dims(cfg) -> tuple[int, int]:
    """(video, audio) text widths the transformer takes: ``caption_channels`` into its caption
    projections (LTX-2.0), or the cross-attention widths when the connectors project
    (LTX-2.3, ``use_prompt_embeddings`` false)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    if get("use_prompt_embeddings", True):
        return get("caption_channels"), get("caption_channels")
    return get("cross_attention_dim"), get("audio_cross_attention_dim")


def _connector_dims(conn: dict) -> tuple[int, int]:
    """(video, audio) widths of the connectors' outputs (their attention width)."""
    video = conn.get("video_connector_num_attention_heads", 30) * conn.get(
        "video_connector_attention_head_dim", 128
    )
    audio = conn.get("audio_connector_num_attention_heads", 30) * conn.get(
        "audio_connector_attention_head_dim", 128
    )
    return video, audio
