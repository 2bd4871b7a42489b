"""Every LoRA file a run writes loads at the trained strength in diffusers and in ComfyUI, for
every pipeline family, with ``alpha != rank`` (rank 4, alpha 8: a scale of 2).

ComfyUI's rule, the one these tests apply to the files (ComfyUI ``comfy/lora.py``
``load_lora`` and ``comfy/weight_adapter/lora.py`` ``LoRAAdapter.calculate_weight``, read at
github.com/comfyanonymous/ComfyUI): for a module key ``x`` with ``x.lora_up.weight`` /
``x.lora_down.weight`` (or ``x.lora_B.weight`` / ``x.lora_A.weight``), the weight it patches
gets::

    W += strength * scale * (up @ down)      scale = x.alpha / down.shape[0]  if the file has x.alpha
                                                     1.0                      otherwise

and the safetensors metadata is never read. The trained model's update of a module is
``scaling * (B @ A)`` with peft's ``scaling = lora_alpha / r``.

The rule is applied to the diffusers file too: ComfyUI's key map (``model_lora_keys_unet``)
takes its ``transformer.<diffusers name>`` keys for SD3, FLUX.1, Qwen-Image and Z-Image. Where
ComfyUI's names are not diffusers', the copy's deltas are put, as the original model's weights
they patch, through diffusers' single-file converter of the family
(``diffusers/loaders/single_file_utils.py``, which loads the original checkpoints: BFL's
FLUX.2, Lightricks' LTX-2, Wan-AI's Wan, Tongyi's Z-Image), so the names, the shapes and the
fused q/k/v rows are checked against the original format as that converter reads it.
"""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from workbench.worker.loop import attach_adapter
from workbench.worker.outputs import COMFY_FILE, LORA_FILE, save_lora
from workbench.worker.pipelines import adapter_for, inspect_pipeline

RANK, ALPHA = 4, 8.0
FAMILIES = ["flux", "flux2", "sd3", "sdxl", "qwenimage", "wan", "ltx2", "zimage"]


def comfy_deltas(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's weight update per module key of the LoRA file ``sd`` (module doc), strength 1."""
    out = {}
    for key, up in sd.items():
        for up_part, down_part in ((".lora_up.weight", ".lora_down.weight"), (".lora_B.weight", ".lora_A.weight")):  # fmt: skip
            if key.endswith(up_part):
                x = key[: -len(up_part)]
                down = sd[x + down_part]
                scale = sd[x + ".alpha"].item() / down.shape[0] if x + ".alpha" in sd else 1.0
                out[x] = (scale * (up.float() @ down.float())).to(up.dtype)
    return out


def trained_deltas(model) -> dict[str, torch.Tensor]:
    """``scaling * (B @ A)`` of every LoRA module of ``model``, by module name."""
    from peft.tuners.lora import LoraLayer

    return {
        name: (m.lora_B["default"].weight @ m.lora_A["default"].weight) * m.scaling["default"]
        for name, m in model.named_modules()
        if isinstance(m, LoraLayer)
    }


ORIGINAL_TO_DIFFUSERS = {
    "flux2": "convert_flux2_transformer_checkpoint_to_diffusers",
    "ltx2": "convert_ltx2_transformer_to_diffusers",
    "wan": "convert_wan_transformer_to_diffusers",
    "zimage": "convert_z_image_transformer_checkpoint_to_diffusers",
}
"""diffusers' single-file converter from the family's original checkpoint (Qwen-Image's
original names are diffusers')."""


def comfy_zimage_weights(deltas: dict[str, torch.Tensor], dim: int) -> dict[str, torch.Tensor]:
    """The original Z-Image weights ComfyUI patches with a LoRA in diffusers' names: ComfyUI
    (``comfy/lora.py`` ``model_lora_keys_unet``, Lumina2 models) maps
    ``diffusion_model.<diffusers name>`` through ``comfy/utils.py`` ``z_image_to_diffusers``:
    ``attention.to_q`` / ``to_k`` / ``to_v`` patch rows ``[0, d)``, ``[d, 2d)``, ``[2d, 3d)`` of
    ``attention.qkv`` (d = ``dim``), ``attention.to_out.0`` patches ``attention.out``, the
    feed-forward keeps its names. ``deltas``: ``<module>.weight`` -> (out, in)."""
    out: dict[str, torch.Tensor] = {}
    for key, delta in deltas.items():
        parts = [p for p in "qkv" if f".attention.to_{p}." in key]
        if parts:
            fused = key.replace(f".attention.to_{parts[0]}.", ".attention.qkv.")
            rows = out.setdefault(fused, torch.zeros(3 * dim, delta.shape[1]))
            at = "qkv".index(parts[0]) * dim
            rows[at : at + dim] = delta
        else:
            out[key.replace(".attention.to_out.0.", ".attention.out.")] = delta
    return out


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory):
    """Per family: the bound family, a transformer with a rank-4, alpha-8 LoRA whose A and B are
    random (what training leaves: B is no longer 0), and the run folder ``save_lora`` wrote."""
    runs = {}

    def get(name: str):
        if name not in runs:
            root = request.getfixturevalue(f"{name}_pipeline_dir")
            tmp = tmp_path_factory.mktemp(f"lora-{name}")
            family = adapter_for(inspect_pipeline(root), tmp / "cache", torch.float32)
            model = family.load_class().from_pretrained(family.transformer_dir).eval()
            preset = SimpleNamespace(
                training_method="lora",
                rank=RANK,
                alpha=ALPHA,
                seed=0,
                lora=SimpleNamespace(dropout=0.0, target_modules=list(family.lora_targets)),
            )
            params = attach_adapter(model, preset)
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in params:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            save_lora(model, family, tmp / "run", steps=2)
            runs[name] = (family, model, tmp / "run" / "lora")
        return runs[name]

    return get


@pytest.mark.parity
@pytest.mark.parametrize("name", FAMILIES)
def test_lora_file_gives_the_trained_output_through_load_lora_weights(name, trained):
    """``load_lora_weights`` on a fresh pipeline reproduces every LoRA layer's output of the
    trained transformer bit for bit (the scale 2 folded into ``lora_B`` is a power of two), and
    the file says what was trained."""
    family, model, folder = trained(name)
    fresh = family.load_class().from_pretrained(family.transformer_dir).eval()
    pipe = family.pipeline(**{family.lora_prefix: fresh})
    pipe.load_lora_weights(folder)
    with safe_open(str(folder / LORA_FILE), "pt") as f:
        meta = f.metadata()
    assert (meta["stagehand.rank"], meta["stagehand.alpha"]) == ("4", "8.0")
    assert meta["stagehand.scale_folded"] == "2.0"
    config = json.loads(meta["lora_adapter_metadata"])
    assert config[f"{family.lora_prefix}.lora_alpha"] == config[f"{family.lora_prefix}.r"] == 4
    from peft.tuners.lora import LoraLayer

    loaded = dict(fresh.named_modules())
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert layers and all(isinstance(loaded[n], LoraLayer) for n in layers)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer_name, layer in layers.items():
            x = torch.randn(3, layer.in_features, generator=g)  # (tokens, in)
            assert torch.equal(loaded[layer_name](x), layer(x)), layer_name


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_files_give_the_trained_delta_under_comfyui_rule(name, trained):
    """The diffusers file and the ComfyUI-layout copy give, under ComfyUI's rule (module doc),
    each module's trained update ``scaling * B @ A``: before the scale was folded into
    ``lora_B``, the diffusers file (alpha only in its metadata) gave half of it."""
    family, model, folder = trained(name)
    want = trained_deltas(model)
    prefix = f"{family.lora_prefix}."
    got = {
        x.removeprefix(prefix): d for x, d in comfy_deltas(load_file(folder / LORA_FILE)).items()
    }
    assert sorted(got) == sorted(want)
    for module, delta in want.items():
        assert torch.equal(got[module], delta), module

    copy = folder / COMFY_FILE
    if name in ("flux", "sd3"):  # FLUX.1 at 16 wide and SD3: no copy (README)
        assert not copy.exists()
        return
    sd = load_file(copy)
    deltas = comfy_deltas(sd)
    if name == "sdxl":
        # kohya names: every .alpha is its module's rank (scale 1); a kohya module is the
        # diffusers one whose lora_A it holds (diffusers' converter maps the names back).
        assert all(sd[f"{x}.alpha"].item() == sd[f"{x}.lora_down.weight"].shape[0] for x in deltas)
        by_a = {m: model.get_submodule(m).lora_A["default"].weight for m in want}
        for x, delta in deltas.items():
            (module,) = [m for m, a in by_a.items() if torch.equal(a, sd[f"{x}.lora_down.weight"])]
            assert torch.equal(delta, want[module]), x
        assert len(deltas) == len(want)
        return
    original = {x.removeprefix("diffusion_model.") + ".weight": d for x, d in deltas.items()}
    assert all(x.startswith("diffusion_model.") for x in deltas)
    if name == "zimage":  # the copy keeps diffusers' names; ComfyUI fuses them itself
        original = comfy_zimage_weights(original, model.config.dim)
        assert any(k.endswith(".attention.qkv.weight") for k in original)
    if name in ORIGINAL_TO_DIFFUSERS:
        import diffusers.loaders.single_file_utils as single_file

        original = getattr(single_file, ORIGINAL_TO_DIFFUSERS[name])(original)
    weights = model.state_dict()
    shapes = {k.replace(".base_layer.", "."): v.shape for k, v in weights.items()}
    for key, delta in original.items():
        module = key.removesuffix(".weight")
        assert shapes[key] == delta.shape, key  # the original weight it patches, converted
        assert torch.equal(delta, want[module]), key
    assert sorted(k.removesuffix(".weight") for k in original) == sorted(want)
