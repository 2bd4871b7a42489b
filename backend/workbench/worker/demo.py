"""The embedded demo's trained models: a VAE trained on the digits and the Flux-style base
transformer pre-trained on their latents and captions, so that the default run's samples are
handwritten digits that follow their prompts (a random VAE decodes anything to colour noise).

Built once, at asset-build time (``workbench demo-assets``, or the first run that needs it), into
``<cache>/models/flux-<size>-digits/``::

    vae/            AutoencoderKL (the tiny VAE's config), ``scaling_factor`` and
                    ``shift_factor`` set from its latents on the digits (unit variance, zero mean)
    transformer/    FluxTransformer2DModel (``MODEL_SPECS[("flux", size)]``), sharded like the
                    factory's models, which is what the weight runtime streams
    demo.json       the spec and what the build measured (losses, held-out reconstruction error
                    against the random VAE's, which digit each prompt's samples are nearest to)

Deterministic: ``torch.use_deterministic_algorithms``, every draw from a seeded
``torch.Generator``, one thread wherever the thread count changes the result (NOTE [ Demo
pre-training ], "Threads"); the same spec, torch and diffusers give the same bytes, and the folder's
``.complete`` marker (a hash of all three) makes a second build a no-op. The last
``held_out`` digits are seen by neither model, so the build's figures are measured on digits
they were not trained on.

NOTE [ Demo pre-training ]
The base is trained with the trainer's own loss (``FluxFamily``: rectified flow, the velocity
``noise - x0``, guidance 1) on the text the trainer caches (all-MiniLM-L6-v2, padded to
``max_tokens``), so the LoRA run continues what the base learned rather than starting another
task. It has to be brief, because ``default`` cannot start before it ends: 300 steps of 8
(~3 CPU minutes on one thread). Three choices make that enough, measured on the demo's model
and data, 100 samples read by a logistic-regression classifier fitted on the real 8x8 digits:

- sigmas: only the ``sample_steps`` sigmas at which the Euler sampler evaluates the model (1,
  7/8, ..., 1/8), not the trainer's logit-normal draws, which seldom come near sigma 1 where
  each sample's digit is decided. With the same 3,200 samples seen, 65 of 100 samples read as
  their prompt's digit against 31 (uniform sigmas: 48). The LoRA run then trains on the
  preset's distribution, as before;
- batch 8 rather than 32: in so short a run more updates of fewer samples learn more per
  sample (400 steps of 8: 31 read, against 8 for 100 steps of 32, logit-normal both);
- a cosine decay of the learning rate to 0 after the warmup (``warmup_cosine``), with AdamW
  fused into one kernel per step.

The old recipe (300 steps of 32 on logit-normal sigmas at a constant 5e-4 after the warmup,
629 CPU seconds on this project's machine) read 66 of 100; this one reads 56 to 64 (the build,
a run with other draws) in 176, and the build's own check (``demo.json``) finds 6 of the 10
prompts' mean samples nearest their own digit with either. Fewer steps fall off fast: 200 steps
of 8 read 27. The default run's LoRA (160 steps of 8) changes the samples only a little; the run
page shows its step-0 samples beside the last ones.

Threads. The base's bytes do not depend on how many threads train it (its matrix products and
reductions split the work, not the sums; ``tests/worker/test_demo.py`` checks 1 against 3) when
MKL runs in its strict reproducible mode (``threads_reproducible``; without it an AVX-512
machine's MKL splits the sums of small products too), so it takes the cores no other process
is using (``CoreShare``, asked every 10 steps): on this project's 2-core machine, idle, a step
of 8 takes 470 ms on two threads against 717 on one. It never takes a busy core: with another
process spinning on the second core, two threads took 1,564 ms a step (OpenMP's threads wait on
each other while the other process holds the core). The VAE and the sample check stay on one
thread: their convolutions' results change with the thread count.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from workbench.worker.asset_status import demo_folder
from workbench.worker.assets.cache import cache_root, library_version
from workbench.worker.assets.digits import caption_for
from workbench.worker.assets.models import MODEL_SPECS, check_spec, instantiate
from workbench.worker.assets.text_encoder import load_text_encoder
from workbench.worker.families import FluxFamily, Text
from workbench.worker.schedules import euler_sigmas, flow_pair, sample_sigmas

#: The demo VAE: the factory's tiny AutoencoderKL (81K parameters, 8x down, 4 latent channels).
#: The digits are 8x8 images upscaled; with the demo's 100 steps it reconstructs held-out ones to a
#: mean squared error of 0.015 in [-1, 1] pixels (0.010 after the old 200 steps at a constant
#: rate, the random VAE: 0.69), which the base's samples do not show.
VAE_CONFIG = MODEL_SPECS[("vae", "tiny")]


BASE_SIGMAS = ("sampler", "logit_normal", "uniform")


@dataclass(frozen=True)
class DemoSpec:
    """What the demo build trains. The defaults are the demo's (``demo_stages.build_demo``); tests pass a
    smaller one (a tiny transformer, fewer steps)."""

    size: str = "small"
    """The Flux-style transformer's factory size (the default preset trains ``small``)."""
    resolution: int = 64
    """Pixels per side (the default preset's ``resolution``): 8x8 latents, 16 packed tokens."""
    held_out: int = 97
    """The last digits, trained on by neither model (1,700 of the 1,797 are)."""
    vae_steps: int = 100
    vae_batch: int = 24
    vae_lr: float = 3e-3
    vae_warmup_steps: int = 5
    kl_weight: float = 1.0
    """KL term per latent image against the summed L1 + L2 loss per pixel (x 1 / pixels)."""
    base_steps: int = 300
    base_batch: int = 8
    base_lr: float = 1.5e-3
    warmup_steps: int = 20
    """The base's linear warmup; both models' learning rates then decay to 0 on a cosine."""
    base_sigmas: str = "sampler"
    """Where the base is trained along the flow: ``sampler``, the ``sample_steps`` sigmas the
    Euler sampler evaluates (NOTE [ Demo pre-training ]), or a ``sample_sigmas`` distribution
    (``logit_normal``, the trainer's; ``uniform``)."""
    max_tokens: int = 16
    """Caption tokens, padded: the default preset's ``data.max_caption_tokens``."""
    sample_steps: int = 8
    """Euler steps of the build's own sample check (the default preset's ``samples.steps``)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.base_sigmas not in BASE_SIGMAS:
            raise ValueError(
                f"base_sigmas: expected one of {BASE_SIGMAS}, got {self.base_sigmas!r}"
            )


DEMO = DemoSpec()

SPEC_ENV = "STAGEHAND_WORKBENCH_DEMO_SPEC"
"""A JSON object of ``DemoSpec`` fields that replace the demo's for the build and the runs that
use it (``{"vae_steps": 2, "base_steps": 2}``: a build of seconds whose samples are noise; the
browser tests use it). Unset: the demo's own spec."""


def demo_spec(size: str = DEMO.size) -> DemoSpec:
    """The demo's spec for the Flux-style ``size``, with ``$STAGEHAND_WORKBENCH_DEMO_SPEC``'s fields.

    Raises:
        ValueError: the variable is not a JSON object of ``DemoSpec`` fields.
    """
    raw = os.environ.get(SPEC_ENV)
    try:
        fields = json.loads(raw) if raw else {}
        return DemoSpec(**{**fields, "size": size})
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"{SPEC_ENV}: expected a JSON object of DemoSpec fields, got {raw!r} ({exc})"
        ) from None


def demo_dir(cache_dir: str | os.PathLike | None = None, spec: DemoSpec = DEMO) -> Path:
    """Where the demo models for ``spec`` live (built or not)."""
    return cache_root(cache_dir, create=False) / demo_folder(spec.size)


def demo_key(spec: DemoSpec = DEMO) -> dict:
    """What the demo folder is built from: its ``.complete`` marker is this dict's hash."""
    check_spec("flux", spec.size)
    return {
        "demo": asdict(spec),
        "vae": VAE_CONFIG,
        "flux": MODEL_SPECS[("flux", spec.size)],
        "torch": torch.__version__.split("+")[0],
        "diffusers": library_version("diffusers"),
        "format": 1,
    }


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """One thread and deterministic kernels for the build; the caller's settings come back."""
    threads, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(strict)
        torch.set_num_threads(threads)


def threads_reproducible() -> bool:
    """Whether this process's matrix products give the same bits on any thread count: MKL with
    its strict CNR mode asked for in ``MKL_CBWR`` (``workbench.worker.preload`` sets it before
    torch is imported; MKL reads it at its first call). Without MKL (another BLAS) or without
    ``STRICT`` there is no such promise, and the demo base trains on one thread."""
    mode = os.environ.get("MKL_CBWR", "").upper().replace(" ", "").split(",")
    return torch.backends.mkl.is_available() and "STRICT" in mode


class CoreShare:
    """How many threads a loop whose results do not depend on its thread count may use now: the
    cores other processes left idle since the last call (or since it was made), at most
    ``most`` (NOTE [ Demo pre-training ]). A call less than ``MIN_INTERVAL_S`` after the last
    says what that one said (1 at first): too short an interval measures nothing.

    Other processes' load is the busy CPU time of the cores this process may run on
    (``psutil.cpu_times`` of each core in its affinity set: user, system, interrupts) less this
    process's own, over the wall time between calls. Processes at a lower priority (``nice``)
    are not counted while this one is not niced: the scheduler runs its threads first. A core is
    counted free when others used less than a quarter of it: two threads on a core another
    process holds run slower than one. A CPU quota (a container's ``--cpus``) is not seen."""

    MIN_INTERVAL_S = 0.5

    def __init__(self, most: int = 4) -> None:
        count = len(psutil.cpu_times(percpu=True))  # psutil's per-core list, by core number
        mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(count)
        self._cpus = sorted(c for c in mine if c < count)
        self.cores = len(self._cpus) or 1
        self.most = max(1, min(most, self.cores))
        self._process = psutil.Process()
        self._last = self._sample()
        self.chosen: list[int] = []
        """What each call said, in order."""

    def _sample(self) -> tuple[float, float, float]:
        """``(wall s, busy CPU s of this process's cores, own CPU s)``."""
        niced = self._process.nice() > 0  # then this process's own time is under ``nice``
        per_core = psutil.cpu_times(percpu=True)
        busy = 0.0
        for m in (per_core[c] for c in self._cpus):
            busy += m.user + m.system + getattr(m, "irq", 0.0) + getattr(m, "softirq", 0.0)
            busy += getattr(m, "nice", 0.0) if niced else 0.0
        own = self._process.cpu_times()
        return time.monotonic(), busy, own.user + own.system

    def threads(self) -> int:
        """Threads for the next interval (1 .. ``most``)."""
        now, last = self._sample(), self._last
        n = self.chosen[-1] if self.chosen else 1
        if now[0] - last[0] >= self.MIN_INTERVAL_S:
            self._last = now
            others = max(0.0, (now[1] - last[1]) - (now[2] - last[2])) / (now[0] - last[0])
            n = max(1, min(self.most, int(self.cores - others + 0.25)))
        self.chosen.append(n)
        return n


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate factor after ``s`` steps (``LambdaLR``): linear from 1/warmup to 1 over
    ``warmup`` steps, then a cosine down to 0 at step ``total``. A run this short ends far from
    converged; letting the rate fall to 0 lowers the loss it ends at more than more constant-rate
    steps would (NOTE [ Demo pre-training ])."""
    warmup = max(1, warmup)

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, total - warmup))))

    return factor


def _loss_vae(vae, x: torch.Tensor, g: torch.Generator, spec: DemoSpec) -> torch.Tensor:
    post = vae.encode(x).latent_dist
    z = post.mean + post.std * torch.randn(post.mean.shape, generator=g)  # (B, 4, h, w)
    err = vae.decode(z).sample - x  # (B, 3, H, W)
    per_pixel = err.abs().mean() + err.pow(2).mean()
    return per_pixel + spec.kl_weight * post.kl().mean() / x[0].numel()


@torch.no_grad()
def reconstruction_mse(vae, x: torch.Tensor) -> float:
    """Mean squared error of ``decode(encode(x).mean)`` on pixels ``x`` (N, 3, H, W) in [-1, 1]."""
    vae.eval()
    errs = [
        (vae.decode(vae.encode(b).latent_dist.mean).sample - b).pow(2).mean() * len(b)
        for b in x.split(64)
    ]
    return float(sum(errs) / len(x))


def train_vae(
    train: torch.Tensor,
    held: torch.Tensor,
    spec: DemoSpec,
    advance: Callable[[int], None] | None = None,
):
    """``(vae, report)``: the demo AutoencoderKL trained on ``train`` (N, 3, H, W) in [-1, 1]
    (L1 + L2 reconstruction of a posterior sample, a small KL term), with ``scaling_factor`` and
    ``shift_factor`` set so the trainer's latents ``(mean - shift) * scale`` have zero mean and
    unit variance. The report gives held-out MSE before (random init) and after. ``advance(1)``
    is called after each step."""
    from diffusers import AutoencoderKL

    torch.manual_seed(spec.seed)
    vae = AutoencoderKL(**VAE_CONFIG)
    random_mse = reconstruction_mse(vae, held)
    vae.train()
    # fused: one kernel for the whole update instead of a dozen per parameter (the same maths).
    opt = torch.optim.AdamW(vae.parameters(), lr=spec.vae_lr, weight_decay=0.0, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine(spec.vae_warmup_steps, spec.vae_steps)
    )
    g = torch.Generator().manual_seed(spec.seed)
    for _ in range(spec.vae_steps):
        idx = torch.randint(len(train), (spec.vae_batch,), generator=g)
        loss = _loss_vae(vae, train[idx], g, spec)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if advance is not None:
            advance(1)
    vae.eval()
    with torch.no_grad():
        z = torch.cat([vae.encode(b).latent_dist.mean for b in train.split(64)])  # (N, 4, h, w)
    vae.register_to_config(scaling_factor=float(1.0 / z.std()), shift_factor=float(z.mean()))
    report = {
        "steps": spec.vae_steps,
        "random_held_out_mse": random_mse,
        "held_out_mse": reconstruction_mse(vae, held),
        "scaling_factor": vae.config.scaling_factor,
        "shift_factor": vae.config.shift_factor,
    }
    return vae, report


@torch.no_grad()
def encode(vae, pixels: torch.Tensor) -> torch.Tensor:
    """(N, 4, h, w) latents as the trainer caches them: ``(mean - shift) * scale``."""
    z = torch.cat([vae.encode(b).latent_dist.mean for b in pixels.split(64)])
    return (z - vae.config.shift_factor) * vae.config.scaling_factor


def caption_text(max_tokens: int):
    """``families.Text`` with one row per digit 0..9 (its caption), as stage 1 caches captions:
    all-MiniLM-L6-v2's last hidden state padded to ``max_tokens``, the mask, the masked mean."""

    tokenizer, encoder = load_text_encoder()
    tok = tokenizer(
        [caption_for(k) for k in range(10)],
        padding="max_length",
        truncation=True,
        max_length=max_tokens,
        return_tensors="pt",
    )
    with torch.inference_mode():
        hidden = encoder(**tok).last_hidden_state.float()  # (10, T, 384)
    mask = tok["attention_mask"]  # (10, T)
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
    return Text(hidden=hidden.clone(), mask=mask.clone(), pooled=pooled.clone())


def _rows(text, k: torch.Tensor):
    return Text(hidden=text.hidden[k], mask=text.mask[k], pooled=text.pooled[k])


def train_sigmas(n: int, spec: DemoSpec, g: torch.Generator) -> torch.Tensor:
    """(n,) sigmas for the base's training pairs, as ``spec.base_sigmas`` says."""
    if spec.base_sigmas != "sampler":
        return sample_sigmas(n, spec.base_sigmas, g)
    grid = euler_sigmas(spec.sample_steps)[:-1]  # (sample_steps,) 1 .. 1 / sample_steps
    return grid[torch.randint(len(grid), (n,), generator=g)]


def pretrain_base(
    latents: torch.Tensor,
    labels: torch.Tensor,
    text,
    spec: DemoSpec,
    advance: Callable[[int], None] | None = None,
    cores: CoreShare | None = None,
):
    """``(model, losses)``: the Flux-style transformer trained from its factory init on
    ``latents`` (N, 4, h, w) with their captions' ``text`` rows (NOTE [ Demo pre-training ]);
    ``advance(1)`` after each step. ``cores``: every 10 steps, the threads it says (the caller's
    thread count is set again after); None, the caller's thread count throughout."""

    family = FluxFamily()
    model = instantiate("flux", spec.size, seed=spec.seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.base_lr, weight_decay=0.0, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine(spec.warmup_steps, spec.base_steps)
    )
    g = torch.Generator().manual_seed(spec.seed + 1)
    losses = []
    before = torch.get_num_threads()
    for step in range(spec.base_steps):
        if cores is not None and step % 10 == 0:
            torch.set_num_threads(cores.threads())
        idx = torch.randint(len(latents), (spec.base_batch,), generator=g)
        x0 = latents[idx]  # (B, 4, h, w)
        noise = torch.randn(x0.shape, generator=g)
        sigma = train_sigmas(len(idx), spec, g)  # (B,)
        x_t, target = flow_pair(x0, noise, sigma)
        loss = (family.predict(model, x_t, sigma, _rows(text, labels[idx])) - target).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if advance is not None:
            advance(1)
    torch.set_num_threads(before)
    return model.eval(), losses


@torch.no_grad()
def sample_digits(model, vae, text, per_digit: int, spec: DemoSpec) -> torch.Tensor:
    """(10 * per_digit, H, W) grey images in [-1, 1] for the prompts of digits 0..9 (row
    ``k * per_digit + j`` is digit k), with the trainer's Euler sampler and a fixed seed."""

    family = FluxFamily()
    k = torch.arange(10).repeat_interleave(per_digit)  # (n,)
    side = spec.resolution // 8
    x = torch.randn(len(k), 4, side, side, generator=torch.Generator().manual_seed(spec.seed))
    sigmas = euler_sigmas(spec.sample_steps)  # (sample_steps + 1,)
    for i in range(spec.sample_steps):
        s = torch.full((len(k),), float(sigmas[i]))
        x = x + (sigmas[i + 1] - sigmas[i]) * family.predict(model, x, s, _rows(text, k))
    z = x / vae.config.scaling_factor + vae.config.shift_factor
    return vae.decode(z).sample.clamp(-1, 1).mean(1)  # (n, H, W)


def nearest_class_means(
    images: torch.Tensor, pixels: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """(n,) the digit whose mean image (over ``pixels`` (N, 3, H, W) of ``labels``) is nearest,
    in L2, to each of ``images`` (n, H, W)."""
    means = torch.stack([pixels[labels == d, 0].mean(0) for d in range(10)])  # (10, H, W)
    dist = (images[:, None] - means[None]).pow(2).flatten(2).sum(-1)  # (n, 10)
    return dist.argmin(1)


def sample_check(model, vae, text, pixels, labels, spec: DemoSpec, per_digit: int = 4) -> dict:
    """Which digit's mean image (over ``pixels``, held-out digits) each prompt's samples are
    nearest to: ``matches`` counts the prompts whose mean sample is nearest its own digit."""
    images = sample_digits(model, vae, text, per_digit, spec)  # (10 * per_digit, H, W)
    per_prompt = images.view(10, per_digit, *images.shape[1:]).mean(1)  # (10, H, W)
    nearest = nearest_class_means(per_prompt, pixels, labels)
    each = nearest_class_means(images, pixels, labels).view(10, per_digit)
    return {
        "nearest": nearest.tolist(),
        "matches": int((nearest == torch.arange(10)).sum()),
        "sample_matches": int((each == torch.arange(10)[:, None]).sum()),
        "samples": 10 * per_digit,
    }
