"""The noise schedules the families train and sample on: rectified flow's sigmas and pairs,
and the SD 1.x DDPM schedule with its DDIM sampler (``families.py`` says which family uses
which). Sigmas are (B,) in [0, 1]; latents (B, C, [F,] h, w)."""

from __future__ import annotations

from typing import Any

import torch

NUM_TRAIN_TIMESTEPS = 1000


def ddpm_scheduler(prediction_type: str = "epsilon"):
    """The SD 1.x training noise schedule: 1000 steps, ``scaled_linear`` betas 0.00085..0.012."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        num_train_timesteps=NUM_TRAIN_TIMESTEPS,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type=prediction_type,
        clip_sample=False,
    )


def ddim_sample(
    family: Any,
    model: torch.nn.Module,
    x: torch.Tensor,
    text: Any,
    steps: int,
    prediction_type: str = "epsilon",
) -> torch.Tensor:
    """DDIM (eta 0) from noise ``x`` (n, C, h, w) to latents, on the DDPM training schedule;
    ``family.predict`` gives the noise (or velocity) at each integer timestep."""
    from diffusers import DDIMScheduler

    sched = DDIMScheduler.from_config(
        ddpm_scheduler(prediction_type).config, set_alpha_to_one=False
    )
    sched.set_timesteps(steps)
    x = x * sched.init_noise_sigma
    for t in sched.timesteps:
        ts = torch.full((x.shape[0],), int(t), device=x.device, dtype=torch.long)
        pred = family.predict(model, x, ts, text)  # noise (or velocity), (n, C, h, w)
        x = sched.step(pred, int(t), x).prev_sample
    return x


def sample_sigmas(
    n: int, distribution: str, generator: torch.Generator, mean: float = 0.0, std: float = 1.0
) -> torch.Tensor:
    """(n,) sigmas in (0, 1): ``uniform`` or ``logit_normal`` (SD3 paper, sigmoid(N(mean, std)))."""
    if distribution == "uniform":
        return torch.rand(n, generator=generator)
    if distribution == "logit_normal":
        return torch.sigmoid(torch.randn(n, generator=generator) * std + mean)
    raise ValueError(f"timestep_distribution {distribution!r}: expected uniform or logit_normal")


def euler_sigmas(steps: int) -> torch.Tensor:
    """(steps + 1,) the sigmas of the flow sampler's Euler steps, 1 (noise) down to 0: the model
    is evaluated at the first ``steps`` of them (1, 1 - 1/steps, ..., 1/steps)."""
    return torch.linspace(1.0, 0.0, steps + 1)


def flow_pair(
    x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, target)`` of rectified flow: x_t = (1 - s) x0 + s noise, target = noise - x0."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise, noise - x0
