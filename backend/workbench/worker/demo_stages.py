"""The demo assets as build stages (``backend/workbench/worker/assets/stages.py``), in the order the ``default``
preset needs them::

    digits         1,797 PNG + caption pairs       <cache>/data/digits-64px/
    demo VAE       100 steps (~40 s on one core)    <cache>/build/flux-small-digits/vae/
    demo base      300 steps of 8 (~2 min)          <cache>/build/flux-small-digits/base/
    demo samples   the build's sample check, then   <cache>/models/flux-small-digits/
                   the demo folder assembled
    factory models the random-initialised models   <cache>/models/<arch>-<size>/
                   other presets use (seconds)

Each stage's output is written by ``cache.build_once`` (a temp folder renamed into place, with a
``.complete`` marker holding the hash of what it was built from), so a build stopped anywhere
resumes at the first stage whose output is missing, and nothing complete is rebuilt. The
intermediate ``build/`` folders are removed once the demo folder is assembled; the demo folder's
bytes are those of a build in one go (``tests/worker/test_demo.py``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from workbench.worker.asset_status import demo_folder, digits_folder
from workbench.worker.assets.cache import build_once, cache_root, is_complete, spec_hash
from workbench.worker.assets.digits import NUM_DIGITS, build_digits, digit_pixels, digits_spec
from workbench.worker.assets.models import (
    ARCHS,
    DEFAULT_SIZES,
    TARGET_SHARDS,
    build_model,
    model_dir,
    model_spec,
)
from workbench.worker.assets.stages import Stage, build_lock
from workbench.worker.demo import (
    DEMO,
    CoreShare,
    DemoSpec,
    caption_text,
    demo_dir,
    demo_key,
    deterministic,
    encode,
    pretrain_base,
    sample_check,
    threads_reproducible,
    train_vae,
)

# A-priori seconds per unit (one core of a 2-core cloud VM, torch 2.13 CPU), shown as the
# estimate until a stage has measured its own rate.
DIGITS_S_PER_IMAGE = 0.0015
VAE_S_PER_STEP = 0.35
BASE_S_PER_STEP = 0.40  # on both cores of an idle machine (0.59 on one)
SAMPLES_S = 8.0
FACTORY_S_PER_MODEL = 0.5

Say = Callable[[str], None]


def _pixels(spec: DemoSpec) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(pixels (N, 3, H, W) in [-1, 1], labels (N,), training count)``, as the trainer sees
    the digits (grey replicated to RGB)."""
    images, labels = digit_pixels(spec.resolution)
    pixels = torch.from_numpy(images).float().div(127.5).sub(1.0)  # (N, H, W)
    pixels = pixels[:, None].expand(-1, 3, -1, -1).contiguous()  # (N, 3, H, W)
    return pixels, torch.from_numpy(labels), len(pixels) - spec.held_out


def model_stages(root: Path, spec: DemoSpec = DEMO, log: Say | None = None) -> list[Stage]:
    """The stages that train the demo VAE and base model into ``root`` (``demo_dir``)."""
    say = log or (lambda line: None)
    key = demo_key(spec)
    final_rel = demo_folder(spec.size)
    final, work = root / final_rel, root / "build" / f"flux-{spec.size}-digits"
    digest = spec_hash(key)
    part_keys = {name: {**key, "stage": name} for name in ("vae", "base")}

    def done(name: str) -> bool:
        return is_complete(final, digest) or is_complete(work / name, spec_hash(part_keys[name]))

    def vae(advance: Callable[[int], None]) -> None:
        def _build(tmp: Path) -> None:
            say(f"training the demo VAE and flux-{spec.size} on the digits into {final} (once)")
            with deterministic():
                pixels, _, n_train = _pixels(spec)
                model, report = train_vae(pixels[:n_train], pixels[n_train:], spec, advance)
                model.save_pretrained(tmp / "vae", safe_serialization=True)
            (tmp / "report.json").write_text(json.dumps(report))
            say(
                f"demo vae: {spec.vae_steps} steps, held-out MSE {report['held_out_mse']:.4f} "
                f"(random VAE {report['random_held_out_mse']:.4f})"
            )

        build_once(work / "vae", part_keys["vae"], _build)

    def base(advance: Callable[[int], None]) -> None:
        def _build(tmp: Path) -> None:
            from diffusers import AutoencoderKL  # here, not where the stages are listed

            # Measures from here: the first steps' threads too.
            cores = CoreShare() if threads_reproducible() else None
            with deterministic():
                pixels, labels, n_train = _pixels(spec)
                latents = encode(AutoencoderKL.from_pretrained(work / "vae" / "vae"), pixels)
                text = caption_text(spec.max_tokens)
                model, losses = pretrain_base(
                    latents[:n_train], labels[:n_train], text, spec, advance, cores
                )
                total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
                shard = max(1, math.ceil(total / TARGET_SHARDS[spec.size]))
                model.save_pretrained(
                    tmp / "transformer", safe_serialization=True, max_shard_size=shard
                )
            report = {"steps": spec.base_steps, "loss_first": losses[0], "loss_last": losses[-1]}
            report["loss_last_10_mean"] = sum(losses[-10:]) / len(losses[-10:])
            (tmp / "report.json").write_text(json.dumps(report))
            say(
                f"demo base: {spec.base_steps} steps, loss {losses[0]:.3f} -> "
                f"{report['loss_last_10_mean']:.3f}, threads per 10 steps {cores.chosen}"
            )

        build_once(work / "base", part_keys["base"], _build)

    def samples(advance: Callable[[int], None]) -> None:
        def _build(tmp: Path) -> None:
            from diffusers import AutoencoderKL, FluxTransformer2DModel

            with deterministic():
                pixels, labels, n_train = _pixels(spec)
                vae_model = AutoencoderKL.from_pretrained(work / "vae" / "vae")
                model = FluxTransformer2DModel.from_pretrained(work / "base" / "transformer")
                text = caption_text(spec.max_tokens)
                check = sample_check(
                    model, vae_model, text, pixels[n_train:], labels[n_train:], spec
                )
            report = {"train_digits": n_train, "held_out_digits": spec.held_out}
            report["vae"] = json.loads((work / "vae" / "report.json").read_text())
            report["base"] = json.loads((work / "base" / "report.json").read_text())
            report["samples"] = check
            shutil.copytree(work / "vae" / "vae", tmp / "vae")
            shutil.copytree(work / "base" / "transformer", tmp / "transformer")
            (tmp / "demo.json").write_text(json.dumps({"spec": asdict(spec), **report}, indent=1))
            say(f"demo samples: nearest class mean = prompt's digit {check['matches']}/10")

        build_once(final, key, _build)
        shutil.rmtree(work, ignore_errors=True)
        advance(1)

    return [
        Stage("demo VAE", spec.vae_steps, "steps", vae, lambda: done("vae"), VAE_S_PER_STEP),
        Stage("demo base", spec.base_steps, "steps", base, lambda: done("base"), BASE_S_PER_STEP),
        Stage(
            "demo samples",
            1,
            "check",
            samples,
            lambda: is_complete(final, digest),
            SAMPLES_S,
            provides={final_rel: digest},
        ),
    ]


def all_stages(root: Path, spec: DemoSpec = DEMO, log: Say | None = None) -> list[Stage]:
    """Every stage of ``workbench demo-assets``: the digits, the demo model, the factory models."""
    size = spec.resolution
    digits_digest = spec_hash(digits_spec(size))
    models = [(arch, s) for s in DEFAULT_SIZES for arch in ARCHS]

    def digits(advance: Callable[[int], None]) -> None:
        build_digits(root, size, advance)

    def factory(advance: Callable[[int], None]) -> None:
        for arch, s in models:
            build_model(arch, s, root)
            advance(1)

    def factory_done() -> bool:
        return all(
            is_complete(model_dir(a, s, root), spec_hash(model_spec(a, s))) for a, s in models
        )

    return [
        Stage(
            "digits",
            NUM_DIGITS,
            "images",
            digits,
            lambda: is_complete(root / digits_folder(size), digits_digest),
            DIGITS_S_PER_IMAGE,
            provides={digits_folder(size): digits_digest},
        ),
        *model_stages(root, spec, log),
        Stage("factory models", len(models), "models", factory, factory_done, FACTORY_S_PER_MODEL),
    ]


def build_demo(
    cache_dir: str | os.PathLike | None = None,
    spec: DemoSpec = DEMO,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Train (once) the demo VAE and base transformer; return the folder holding ``vae/``,
    ``transformer/`` and ``demo.json``. ``log`` gets a line per phase (the build takes minutes).
    The same stages as ``workbench demo-assets`` (``model_stages``) under its lock
    (waiting for a build in progress), without its status file: a stage already built is kept.
    """
    root = cache_root(cache_dir)  # created and checked writable
    with build_lock(root, log):
        for stage in model_stages(root, spec, log):
            if not stage.complete():
                stage.build(lambda n: None)
    return demo_dir(cache_dir, spec)
