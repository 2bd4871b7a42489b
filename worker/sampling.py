"""A run's sample images: when they are drawn, under which names, and their records.

Samples are drawn before the first step (the model the final ones are set against), every
``samples.every`` steps through the training strategy as an inference step, and at the end on
the plain model once the strategy is closed. Each image is ``DIR/samples/{prefix}-ii.png``
(``step-NNNNNN`` during training, ``sample`` at the end) with one ``trainer/sample`` record.
How an image is drawn is ``outputs.sample_images`` (factory families: their sampler and the
run's VAE) or ``outputs.sample_pipeline`` (the pipeline's ``__call__``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from contract.preset import Preset
from runtime.common.telemetry import Telemetry
from worker import loop
from worker.families import Family
from worker.outputs import sample_images, sample_pipeline
from worker.pipelines import PipelineFamily


@dataclass
class Sampler:
    """Draws the samples of the run in ``run_dir`` for ``family`` on ``device``."""

    run_dir: Path
    family: Family
    device: torch.device
    telemetry: Telemetry

    def during_training(
        self,
        model: torch.nn.Module,
        strategy,
        preset: Preset,
        data: loop.Batchable,
        vae_dir: Path,
        step: int,
    ) -> None:
        """Samples of ``model`` as trained so far, drawn through ``strategy`` as inference
        step ``step``; their records (and the strategy's) are tagged ``sampling=True``."""
        with self.telemetry.tagged(sampling=True):
            if isinstance(self.family, PipelineFamily):
                self.pipeline(model, preset, data, step=step, strategy=strategy)
                return
            # no_grad: the blocks loaded now serve training next.
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad(), strategy.step(step), strategy.forward():
                    self.factory(model, preset, data, vae_dir, f"step-{step:06d}")
            finally:
                model.train(was_training)

    def final(
        self, model: torch.nn.Module, preset: Preset, data: loop.Batchable, vae_dir: Path
    ) -> None:
        """The end's samples, on the plain model after the strategy is closed (it restores
        resident weights)."""
        if isinstance(self.family, PipelineFamily):
            self.pipeline(model, preset, data, step=None, strategy=None)
            return
        model.to(self.device).eval()
        self.factory(model, preset, data, vae_dir, "sample")

    def factory(
        self,
        model: torch.nn.Module,
        preset: Preset,
        data: loop.Batchable,
        vae_dir: Path,
        prefix: str,
    ) -> None:
        """One ``samples/{prefix}-ii.png`` per prompt from ``model`` (its sampler and the run's
        VAE), each with its ``trainer/sample`` record."""
        prompts = preset.samples.prompts
        dtype = loop.DTYPES[preset.train_dtype]
        paths = sample_images(
            self.family,
            model,
            data.text_rows(data.prompt_rows, self.device, dtype),
            vae_dir,
            tuple(data.latents[0].shape),
            steps=preset.samples.steps,
            seed=preset.samples.seed,
            device=self.device,
            dtype=dtype,
            out_dir=self.run_dir / "samples",
            names=[f"{prefix}-{i:02d}" for i in range(len(prompts))],
            prediction_type=preset.prediction_type,
        )
        self.record(paths, prompts)

    def pipeline(
        self,
        model: torch.nn.Module,
        preset: Preset,
        data: loop.Batchable,
        step: int | None,
        strategy,
    ) -> None:
        """Samples from the pipeline's ``__call__``: during training (``step``) through the
        training ``strategy`` as an inference step, at the end (None) through an inference one."""
        prompts = preset.samples.prompts
        dtype = loop.DTYPES[preset.train_dtype]
        prefix = "sample" if step is None else f"step-{step:06d}"
        paths = sample_pipeline(
            self.family,
            model,
            data.text_rows(data.prompt_rows, self.device, dtype),
            tuple(data.latents[0].shape),
            preset=preset,
            device=self.device,
            dtype=dtype,
            telemetry=self.telemetry,
            out_dir=self.run_dir / "samples",
            names=[f"{prefix}-{i:02d}" for i in range(len(prompts))],
            strategy=strategy if step is not None else None,
            step=step,
        )
        self.record(paths, prompts)

    def record(self, paths: list[Path], prompts: list[str]) -> None:
        """One ``trainer/sample`` record per written image, its path relative to the run."""
        for path, prompt in zip(paths, prompts, strict=True):
            rel = str(path.relative_to(self.run_dir))
            self.telemetry.emit("trainer", "sample", path=rel, prompt=prompt)
