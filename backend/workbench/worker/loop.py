"""Stage 2: load the transformer (or UNet), attach the LoRA, build the memory strategy, train.

Each step draws its batch, noise and sigmas (or DDPM timesteps) from a ``torch.Generator`` seeded with
``(seed, step)``, so a run resumed from ``checkpoints/step-N`` computes the same losses as an
uninterrupted one (fp32). Between steps the loop reads the control folder (stop, live limits)
and the SIGTERM flag. The loop itself (``run_steps``) reads like nanoGPT's: flat, one step at a
time, the strategy's phase contexts around forward, backward and the optimizer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from stagehand.config.memory import MB
from workbench.contract.preset import Preset
from workbench.worker.data import batch_indices
from workbench.worker.families import Family, Text
from workbench.worker.outputs import save_checkpoint
from workbench.worker.recovery import OomRecovery, Rollback

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Batchable:
    """The stage-1 cache in memory: latents per sample, text rows and each sample's text row."""

    latents: list[torch.Tensor]  # per sample: (C, h, w) or (C, F, h, w)
    text: dict[str, torch.Tensor]  # hidden (U, T, D), mask (U, T), pooled (U, D)
    caption_rows: list[int]  # sample i -> row of ``text``
    prompt_rows: list[int] = field(default_factory=list)
    """``samples.prompts[j]`` -> row of ``text`` (a prompt that is also a caption shares its row)."""
    groups: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    held_out: list[int] = field(default_factory=list)
    """Samples kept out of ``groups`` for the validation loss."""

    def text_rows(self, rows: list[int], device, dtype) -> Text:
        idx = torch.tensor(rows)
        return Text(
            hidden=self.text["hidden"][idx].to(device, dtype),
            mask=self.text["mask"][idx].to(device),
            pooled=self.text["pooled"][idx].to(device, dtype),
        )


def load_transformer(family: Family, folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """``from_pretrained`` of the family's class from a model folder (sharded safetensors)."""
    cls = family.load_class()
    return cls.from_pretrained(folder, torch_dtype=dtype, low_cpu_mem_usage=True)


def attach_adapter(model: torch.nn.Module, preset: Preset) -> list[torch.nn.Parameter]:
    """Freeze the base, add the LoRA (or unfreeze everything for ``full``); trainable params fp32.

    Raises:
        ValueError: no module matches ``lora.target_modules`` (peft's message names them).
    """
    if preset.training_method == "full":
        model.requires_grad_(True)
    else:
        from peft import LoraConfig

        model.requires_grad_(False)
        torch.manual_seed(preset.seed)  # the same LoRA init for the same seed
        model.add_adapter(
            LoraConfig(
                r=preset.rank,
                lora_alpha=preset.alpha,
                lora_dropout=preset.lora.dropout,
                init_lora_weights="gaussian",  # B = 0: the LoRA starts as a no-op
                target_modules=list(preset.lora.target_modules),
            )
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.data = p.data.float()  # optimizer math in fp32 even when the base is bf16
    return trainable


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Turn on gradient checkpointing and verify it is on.

    The seed's bug 5: ``enable_gradient_checkpointing()`` raised inside ``suppress(Exception)``
    and training ran without it (22 GB of activations per block). Errors propagate here.

    Raises:
        RuntimeError: the model reports checkpointing off after enabling it.
    """
    model.enable_gradient_checkpointing()
    if not model.is_gradient_checkpointing:
        raise RuntimeError(
            f"{type(model).__name__}: gradient checkpointing requested "
            "(memory.gradient_checkpointing) but the model reports it off after enabling it"
        )


def lr_lambda(preset: Preset):
    """LR multiplier per step: linear warmup, then constant or cosine to zero."""
    warmup, total, kind = (
        preset.scheduler.warmup_steps,
        preset.max_steps,
        preset.scheduler.scheduler,
    )

    def f(i: int) -> float:
        if warmup and i < warmup:
            return (i + 1) / warmup
        if kind == "cosine":
            progress = (i - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return f


def make_optimizer(preset: Preset, params: list[torch.nn.Parameter]):
    opt = torch.optim.AdamW(
        params,
        lr=preset.learning_rate,
        betas=preset.optimizer.betas,
        eps=preset.optimizer.eps,
        weight_decay=preset.optimizer.weight_decay,
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(preset))


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of one step's batch, noise and sigmas: a function of (seed, step) only."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))


def pinned_mb(strategy: Any) -> float:
    """Pinned (or pool) host bytes the strategy holds, in MB (0 without a pool)."""
    for name in ("pinned_bytes", "pool_bytes"):
        value = getattr(strategy, name, None)
        if value is not None:
            return float(value() if callable(value) else value) / MB
    return 0.0


@dataclass
class LoopState:
    steps_done: int
    stopped: str | None = None  # "stop" | "sigterm" when cancelled


def run_steps(
    *,
    preset: Preset,
    family: Family,
    model: torch.nn.Module,
    trainable: list[torch.nn.Parameter],
    strategy,
    optimizer,
    scheduler,
    data: Batchable,
    start_step: int,
    device: torch.device,
    dtype: torch.dtype,
    telemetry,
    between_steps,
    on_step,
    run_dir: Path,
    after_step=lambda step: None,
    recovery: OomRecovery | None = None,
) -> LoopState:
    """Steps ``start_step + 1 .. max_steps``. ``between_steps()`` returns a stop reason or None;
    ``after_step(step)`` runs as the step's strategy step closes (its counters are the step's:
    no validation step has run yet); ``on_step(step, loss, step_s)`` reports progress.
    Checkpoints every ``checkpoint_every``. A step out of device memory is undone and run again
    under lowered limits (``recovery``: the run's, NOTE [ Out-of-memory recovery ]).

    Raises:
        OutOfMemoryEnd: a step no lowering made fit (``backend/workbench/worker/recovery.py``).
    """

    proc = psutil.Process()
    state = LoopState(steps_done=start_step)
    clip = preset.grad_clip if preset.grad_clip is not None else float("inf")
    recovery = recovery or OomRecovery(telemetry)
    for step in range(start_step + 1, preset.max_steps + 1):
        reason = between_steps()
        if reason:
            state.stopped = reason
            break
        rollback = Rollback(trainable, optimizer, scheduler)
        attempt = 0
        while True:  # NOTE [ Out-of-memory recovery ] (backend/workbench/worker/recovery.py)
            try:
                loss, grad_norm, rows, step_s = train_step(
                    preset, family, model, trainable, strategy, optimizer, scheduler, data,
                    step, device, dtype, clip, rollback,
                )  # fmt: skip
                break
            except torch.OutOfMemoryError as exc:
                attempt += 1
                recovery.recover(exc, strategy, step, rollback.phase, attempt, rollback.restore)
        state.steps_done = step
        after_step(step)

        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss is {loss_value} at step {step}")
        val = {}
        if preset.validation_every and step % preset.validation_every == 0 and data.held_out:
            val["val_loss"] = validation_loss(family, model, strategy, data, preset, step, dtype)
        telemetry.step, telemetry.phase = step, None
        snap = strategy.snapshot()
        telemetry.emit(
            "trainer",
            "step",
            **val,
            loss=loss_value,
            grad_norm=float(grad_norm),
            lr=scheduler.get_last_lr()[0],
            step_time_ms=step_s * 1e3,
            samples_per_s=len(rows) / step_s,
            vram_allocated_mb=snap["vram_allocated_mb"],
            vram_reserved_mb=snap["vram_reserved_mb"],
            vram_peak_mb=snap["vram_peak_mb"],
            vram_source=snap["vram_source"],
            rss_mb=proc.memory_info().rss / MB,
            pinned_mb=pinned_mb(strategy),
            phase_ms={
                k: strategy.phase_ms.get(k, 0.0) for k in ("forward", "backward", "optimizer")
            },
        )
        telemetry.flush()
        on_step(step, loss_value, step_s)
        if preset.checkpoint_every and step % preset.checkpoint_every == 0:
            save_checkpoint(run_dir, step, model, optimizer, scheduler)
    return state


def train_step(
    preset: Preset,
    family: Family,
    model: torch.nn.Module,
    trainable: list[torch.nn.Parameter],
    strategy,
    optimizer,
    scheduler,
    data: Batchable,
    step: int,
    device: torch.device,
    dtype: torch.dtype,
    clip: float,
    rollback: Rollback,
) -> tuple[torch.Tensor, torch.Tensor, list[int], float]:
    """One training step: its batch, noise and sigmas from ``step_generator(seed, step)``,
    forward, backward and the optimizer under the strategy's phases. Returns ``(loss,
    grad_norm, rows, seconds)``. ``rollback.phase`` follows the phase running; its copy of the
    trainable state is taken before the optimizer phase (``Rollback.before_optimizer``).

    Raises:
        torch.OutOfMemoryError: the step ran out of device memory (the caller recovers).
    """
    g = step_generator(preset.seed, step)
    rows = batch_rows(data, preset.batch_size, g)
    x0 = torch.stack([data.latents[i] for i in rows]).to(device, dtype)  # (B, C, [F,] h, w)
    noise = torch.randn(x0.shape, generator=g).to(device, dtype)
    # flow: t = sigma (B,) in [0, 1]; ddpm: t = (B,) int timesteps (families.py)
    x_t, t, target = family.training_pair(x0, noise, g, preset)
    text = data.text_rows([data.caption_rows[i] for i in rows], device, dtype)

    t0 = time.perf_counter()
    with strategy.step(step):
        rollback.phase = "forward"
        with strategy.forward():
            pred = family.predict(model, x_t, t, text)
            loss = torch.nn.functional.mse_loss(pred.float(), target.float())
        rollback.phase = "backward"
        with strategy.backward():
            loss.backward()
        rollback.before_optimizer()
        with strategy.optimizer(optimizer):
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm, rows, time.perf_counter() - t0


VALIDATION_SIGMAS = (0.25, 0.5, 0.75)
"""The fixed sigmas of the validation loss: one per held-out sample and sigma (no shift, so the
figure is comparable across runs and schedulers)."""


def validation_loss(
    family: Family,
    model: torch.nn.Module,
    strategy,
    data: Batchable,
    preset: Preset,
    step: int,
    dtype: torch.dtype,
) -> float:
    """Mean training loss on ``data.held_out`` at ``VALIDATION_SIGMAS`` (a DDPM family maps
    them to timesteps: ``family.validation_pair``) with noise drawn from ``preset.seed`` alone
    (the same noise at every validation), as one inference step of the strategy (STEP_BEGIN ->
    FORWARD -> STEP_END) under ``torch.no_grad``.

    Raises:
        ValueError: the family has no validation loss (the factory UNet family).
    """
    family.check_validation()  # before the strategy's step opens
    device = strategy.device
    losses = []
    was_training = model.training
    model.eval()
    with torch.no_grad(), strategy.step(step), strategy.forward():
        for i in data.held_out:
            g = torch.Generator().manual_seed(preset.seed * 7919 + i)
            x0 = data.latents[i][None].to(device, dtype)  # (1, C, [F,] h, w)
            noise = torch.randn(x0.shape, generator=g).to(device, dtype)
            text = data.text_rows([data.caption_rows[i]], device, dtype)
            for s in family.validation_sigmas(VALIDATION_SIGMAS):
                x_t, t, target = family.validation_pair(x0, noise, s)
                pred = family.predict(model, x_t, t, text)
                losses.append(torch.nn.functional.mse_loss(pred.float(), target.float()))
    model.train(was_training)
    return float(torch.stack(losses).mean())


def batch_rows(data: Batchable, batch_size: int, g: torch.Generator) -> list[int]:
    return batch_indices(data.groups, batch_size, g)
