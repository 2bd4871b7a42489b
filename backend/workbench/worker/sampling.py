"""A run's sample images: when they are drawn, under which names, and their records.

Samples are drawn before the first step (the model the final ones are set against), every
``samples.every`` steps through the training strategy as an inference step, and at the end on
the plain model once the strategy is closed (through ``Family.inference_strategy``: a pipeline
family's blocks streamed by an inference strategy, a factory model moved onto the device). Each
image is ``DIR/samples/{prefix}-ii.png`` (``step-NNNNNN`` during training, ``sample`` at the end)
with one ``trainer/sample`` record. The images are ``Family.sample``'s: a pipeline's
``__call__``, or a factory family's sampler and the run's VAE.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stagehand.common.telemetry import Telemetry
from workbench.contract.preset import Preset
from workbench.contract.records import OOM_REQUEST
from workbench.worker import loop
from workbench.worker.families import Family, SampleSpec
from workbench.worker.recovery import OomRecovery


@dataclass
class Sampler:
    """Draws the samples of the run in ``run_dir`` for ``family`` on ``device``."""

    run_dir: Path
    family: Family
    device: torch.device
    telemetry: Telemetry
    recovery: OomRecovery | None = None
    """Out-of-memory recovery (the run's): a sample's step out of device memory is undone,
    the limits lowered and the samples drawn again (NOTE [ Out-of-memory recovery ])."""
    lowered: dict[str, Any] = field(default_factory=dict)
    """Limits the recovery lowered for the end's inference strategy (applied to the next one)."""

    def _attempts(self, draw, strategy_of, step: int) -> None:
        """``draw()`` until it fits: each ``torch.OutOfMemoryError`` goes to the recovery
        (phase ``"sampling"``) with ``strategy_of(exc)``, torch's RNG put back. Without a
        recovery the error propagates.

        Raises:
            OutOfMemoryEnd: no lowering made the samples fit.
        """
        rng = torch.get_rng_state()
        attempt = 0
        while True:
            try:
                return draw()
            except torch.OutOfMemoryError as exc:
                if self.recovery is None:
                    raise
                attempt += 1
                strategy = strategy_of(exc)
                undo = lambda: torch.set_rng_state(rng)  # noqa: E731
                self.recovery.recover(exc, strategy, step, "sampling", attempt, undo)

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
            self._attempts(
                lambda: self.draw(model, preset, data, vae_dir, step=step, strategy=strategy),
                lambda exc: strategy,
                step,
            )

    def final(
        self,
        model: torch.nn.Module,
        preset: Preset,
        data: loop.Batchable,
        vae_dir: Path,
        steps_done: int,
    ) -> None:
        """The end's samples, on the plain model after the strategy is closed (it restores
        resident weights), drawn as inference step ``steps_done`` (the last step trained: a run
        stopped at 3 of 40 has no record at a step it never ran) and tagged ``sampling=True``
        like the samples drawn during training, so charts leave the inference step out."""
        with self.telemetry.tagged(sampling=True):
            self._attempts(
                lambda: self.draw(
                    model, preset, data, vae_dir, step=None, strategy=None, number=steps_done
                ),
                lambda exc: getattr(exc, "strategy", None),
                steps_done,
            )

    def draw(
        self,
        model: torch.nn.Module,
        preset: Preset,
        data: loop.Batchable,
        vae_dir: Path,
        step: int | None,
        strategy,
        number: int | None = None,
    ) -> None:
        """One ``samples/{prefix}-ii.png`` per prompt from ``family.sample``, in eval mode
        under ``torch.no_grad`` (not inference mode mid-run: weights loaded now are used by
        training later): during training (``step``) through the training ``strategy`` as
        inference step ``step``, at the end (None) through ``family.inference_strategy``
        (closed after; inference step ``number``), each image with its ``trainer/sample``
        record."""
        prompts = preset.samples.prompts
        dtype = loop.DTYPES[preset.train_dtype]
        prefix = "sample" if step is None else f"step-{step:06d}"
        text = data.text_rows(data.prompt_rows, self.device, dtype)
        spec = SampleSpec(
            latent_shape=tuple(data.latents[0].shape),
            steps=preset.samples.steps,
            seed=preset.samples.seed,
            device=self.device,
            dtype=dtype,
            guidance=preset.samples.guidance,
            vae_dir=vae_dir,
            prediction_type=preset.prediction_type,
        )
        own = strategy is None
        if own:
            strategy = self.family.inference_strategy(
                model, preset.memory, self.device, self.telemetry
            )
            if strategy is not None and self.lowered:  # a former attempt's recovery
                strategy.set_limits(self.lowered, request_id=OOM_REQUEST)
        was_training = model.training
        model.eval()
        try:
            number = step if number is None else number
            streamed = strategy is not None
            with (
                torch.no_grad(),
                strategy.step(number) if streamed else nullcontext(),
                strategy.forward() if streamed else nullcontext(),
            ):
                images = self.family.sample(model, text, spec)
        except torch.OutOfMemoryError as exc:
            if own and strategy is not None and self.recovery is not None:
                exc.strategy = _Closing(strategy, self)  # its limits, lowered for the next one
            raise
        finally:
            model.train(was_training)
            if own and strategy is not None:
                strategy.close()
        out_dir = self.run_dir / "samples"
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = [out_dir / f"{prefix}-{i:02d}.png" for i in range(len(prompts))]
        for image, path in zip(images, paths, strict=True):
            image.save(path)
        for path, prompt in zip(paths, prompts, strict=True):
            rel = str(path.relative_to(self.run_dir))
            self.telemetry.emit("trainer", "sample", path=rel, prompt=prompt)


class _Closing:
    """The end's inference strategy after an out-of-memory error, as the recovery sees it: its
    limits and memory are read, the lowered limits kept (``Sampler.lowered``) for the strategy
    the next attempt builds; it is closed by ``draw``."""

    def __init__(self, strategy, sampler: Sampler) -> None:
        self.strategy, self.sampler = strategy, sampler
        self.memory = strategy.memory

    def limits(self) -> dict[str, Any]:
        return self.strategy.limits()

    def abort_step(self) -> None:
        """Nothing: ``draw`` closes the strategy (every runtime freed)."""

    def set_limits(self, limits: dict[str, Any], request_id: str | None = None) -> None:
        self.sampler.lowered.update(limits)
