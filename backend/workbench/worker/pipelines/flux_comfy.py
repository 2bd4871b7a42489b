"""FLUX.1's ComfyUI-layout LoRA copy: kohya's names over BFL's original modules
(``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`` / ``.lora_up.weight`` /
``.alpha``), what FLUX.1 LoRAs are shared in and ComfyUI loads, and what diffusers'
``_convert_kohya_flux_lora_to_diffusers`` reads.

BFL fuses modules diffusers keeps apart: a double block's q, k, v (``img_attn.qkv``, and the
text stream's ``txt_attn.qkv``) and a single block's q, k, v and MLP input (``linear1``). n
LoRAs ``(A_i, B_i)`` of rank r become one of rank n r with ``A = [A_1; ...; A_n]`` and
block-diagonal ``B``: the same update, and the layout the converter recognises as sparse and
splits back into the very same ``A_i``, ``B_i``. A part without a LoRA (a single block's
``proj_mlp``, which the Flux targets leave out) is a zero block. The ``B`` come with the LoRA
scale folded in (``outputs.fold_lora_scale``), so every ``.alpha`` is its module's rank (n r
when fused): scale 1 in ComfyUI and in the converter.

diffusers' converter has FLUX.1's widths built in (a single block's ``linear1`` split as 3072,
3072, 3072, 12288), so the copy is written only for a transformer of that width: for any other
the converter could not read it back.
"""

from __future__ import annotations

import torch

FLUX1_WIDTH = 3072
"""FLUX.1's inner width (24 heads x 128), built into diffusers' kohya converter."""

_DOUBLE = {
    "attn.to_out.0": "img_attn_proj",
    "attn.to_add_out": "txt_attn_proj",
    "ff.net.0.proj": "img_mlp_0",
    "ff.net.2": "img_mlp_2",
    "ff_context.net.0.proj": "txt_mlp_0",
    "ff_context.net.2": "txt_mlp_2",
    "norm1.linear": "img_mod_lin",
    "norm1_context.linear": "txt_mod_lin",
}
_DOUBLE_FUSED = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_SINGLE = {"proj_out": "linear2", "norm.linear": "modulation_lin"}
_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
_OPTIONAL = {"proj_mlp"}
"""Fused parts that may have no LoRA (a zero block); q, k, v come all or none."""


def kohya_flux_state_dict(
    state: dict[str, torch.Tensor], width: int, prefix: str = "transformer"
) -> dict[str, torch.Tensor] | None:
    """``state`` (``transformer.<module>.lora_A.weight`` (r, in) / ``lora_B.weight`` (out, r))
    in kohya's FLUX.1 layout (module doc), or None when the transformer is not FLUX.1-wide
    (``width`` != 3072), or a LoRA module has no BFL name, or only part of a q, k, v triple
    has a LoRA."""
    if width != FLUX1_WIDTH:
        return None
    loras: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        module, _, part = key.removeprefix(f"{prefix}.").rpartition(".lora_")
        loras.setdefault(module, {})[part.removesuffix(".weight")] = value
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    kinds = (
        ("transformer_blocks", "double_blocks", _DOUBLE, _DOUBLE_FUSED),
        ("single_transformer_blocks", "single_blocks", _SINGLE, _SINGLE_FUSED),
    )
    blocks = sorted({tuple(m.split(".", 2)[:2]) for m in loras if m.count(".") >= 2})
    for kind, index in blocks:
        match = [k for k in kinds if k[0] == kind]
        if not match:
            return None
        _, bfl, plain, fused = match[0]
        stem = f"lora_unet_{bfl}_{index}"
        for inner, name in plain.items():
            lora = loras.get(f"{kind}.{index}.{inner}")
            if lora is not None:
                out.update(_kohya(f"{stem}_{name}", lora["A"], lora["B"]))
                used.add(f"{kind}.{index}.{inner}")
        for name, parts in fused.items():
            modules = [f"{kind}.{index}.{p}" for p in parts]
            present = [m in loras for m in modules]
            required = [p not in _OPTIONAL for p in parts]
            if not any(present):
                continue
            if not all(have for have, need in zip(present, required, strict=True) if need):
                return None
            group = _fuse([loras.get(m) for m in modules], width)
            if group is None:
                return None
            a, b = group
            out.update(_kohya(f"{stem}_{name}", a, b))
            used.update(m for m in modules if m in loras)
    return out if used == set(loras) else None


def _fuse(loras: list[dict[str, torch.Tensor] | None], width: int):
    """``(A, B)`` of one LoRA of rank n r doing what the n LoRAs (or zero blocks) do."""
    ranks = {lora["A"].shape[0] for lora in loras if lora is not None}
    if len(ranks) != 1:
        return None
    (r,) = ranks
    like = next(lora["A"] for lora in loras if lora is not None)
    a_parts, b_parts = [], []
    for lora in loras:
        if lora is None:  # proj_mlp: FLUX.1's MLP is 4 x the width
            a_parts.append(torch.zeros(r, like.shape[1], dtype=like.dtype))
            b_parts.append(torch.zeros(4 * width, r, dtype=like.dtype))
        else:
            a_parts.append(lora["A"])
            b_parts.append(lora["B"])
    return torch.cat(a_parts), torch.block_diag(*b_parts)  # (n r, in), (sum out, n r)


def _kohya(stem: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """One kohya LoRA module: ``lora_down`` = A (r, in), ``lora_up`` = B (out, r), alpha = r."""
    return {
        f"{stem}.lora_down.weight": a.contiguous(),
        f"{stem}.lora_up.weight": b.contiguous(),
        f"{stem}.alpha": torch.tensor(float(a.shape[0])),
    }
