"""The adapter a real pipeline family implements, on top of the trainer's ``Family``.

A ``PipelineFamily`` trains the transformer of a diffusers pipeline folder with the pipeline's
own code: its prompt encoding (one text encoder at a time, block-swapped in inference mode under
the weight runtime: ``encode.py``), its latent normalisation, its scheduler's timestep shift,
and its ``__call__`` for samples. Subclasses (one per family, ``flux.py``...) say which
components encode text and how the transformer is called.

Timestep shift (rectified flow, as the pipelines sample it; diffusers'
``FlowMatchEulerDiscreteScheduler``): a sigma ``u`` drawn from the preset's distribution is
shifted the way the scheduler shifts its inference sigmas::

    static:   s = shift * u / (1 + (shift - 1) * u)              scheduler.config.shift
    dynamic:  s = scheduler.time_shift(mu, 1.0, u)                use_dynamic_shifting, mu from
                                                                  the pipeline's calculate_shift
                                                                  of the image sequence length
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stagehand.strategy import build_strategy
from workbench.worker.diffusers_classes import diffusers_class
from workbench.worker.families import Family, SampleSpec, Text, flow_pair, sample_sigmas
from workbench.worker.pipelines.encode import encode_texts
from workbench.worker.pipelines.folder import (
    PipelineFolderError,
    PipelineInfo,
    load_component,
    read_json,
)
from workbench.worker.records import report_pipeline

TextPass = Callable[[Any, list[str], torch.device, int], dict[str, torch.Tensor]]
"""``(pipeline, texts, device, max_tokens) -> {hidden|mask|pooled: tensor}`` for one encoder."""


class PipelineFamily(Family):
    """A family trained from a pipeline folder; ``bind`` attaches the folder."""

    pipeline_class = ""
    text_passes: tuple[tuple[str, TextPass], ...] = ()
    """``(text encoder component, pass)`` in the order they run, one encoder resident at a time."""
    tokenizers: tuple[str, ...] = ()
    text_helpers: tuple[str, ...] = ()
    """Components a text pass needs besides its encoder (LTX-2's ``connectors``), loaded on the
    device for stage 1 and released with it."""
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    """LoRA targets when the preset names none: what the family's community trainers target
    (diffusers' ``train_dreambooth_lora_<family>.py``)."""
    comfy_prefix: str | None = None
    """Key prefix of the ComfyUI-layout copy (``diffusion_model``) when the family's diffusers
    module names are the original ones (so ComfyUI and diffusers' converter both read it)."""

    comfy_renames: tuple[tuple[str, str], ...] = ()
    """``(diffusers name part, original name part)`` for the ComfyUI copy's module names."""

    def __init__(self) -> None:
        self.info: PipelineInfo | None = None
        self.root: Path | None = None
        self.transformer_dir: Path | None = None
        self.expert: str | None = None
        self._scheduler = None

    @property
    def clips(self) -> bool:
        """A video pipeline's 3D VAE encodes whole clips."""
        return self.video

    def own_folders(self, preset):
        vae = Path(preset.model.vae_path) if preset.model.vae_path else self.root / "vae"
        return self.transformer_dir, vae

    def report(self, telemetry, progress) -> None:

        report_pipeline(self.info, telemetry, progress)

    def bind(
        self, info: PipelineInfo, transformer_dir: Path, expert: str | None = None
    ) -> PipelineFamily:
        """A copy of this adapter for the folder ``info`` describes."""
        bound = type(self)()
        bound.info, bound.root, bound.transformer_dir = info, Path(info.path), transformer_dir
        bound.expert = expert
        return bound

    def expert_component(self, info: PipelineInfo, expert: str | None) -> str:
        """The transformer component a run trains; ``model.expert`` only where there are two.

        Raises:
            PipelineFolderError: ``expert`` given for a pipeline with one transformer.
        """
        if expert is not None:
            raise PipelineFolderError(
                f"model.expert is {expert!r} but {info.pipeline_class} in {info.path} has one "
                "transformer; leave model.expert out"
            )
        return "transformer"

    # -- loading ----------------------------------------------------------------------------
    def pipeline_cls(self) -> type:
        """The diffusers pipeline class (its static ``_pack_latents``... are used as they are)."""
        return diffusers_class(self.pipeline_class)

    def pipeline(self, **components: Any):
        """The pipeline class built from ``components``; every other component is None
        (tokenizers and the scheduler are loaded from the folder when not given)."""
        cls = self.pipeline_cls()
        expected, _ = cls._get_signature_keys(cls)
        parts = dict.fromkeys(expected)
        for name in (*self.tokenizers, "scheduler"):
            parts[name] = components.get(name) or load_component(self.root, name)
        parts.update(components)
        return cls(**parts)

    def scheduler(self):
        if self._scheduler is None:
            self._scheduler = load_component(self.root, "scheduler")
        return self._scheduler

    def check_components(self) -> None:
        """Raise ``PipelineFolderError`` when the components' configs do not fit each other."""

    def check_fit(self, problems: list[str]) -> None:
        """Raise ``PipelineFolderError`` naming ``transformer/config.json`` and every one of
        ``problems`` (what ``check_components`` found), if there are any."""
        if problems:
            raise PipelineFolderError(
                f"{self.transformer_dir / 'config.json'}: does not fit the {self.name} pipeline: "
                + "; ".join(problems)
            )

    def join_text(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The cached ``{hidden, mask, pooled}`` from every text pass's outputs (each (U, ...)),
        for families whose ``encode_prompt`` combines several encoders' sequences (SD3,
        SDXL); by default the passes' outputs are the cache's keys already."""
        return parts

    def check_tokenizers(self) -> None:
        """Load every tokenizer and check that its ids fit its text encoder's embedding
        (``tokenizer_2`` feeds ``text_encoder_2``).

        Raises:
            PipelineFolderError: a tokenizer does not load, or has more ids than
                ``text_encoder*/config.json`` ``vocab_size``.
        """
        for name in self.tokenizers:
            tokenizer = load_component(self.root, name)
            encoder = "text_encoder" + name[len("tokenizer") :]
            config = read_json(self.root / encoder / "config.json", f"the {encoder}'s config")
            config = config.get("text_config", config)  # multimodal encoders nest it
            vocab = config.get("vocab_size")
            if vocab is not None and len(tokenizer) > int(vocab):
                raise PipelineFolderError(
                    f"{self.root / name}: {len(tokenizer)} token ids but "
                    f"{encoder}/config.json vocab_size is {vocab}; expected the encoder's own "
                    "tokenizer"
                )

    def load_vae(self, vae_path: Path):
        """The VAE in fp32 on the CPU, with slicing and tiling on where it offers them."""
        vae = load_component(self.root, "vae", torch.float32, folder=vae_path).eval()
        for switch in ("enable_slicing", "enable_tiling"):
            if hasattr(vae, switch):
                getattr(vae, switch)()
        return vae

    def latent_key(self, frames: int | None) -> dict[str, Any]:
        return {"family": self.name, "frames": frames}

    def encode_texts(self, texts, encoder_dir, **kwargs):
        """Every text pass's encoder in turn (``pipelines.encode.encode_texts``); the folder's
        components are the encoders (``encoder_dir`` is None)."""

        return encode_texts(self, texts, **kwargs)

    # -- training ---------------------------------------------------------------------------
    def image_seq_len(self, latent_shape: tuple[int, ...]) -> int:
        """Tokens the transformer sees for latents of ``latent_shape`` (B, C, [F,] h, w)."""
        raise NotImplementedError

    shift_module = ""
    """The pipeline module whose ``calculate_shift`` the pipeline calls for ``mu``."""
    shift_defaults = (256, 4096, 0.5, 1.15)
    """``(base_image_seq_len, max_image_seq_len, base_shift, max_shift)`` where the scheduler's
    config has none: the pipeline's own defaults."""

    def mu(self, image_seq_len: int) -> float:
        """The dynamic-shift ``mu`` the pipeline computes for ``image_seq_len`` tokens: its
        ``calculate_shift`` (the same function, copied in each pipeline module) of the
        scheduler's config."""
        if not self.shift_module:
            raise NotImplementedError(f"{self.name}: no dynamic shift")
        calculate_shift = importlib.import_module(self.shift_module).calculate_shift
        cfg = self.scheduler().config
        keys = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
        return calculate_shift(
            image_seq_len, *(cfg.get(k, d) for k, d in zip(keys, self.shift_defaults, strict=True))
        )

    text_dim_field = "joint_attention_dim"
    """The transformer config field of the text hidden size it takes."""

    def text_dim(self, model):
        return getattr(model.config, self.text_dim_field)

    def shift_sigmas(self, u: torch.Tensor, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """(B,) sigmas ``u`` in (0, 1) shifted as the scheduler shifts (module doc; UniPC
        calls the static shift ``flow_shift``)."""
        sched = self.scheduler()
        if sched.config.get("use_dynamic_shifting", False):
            mu = self.mu(self.image_seq_len(latent_shape))
            return sched.time_shift(mu, 1.0, u)
        shift = float(sched.config.get("flow_shift") or sched.config.get("shift") or 1.0)
        return shift * u / (1 + (shift - 1) * u)

    def sigma_range(self) -> tuple[float, float]:
        """The sigmas this run trains on (an expert's share of [0, 1])."""
        return 0.0, 1.0

    def validation_sigmas(self, fixed: tuple[float, ...]) -> tuple[float, ...]:
        """The fixed validation sigmas mapped into ``sigma_range``."""
        lo, hi = self.sigma_range()
        return tuple(lo + (hi - lo) * s for s in fixed)

    def training_pair(self, x0, noise, generator, preset):
        u = sample_sigmas(
            x0.shape[0],
            preset.timestep_distribution,
            generator,
            preset.logit_mean,
            preset.logit_std,
        )
        lo, hi = self.sigma_range()
        sigma = lo + (hi - lo) * self.shift_sigmas(u, tuple(x0.shape))  # (B,)
        sigma = sigma.to(x0.device)
        x_t, target = flow_pair(x0, noise, sigma)
        return x_t, sigma.to(x0.dtype), target

    # -- outputs ----------------------------------------------------------------------------
    def inference_strategy(self, model, memory, device, telemetry):
        """An inference-mode strategy streaming ``model``'s blocks from ``transformer_dir``."""

        return build_strategy(
            model,
            memory,
            device=device,
            telemetry=telemetry,
            checkpoint_dir=self.transformer_dir,
            mode="inference",
        )

    def sample(self, model, text, spec):
        """Images (PIL) from the pipeline's ``__call__`` with cached embeddings ``text`` and
        the folder's own VAE (``spec.vae_dir`` and ``spec.prediction_type`` are the factory
        sampler's)."""
        raise NotImplementedError

    def sample_vae(self, device: torch.device) -> Any:
        """The folder's VAE in fp32 on ``device``, for a pipeline's ``__call__``: its
        ``decode`` casts the latents to fp32 first, since FluxPipeline, Flux2Pipeline and
        StableDiffusion3Pipeline hand them over in the transformer's dtype (bf16 in a bf16 run;
        the others cast to the VAE's dtype themselves)."""
        vae = load_component(self.root, "vae", torch.float32).to(device)
        decode = vae.decode

        def decode_fp32(z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return decode(z.to(torch.float32), *args, **kwargs)

        vae.decode = decode_fp32
        return vae

    def call_pipeline(
        self, denoiser: dict[str, Any], spec: SampleSpec, *, patch: int = 1, **embeds: Any
    ) -> list[Any]:
        """Images (PIL) from ``__call__`` of an image pipeline: ``denoiser`` names the trained
        model's component (``{"transformer": model}``), the VAE is the folder's in fp32
        (``sample_vae``), the size is ``spec.latent_shape`` (C, h, w) times ``patch`` (latents
        cached as patches: Flux.2) times the VAE's ``vae_scale_factor`` in pixels, the noise is
        drawn from ``spec.seed`` on the CPU in ``spec.steps`` steps, and ``embeds`` are the cached text and the family's
        guidance arguments."""
        vae = self.sample_vae(spec.device)
        pipe = self.pipeline(**denoiser, vae=vae)
        pipe.set_progress_bar_config(disable=True)
        _, h, w = spec.latent_shape
        return pipe(
            height=patch * h * pipe.vae_scale_factor,
            width=patch * w * pipe.vae_scale_factor,
            num_inference_steps=spec.steps,
            generator=torch.Generator().manual_seed(spec.seed),
            output_type="pil",
            **embeds,
        ).images

    def sample_pooled(self, denoiser: dict[str, Any], text: Text, spec: SampleSpec) -> list[Any]:
        """``call_pipeline`` for a pipeline conditioned on hidden and pooled text embeddings
        (SD3, SDXL), without CFG (no negative prompt is cached)."""
        return self.call_pipeline(
            denoiser,
            spec,
            prompt_embeds=text.hidden,
            pooled_prompt_embeds=text.pooled,
            guidance_scale=1.0,  # no negative prompt cached: plain conditional sampling
        )

    def comfy_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The LoRA ``state`` (scale folded into ``lora_B``: ``outputs.fold_lora_scale``) in
        ComfyUI's key layout, ``diffusion_model.<original module>.lora_A.weight`` /
        ``lora_B.weight`` and no ``.alpha`` (ComfyUI and diffusers' converters then apply scale
        1); None when the family's module names are not ComfyUI's."""
        if self.comfy_prefix is None:
            return None
        out = {}
        prefix = f"{self.lora_prefix}."
        for key, value in state.items():
            name = key.removeprefix(prefix)
            for ours, theirs in self.comfy_renames:
                name = name.replace(ours, theirs)
            out[f"{self.comfy_prefix}.{name}"] = value
        return out

    def lora_metadata(self) -> dict[str, str]:
        """Extra safetensors metadata of the saved LoRA (the base model and family)."""
        out = {
            "stagehand.base_model": str(self.root),
            "stagehand.family": self.name,
            "stagehand.pipeline_class": self.pipeline_class,
        }
        if self.expert is not None:
            out["stagehand.expert"] = self.expert
        return out


class PatchedLatents:
    """Mixin of the families whose transformer sees 2x2 patches of (B, C, h, w) latents and
    whose scheduler shifts dynamically with the pipeline's ``calculate_shift`` (Flux,
    Qwen-Image, Z-Image: ``mu``)."""

    def check_latents(self, shape: tuple[int, ...]) -> None:
        """Raise ``ValueError`` when latent h or w is odd (no whole 2x2 patches)."""
        if shape[-1] % 2 or shape[-2] % 2:
            raise ValueError(
                f"{self.name} packs 2x2 latent patches: latent h, w {tuple(shape[-2:])} must "
                "be even"
            )

    def image_seq_len(self, latent_shape: tuple[int, ...]) -> int:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def predict_packed(
        self, model: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, **inputs: Any
    ) -> torch.Tensor:
        """The velocity a transformer on 2x2-packed tokens predicts for ``x_t`` (B, C, h, w)
        at ``sigma`` (B,) in [0, 1] (the pipeline passes t / 1000 = sigma), with the text
        ``inputs`` of the family: the pipeline's ``_pack_latents`` (B, h/2 * w/2, 4C) in,
        ``_unpack_latents`` out ((B, C, h, w); (B, C, 1, h, w) where the pipeline's VAE is a
        video VAE), and ``guidance`` (B,) of ``self.guidance`` for a guidance-distilled one."""
        pipe = self.pipeline_cls()
        b, c, h, w = x_t.shape
        if model.config.guidance_embeds:
            inputs["guidance"] = torch.full((b,), self.guidance, device=x_t.device, dtype=x_t.dtype)
        out = model(
            hidden_states=pipe._pack_latents(x_t, b, c, h, w),
            timestep=sigma,
            return_dict=False,
            **inputs,
        )[0]
        return pipe._unpack_latents(out, h, w, 1)
