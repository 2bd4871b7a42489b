"""What a run leaves in its folder: the LoRA, checkpoints (the sample images: ``sampling.py``).

- ``DIR/lora/pytorch_lora_weights.safetensors``: keys ``transformer.<module>.lora_A.weight`` /
  ``lora_B.weight``, written by the family's diffusers LoRA mixin (``FluxLoraLoaderMixin``...)
  with the peft config as adapter metadata, so ``pipeline.load_lora_weights(DIR/lora)`` and
  ``transformer.load_lora_adapter(path, prefix="transformer")`` read it back. Every LoRA file
  has the LoRA scale ``alpha / rank`` folded into ``lora_B`` (NOTE [ LoRA scale ]).
- ``DIR/model/diffusion_pytorch_model.safetensors``: the weights of a full (non-LoRA) run.
- ``DIR/checkpoints/step-N/``: ``trainable.safetensors`` (trainable parameters by name),
  ``optimizer.pt``, ``scheduler.pt``, ``rng.pt``, ``state.json`` (``{"step": N}``), written to a
  temp folder and renamed, so a crash never leaves a half checkpoint under the final name.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from workbench.worker.families import Family

LORA_FILE = "pytorch_lora_weights.safetensors"
COMFY_FILE = "comfyui-lora.safetensors"
"""The ComfyUI-layout copy beside ``LORA_FILE`` (the original model's module names)."""
REMOVAL_WAIT_S = 2.0
"""How long ``folder_problem`` gives a removal in progress to take the run folder itself."""
_UNWRITABLE = {errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM}
"""errnos that say a folder cannot be written (read-only, full, over quota, not ours)."""


def folder_problem(run_dir: Path, exc: OSError, *, started: bool = True) -> str | None:
    """Why ``exc`` means the run folder cannot take the run's output, naming the folder (it is
    gone, read-only, full or not ours to write); None when ``exc`` is about something else.
    Before the run ``started`` (creating the folder, opening telemetry.jsonl) every ``exc`` is
    about the folder."""
    name = exc.filename
    inside = name is None or Path(os.path.abspath(name)).is_relative_to(run_dir.absolute())
    missing = started and exc.errno == errno.ENOENT and inside
    if missing:
        # A removal in progress empties the folder before removing it (``rm -r``,
        # ``shutil.rmtree``): a file gone from a folder still there is usually the folder going.
        deadline = time.monotonic() + REMOVAL_WAIT_S
        while run_dir.is_dir() and time.monotonic() < deadline:
            time.sleep(0.05)
    if started and not run_dir.is_dir():
        return (
            f"the run folder {run_dir} no longer exists (removed while the run was going?): "
            f"{exc.strerror or exc}"
        )
    if missing and name is not None:
        return f"{name} was removed from the run folder {run_dir} while the run was going"
    if started and (exc.errno not in _UNWRITABLE or not inside):
        return None
    text = f"cannot write the run folder {run_dir}: {exc.strerror or exc}"
    text += f" ({name})" if name and name != str(run_dir) else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and run_dir.is_dir():
        text += f"; {shutil.disk_usage(run_dir).free / 2**20:.0f} MB free there"
    return text


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameters by name, as contiguous CPU copies."""
    return {
        n: p.detach().to("cpu", copy=True).contiguous()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


# NOTE [ LoRA scale ]
# peft computes a LoRA layer as ``W x + scale * B (A x)`` with ``scale = lora_alpha / r``
# (``use_rslora``: ``/ sqrt(r)``; per module with ``alpha_pattern`` / ``rank_pattern``). The
# readers of a LoRA file do not agree on where the scale comes from:
# - diffusers' ``load_lora_adapter`` builds the ``LoraConfig`` from the file's
#   ``lora_adapter_metadata`` when there is one, else ``alpha = r`` (diffusers 0.42
#   ``loaders/peft.py``, ``utils/peft_utils.py``). ``.alpha`` tensors are each mixin's own
#   business: FLUX.1's ``lora_state_dict`` pops them into ``network_alphas``, which with
#   metadata raises ``ValueError``; Qwen-Image's and Z-Image's send a file holding one through
#   their non-diffusers converters; Wan's reads them in ``diffusion_model.`` files only; LTX-2's
#   refuses keys without ``lora`` in them; FLUX.2's converter takes none.
# - ComfyUI (``comfy/lora.py`` ``load_lora``, ``comfy/weight_adapter/lora.py``
#   ``LoRAAdapter.calculate_weight``) adds ``strength * (alpha / down.shape[0]) * up @ down``
#   when the file has ``<module>.alpha``, and ``strength * up @ down`` otherwise; it never reads
#   the metadata. A diffusers file with alpha only in its metadata loads there at r / alpha of
#   its strength.
# So ``.alpha`` tensors cannot serve every reader, and every file written here holds
# ``B' = scale * B`` (per module, the scale peft applied in training) and says
# ``lora_alpha = r`` (``alpha_pattern = rank_pattern``, no rslora): scale 1 for diffusers, for
# ComfyUI without ``.alpha``, and for kohya copies, whose ``.alpha`` is the rank (kohya's
# converters want one). The trained alpha and rank stay in ``stagehand.alpha`` /
# ``stagehand.rank``. With a power-of-two scale the folded file reproduces the trained model bit
# for bit; otherwise ``B'`` is ``scale * B`` rounded once (0.5 ulp of fp32).


def lora_scales(model: torch.nn.Module, adapter: str = "default") -> dict[str, float]:
    """The scale peft applies to each LoRA module of ``model`` (NOTE [ LoRA scale ]), by the
    name of its ``lora_B`` weight as ``get_peft_model_state_dict`` gives it
    (``<module>.lora_B.weight``)."""
    from peft.tuners.lora import LoraLayer

    return {
        f"{name}.lora_B.weight": float(module.scaling[adapter])
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and adapter in module.scaling
    }


def fold_lora_scale(
    state: dict[str, torch.Tensor], scales: dict[str, float]
) -> dict[str, torch.Tensor]:
    """``state`` (``<module>.lora_A.weight`` (r, in) / ``lora_B.weight`` (out, r)) with each
    ``lora_B`` times its module's scale in ``scales`` (``lora_scales``); other tensors as they
    are.

    Raises:
        ValueError: a ``lora_B`` with no scale (no LoRA module of that name in the model).
    """
    out = {}
    for key, value in state.items():
        if ".lora_B." in key:
            if key not in scales:
                raise ValueError(f"{key}: no LoRA module of the model has this name")
            value = value * scales[key]
        out[key] = value
    return out


def unit_scale_config(config: dict) -> dict:
    """The peft ``LoraConfig`` dict ``config`` saying scale 1 everywhere (alpha = rank)."""
    return {
        **config,
        "lora_alpha": config["r"],
        "alpha_pattern": dict(config.get("rank_pattern") or {}),
        "use_rslora": False,
    }


def save_lora(model: torch.nn.Module, family: Family, run_dir: Path, steps: int = 0) -> Path:
    """Save the LoRA (or, for a full run, the whole model) and return the file written.

    The LoRA is written with its scale folded into ``lora_B`` (NOTE [ LoRA scale ]) and
    ``stagehand.*`` safetensors metadata beside the mixin's ``lora_adapter_metadata``: the
    trained ``rank`` and ``alpha``, ``scale_folded`` (the scale now in ``lora_B``: alpha / rank),
    ``targets``, ``steps``, and for a pipeline family its base model and family.
    """
    if getattr(model, "peft_config", None):
        from peft.utils import get_peft_model_state_dict

        state = {
            k: v.detach().to("cpu", copy=True).contiguous()
            for k, v in get_peft_model_state_dict(model).items()
        }
        scales = lora_scales(model)
        state = fold_lora_scale(state, scales)
        folder = run_dir / "lora"
        folder.mkdir(parents=True, exist_ok=True)
        config = model.peft_config["default"]
        family.save_lora(str(folder), state, unit_scale_config(config.to_dict()))
        metadata = {
            **family.lora_metadata(),
            "stagehand.rank": str(config.r),
            "stagehand.alpha": str(config.lora_alpha),
            "stagehand.scale_folded": ",".join(str(v) for v in sorted(set(scales.values()))),
            "stagehand.targets": json.dumps(sorted(config.target_modules)),
            "stagehand.steps": str(steps),
        }
        add_metadata(folder / LORA_FILE, metadata)
        comfy = family.comfy_state_dict(state)
        if comfy is not None:
            tmp = folder / f".{COMFY_FILE}.tmp"
            save_file(comfy, str(tmp), metadata={"format": "pt", **metadata})
            os.replace(tmp, folder / COMFY_FILE)
        return folder / LORA_FILE
    folder = run_dir / "model"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "diffusion_pytorch_model.safetensors"
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path))
    return path


def add_metadata(path: Path, extra: dict[str, str]) -> None:
    """Rewrite the safetensors file ``path`` with ``extra`` added to its metadata (atomically)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = {**(f.metadata() or {}), **extra}
    tensors = load_file(str(path))
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> Path:
    """Write ``DIR/checkpoints/step-<step>/`` atomically and return it."""
    root = run_dir / "checkpoints"
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(trainable_state(model), str(tmp / "trainable.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step}))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The ``step-N`` folder with the largest N, or None."""
    found = []
    for p in (run_dir / "checkpoints").glob("step-*"):
        if p.is_dir() and (p / "state.json").is_file():
            try:
                found.append((int(p.name.split("-", 1)[1]), p))
            except ValueError:
                continue
    return max(found)[1] if found else None


def load_checkpoint(
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> int:
    """Restore a checkpoint into ``model``/``optimizer``/``scheduler`` and the RNGs; return its step.

    Raises:
        KeyError: the checkpoint's trainable parameters do not match the model's (other preset).
    """
    weights = load_file(str(folder / "trainable.safetensors"))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(weights) != set(params):
        missing, extra = set(params) - set(weights), set(weights) - set(params)
        raise KeyError(
            f"checkpoint {folder} does not match the model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(extra)[:3]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name].to(p.device, p.dtype))
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=False))
    rng = torch.load(folder / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return int(json.loads((folder / "state.json").read_text())["step"])
