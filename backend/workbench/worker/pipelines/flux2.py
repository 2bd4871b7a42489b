"""FLUX.2 [klein] (``Flux2KleinPipeline``): Qwen3 text model (hidden states 9, 18 and 27 of the
chat-templated prompt, stacked along features: (B, T, 3D)), ``AutoencoderKLFlux2`` latents
2x2-patchified and normalised by the VAE's batch-norm statistics, ``Flux2Transformer2DModel``
on packed tokens with 4-axis position ids. Everything shape-related is the pipeline's own code:
``_get_qwen3_prompt_embeds`` (what ``encode_prompt`` calls), ``_encode_vae_image`` (patchify,
then ``(z - bn.running_mean) / sqrt(bn.running_var + eps)``, what ``__call__`` inverts),
``_pack_latents`` / ``_prepare_latent_ids`` / ``_prepare_text_ids`` /
``_unpack_latents_with_ids``, ``compute_empirical_mu`` and ``__call__`` for samples.

Latents are cached patchified, (4C, h/2, w/2): one token per latent position, as ``__call__``
prepares them. The transformer takes ``sigma`` (``__call__`` passes t / 1000) and predicts the
velocity ``noise - x0``. Timestep shift: the scheduler's dynamic shift with the ``mu`` that
``__call__`` computes, ``compute_empirical_mu(tokens, num_inference_steps)``, at ``__call__``'s
default step count (``mu`` depends on it; training has none of its own).

ComfyUI-layout copy: the BFL names ComfyUI's FLUX.2 model uses (``double_blocks.N.img_attn.qkv``
fused, ``.proj``, ``single_blocks.N.linear1`` / ``linear2``), the layout diffusers'
``_convert_non_diffusers_flux2_lora_to_diffusers`` reads, which takes the number of blocks from
the keys (no model sizes built in). q, k, v LoRAs become one LoRA of the fused ``qkv`` with
``A = [A_q; A_k; A_v]`` (3r x in) and block-diagonal ``B`` (3 out x 3r), the same update; the
``B`` come with the ``alpha / r`` scale folded in (``outputs.fold_lora_scale``) and no ``.alpha``
key is written (the converter takes none; ComfyUI then scales by 1).
FLUX.2 [dev] (``Flux2Pipeline``: Mistral 3 with a Pixtral processor) is refused.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch

from workbench.worker.pipelines.base import PipelineFamily, load_component
from workbench.worker.pipelines.folder import PipelineFolderError, read_json


def _default(function, name: str):
    return inspect.signature(function).parameters[name].default


def _qwen3_pass(pipe, texts, device, max_tokens):
    layers = _default(type(pipe).encode_prompt, "text_encoder_out_layers")
    hidden = pipe._get_qwen3_prompt_embeds(
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
        prompt=texts,
        device=device,
        max_sequence_length=max_tokens,
        hidden_states_layers=layers,
    )  # (b, T, 3D): padded to max_tokens, attended in full (the transformer takes no mask)
    return {"hidden": hidden}


# BFL (ComfyUI) module names of the diffusers ones a LoRA targets, per block kind.
_DOUBLE = {
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.linear_in": "img_mlp.0",
    "ff.linear_out": "img_mlp.2",
    "ff_context.linear_in": "txt_mlp.0",
    "ff_context.linear_out": "txt_mlp.2",
}
_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v")}
_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}


class Flux2PipelineFamily(PipelineFamily):
    name, model_class, lora_mixin = "flux2", "Flux2Transformer2DModel", "Flux2LoraLoaderMixin"
    pipeline_class = "Flux2KleinPipeline"
    tokenizers = ("tokenizer",)
    text_passes = (("text_encoder", _qwen3_pass),)
    comfy_prefix = "diffusion_model"
    guidance = 1.0
    """Guidance fed to a guidance-distilled transformer while training (FLUX.2 [dev])."""

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """diffusers' ``train_dreambooth_lora_flux2_klein.py`` targets: the double blocks'
        attention (``to_q``, ``to_k``, ``to_v``, ``to_out.0``), the single blocks' fused
        ``to_qkv_mlp_proj`` and each single block's ``attn.to_out`` by name (the script lists
        24; here the count is the folder's ``num_single_layers``)."""
        n = read_json(self.transformer_dir / "config.json", "the transformer's config").get(
            "num_single_layers", 0
        )
        single = tuple(f"single_transformer_blocks.{i}.attn.to_out" for i in range(n))
        return ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj", *single)

    def text_layers(self) -> tuple[int, ...]:
        return tuple(_default(self.pipeline_cls().encode_prompt, "text_encoder_out_layers"))

    def check_components(self) -> None:
        """The transformer's text and latent inputs must be what Qwen3 and the VAE give.

        Raises:
            PipelineFolderError: a ``Flux2Pipeline`` (FLUX.2 [dev]) folder, or naming
                ``transformer/config.json`` / ``text_encoder/config.json`` and each field that
                does not fit (``joint_attention_dim``, ``num_hidden_layers``, ``in_channels``).
        """
        if self.info.pipeline_class != self.pipeline_class:
            raise PipelineFolderError(
                f"{self.root / 'model_index.json'}: {self.info.pipeline_class} (FLUX.2 [dev], "
                "Mistral 3 text encoder) can be inspected but not trained yet; the flux2 family "
                "trains Flux2KleinPipeline folders (FLUX.2 [klein], Qwen3)"
            )
        tcfg = read_json(self.transformer_dir / "config.json", "the transformer's config")
        enc = read_json(self.root / "text_encoder" / "config.json", "the text encoder's config")
        vae = read_json(self.root / "vae" / "config.json", "the VAE's config")
        layers = self.text_layers()
        problems = []
        want = len(layers) * (enc.get("hidden_size") or 0)
        if tcfg.get("joint_attention_dim") != want:
            problems.append(
                f"joint_attention_dim is {tcfg.get('joint_attention_dim')}; expected "
                f"{len(layers)} stacked text_encoder hidden states x hidden_size "
                f"{enc.get('hidden_size')} ({want})"
            )
        if (enc.get("num_hidden_layers") or 0) < max(layers):
            problems.append(
                f"text_encoder/config.json num_hidden_layers is {enc.get('num_hidden_layers')}; "
                f"the pipeline reads hidden states {list(layers)}"
            )
        patch = vae.get("patch_size") or (2, 2)
        latent = (vae.get("latent_channels") or 0) * patch[0] * patch[1]
        if tcfg.get("in_channels") != latent:
            problems.append(
                f"in_channels is {tcfg.get('in_channels')}; expected vae latent_channels x "
                f"patch_size ({latent})"
            )
        self.check_fit(problems)

    def check_caption_tokens(self, tokens: int) -> None:
        """Raise ``ValueError`` when ``data.max_caption_tokens`` leaves no room for a caption
        after the chat template the pipeline wraps it in (it pads or cuts to that length)."""
        tok = load_component(self.root, "tokenizer")
        empty = tok.apply_chat_template(
            [{"role": "user", "content": ""}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        template = len(tok(empty).input_ids)
        if tokens <= template:
            raise ValueError(
                f"data.max_caption_tokens is {tokens} but {self.root / 'tokenizer'}'s chat "
                f"template alone is {template} tokens; expected more than {template} (the "
                "pipeline's default is 512)"
            )

    def encode_pixels(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """(n, 3, H, W) -> (n, 4C, H / 2s, W / 2s) for the VAE's downscale s: patchified,
        normalised latents by ``_encode_vae_image`` (the mode of the latent distribution)."""
        cls = self.pipeline_cls()
        fake = SimpleNamespace(vae=vae, _patchify_latents=cls._patchify_latents)
        return cls._encode_vae_image(fake, pixels, generator=None)  # (n, 4C, h/2, w/2)

    def image_seq_len(self, latent_shape: tuple[int, ...]) -> int:
        return latent_shape[-2] * latent_shape[-1]  # one token per patchified position

    def mu(self, image_seq_len: int) -> float:
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        steps = _default(self.pipeline_cls().__call__, "num_inference_steps")
        return compute_empirical_mu(image_seq_len=image_seq_len, num_steps=steps)

    def predict(self, model, x_t, sigma, text):
        pipe = self.pipeline_cls()
        b, c, h, w = x_t.shape  # patchified: (B, 4C, h/2, w/2)
        img_ids = pipe._prepare_latent_ids(x_t).to(x_t.device)  # (B, h w, 4)
        kwargs = {}
        if model.config.guidance_embeds:
            kwargs["guidance"] = torch.full((b,), self.guidance, device=x_t.device, dtype=x_t.dtype)
        out = model(
            hidden_states=pipe._pack_latents(x_t),  # (B, h w, 4C)
            timestep=sigma,  # __call__ passes t / 1000 = sigma
            encoder_hidden_states=text.hidden,  # (B, T, 3D)
            txt_ids=pipe._prepare_text_ids(text.hidden).to(x_t.device),  # (B, T, 4)
            img_ids=img_ids,
            return_dict=False,
            **kwargs,
        )[0]
        return pipe._unpack_latents_with_ids(out[:, : h * w], img_ids, h, w)  # (B, 4C, h, w)

    def sample(self, model, text, spec):
        return self.call_pipeline(
            {"transformer": model},
            spec,  # latent_shape patchified
            patch=2,
            prompt_embeds=text.hidden,
            guidance_scale=1.0,  # no negative prompt cached: plain conditional sampling
        )

    def comfy_state_dict(self, state):
        """The LoRA in BFL / ComfyUI names (module doc), ``diffusion_model.`` prefixed; None
        (no copy) when a LoRA module has no BFL name (a target outside the double blocks'
        attention and MLPs and the single blocks' two linears) or only part of q, k, v has one.
        """
        prefix = f"{self.lora_prefix}."
        loras: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            module, _, part = key.removeprefix(prefix).rpartition(".lora_")
            loras.setdefault(module, {})[part.removesuffix(".weight")] = value
        out: dict[str, torch.Tensor] = {}
        fused: dict[str, list[tuple[int, str]]] = {}
        blocks = {"transformer_blocks": ("double_blocks", _DOUBLE), "single_transformer_blocks": ("single_blocks", _SINGLE)}  # fmt: skip
        for module, ab in loras.items():
            kind, index, inner = module.split(".", 2)
            qkv = [(b, p) for b, p in _FUSED.items() if kind == "transformer_blocks" and inner in p]
            if qkv:
                bfl, parts = qkv[0]
                fused.setdefault(f"double_blocks.{index}.{bfl}", []).append(
                    (parts.index(inner), module)
                )
                continue
            outer, table = blocks.get(kind, ("", {}))
            if inner not in table:
                return None
            name = f"{outer}.{index}.{table[inner]}"
            out[f"{self.comfy_prefix}.{name}.lora_A.weight"] = ab["A"]
            out[f"{self.comfy_prefix}.{name}.lora_B.weight"] = ab["B"]
        for name, members in fused.items():
            if sorted(i for i, _ in members) != [0, 1, 2]:
                return None
            members.sort()
            a = [loras[m]["A"] for _, m in members]  # 3 x (r, in)
            b = [loras[m]["B"] for _, m in members]  # 3 x (out, r), scale folded in
            out[f"{self.comfy_prefix}.{name}.lora_A.weight"] = torch.cat(a)  # (3r, in)
            out[f"{self.comfy_prefix}.{name}.lora_B.weight"] = torch.block_diag(*b)  # (3o, 3r)
        return out
