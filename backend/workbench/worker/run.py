"""``Run``: one training run, the orchestrator ``workbench train`` drives (``cli.py``).

Stage 1 scans the data and caches text embeddings and latents (``stage1.py``), stage 2 trains
(``loop.py``) under the preset's memory strategy; samples (``sampling.py``), checkpoints, the
LoRA and the final record (``records.py``) are written into the run folder
(``docs/contracts.md``), and everything it reports goes into ONE telemetry stream,
``DIR/telemetry.jsonl``, shared with the memory strategy. This module wires them together and
handles control requests and the run's ending.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from stagehand.common.attention import apply_attention_backend
from stagehand.common.telemetry import JsonlSink, TeeStdoutSink, Telemetry
from stagehand.config import wire
from stagehand.strategy import build_strategy
from stagehand.strategy.auto import plans_activations
from workbench.contract.control import LIMITS, STOP, ControlDir
from workbench.contract.preset import Preset
from workbench.contract.records import RUN_FINISHED
from workbench.contract.status import RunStatus
from workbench.worker import loop, records
from workbench.worker.control import Interrupted, StopFlag
from workbench.worker.families import family
from workbench.worker.limits_effect import LimitsEffects, StepFigures
from workbench.worker.outputs import (
    folder_problem,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_lora,
)
from workbench.worker.preset import load_preset, validate_preset
from workbench.worker.progress import Progress
from workbench.worker.recovery import OomRecovery, OutOfMemoryEnd
from workbench.worker.sampling import Sampler
from workbench.worker.scan import Sample
from workbench.worker.setup import check_text_dim, family_targets, pipeline_family, resolve_assets
from workbench.worker.stage1 import build_cache, resolve_frames, scan_data

FLUSH_INTERVAL_S = 0.25
"""The worker's telemetry reaches its JSONL file at most this long after a record (seconds)."""

STOP_SAMPLES_S = 20.0
"""A run stopped mid-training draws its final samples when its last samples took at most this
long (seconds): the server sends SIGTERM ``stop_grace_s`` (30 s by default) after a stop request,
and a SIGTERM during the samples ends them (``StopFlag.interruptible``; the LoRA is saved first)."""


ActivationPeak = Callable[[Preset], int]
"""The planner's activation peak of a preset, in bytes (``workbench.plan.activation_peak``): what
``"auto"`` limits resolve with at build. The planner sits above the worker, so ``workbench
train`` passes it in (``backend/workbench/cli/train.py``); without it they resolve with 0."""


class Run:
    """One training run in ``run_dir``; ``execute`` returns the final status. ``activation_peak``:
    the planner's (``ActivationPeak``), or None."""

    def __init__(
        self,
        spec: str,
        run_dir: Path,
        device: torch.device,
        resume: bool,
        activation_peak: ActivationPeak | None = None,
    ) -> None:
        self.spec, self.run_dir, self.device, self.resume = spec, run_dir, device, resume
        self.activation_peak = activation_peak
        sink = JsonlSink(run_dir / wire.TELEMETRY_FILE)
        if os.environ.get(wire.STDOUT_ENV) == "1":
            sink = TeeStdoutSink(
                sink
            )  # the Ray executor's log stream (backend/workbench/executors)
        # Stage 1 (caching) writes progress for minutes before a step flushes: a time bound
        # brings each record to the dashboard within FLUSH_INTERVAL_S.
        self.telemetry = Telemetry(sink, flush_interval_s=FLUSH_INTERVAL_S)
        self.control = ControlDir(run_dir)
        self.stop = StopFlag()
        self.progress = Progress()
        self.model: torch.nn.Module | None = None
        self.vae_dir: Path | None = None
        self.strategy = None
        self.family = None
        self.steps_done = 0
        self.start_step = 0
        self.lora_path: Path | None = None
        self.saved_step: int | None = None  # the step the LoRA at lora_path was saved after
        self.sample_s: float | None = None  # seconds the last samples took to draw
        # Limits requests that arrived before the strategy was built (stage 1, loading): held
        # and applied, in order, once it exists (they take effect at its first step).
        self.held_limits: list[tuple[str | None, dict]] = []
        self.effects = LimitsEffects(self.telemetry.emit)  # what each change did, once settled
        self.recovery = OomRecovery(self.telemetry)  # NOTE [ Out-of-memory recovery ]

    # -- control ------------------------------------------------------------------------------
    def poll_control(self) -> str | None:
        """Handle pending control requests; return the stop reason, if any."""
        for req in self.control.poll():
            if req.command == STOP:
                self.stop.set(STOP)
            elif req.command == LIMITS and req.error is None:
                self.held_limits.append((req.request_id, req.body.get("limits") or {}))
                if self.strategy is None:
                    self.progress.line(f"limits request {req.request_id} held until the first step")
            else:
                why = req.error or f"command {req.command!r} not understood (or no strategy yet)"
                self._rejected(req.request_id, why)
        self.apply_held_limits()
        return self.stop.reason if self.stop.requested else None

    def apply_held_limits(self) -> None:
        """Hand the held limits requests to the strategy, once it exists: each is applied at
        its next step begin (a ``strategy/limits_applied`` record) or refused (a
        ``control_rejected`` event naming the field)."""
        while self.strategy is not None and self.held_limits:
            request_id, limits = self.held_limits.pop(0)
            try:
                self.strategy.set_limits(limits, request_id=request_id)
            except ValueError as exc:  # pydantic.ValidationError is a ValueError
                self._rejected(request_id, f"invalid limits: {exc}")
            else:
                self.effects.forwarded(request_id)

    def refuse_held_limits(self) -> None:
        """A run that ends before its first step refuses the limits it held, saying why."""
        for request_id, _ in self.held_limits:
            self._rejected(request_id, "the run ended before its first step")
        self.held_limits.clear()

    def _rejected(self, request_id: str | None, message: str) -> None:
        self.telemetry.emit(
            "trainer", "event", event="control_rejected", request_id=request_id, message=message
        )

    def stage(self, stage: str, done: int, total: int, message: str) -> None:
        self.telemetry.emit(
            "trainer", "stage", stage=stage, done=done, total=total, message=message
        )
        self.progress.stage(stage, done, total, message)

    # -- the run --------------------------------------------------------------------------------
    def execute(self) -> str:
        name, raw = load_preset(self.spec)
        preset = validate_preset(raw)
        preset.check_paths()
        # Process-wide, before any model runs: NOTE [ cuDNN SDPA guard ].
        attention = apply_attention_backend(preset.model.cudnn_sdp, self.device)
        self.progress.log_every = preset.log_every
        self.stop.install()
        self.write_config(name, preset)
        self.family = pipeline_family(preset, self.device) or family(preset.family)
        samples = self.scan(preset)  # before any model is built or loaded
        preset, frames = resolve_frames(preset, self.family, samples)
        model_dir, vae_dir, encoder_dir, _ = resolve_assets(preset, self.family, self.progress.line)
        records.run_started(
            self.telemetry,
            run_dir=self.run_dir,
            name=name,
            preset=preset,
            device=self.device,
            model_dir=model_dir,
            resume=self.resume,
            attention=attention.as_record(),
            **frames,
        )
        self.family.report(self.telemetry, self.progress)
        t0 = time.perf_counter()
        cached = self.stage1(preset, vae_dir, encoder_dir, samples)
        cache_s = time.perf_counter() - t0
        if cached is None:
            return self.finish(RunStatus.CANCELLED, {"cache_s": cache_s})
        t1 = time.perf_counter()
        self.vae_dir = vae_dir  # samples during training (factory families)
        state = self.stage2(preset, model_dir, cached)
        timings = {"cache_s": cache_s, "train_s": time.perf_counter() - t1}
        if state.stopped:
            self.stopped_samples(preset, vae_dir, cached)
            return self.finish(RunStatus.CANCELLED, timings)
        if preset.samples.prompts:
            self.samples(preset, vae_dir, cached)
        return self.finish(RunStatus.SUCCEEDED, timings)

    def write_config(self, name: str, preset: Preset) -> None:
        """``DIR/config.json``: the preset as given, in its validated spelling, the fields it
        left unset left out. A resume reads this file back (``--resume DIR/config.json``), and
        an unset field is resolved by the run's folder, not by a default: a pipeline family's
        LoRA targets (``setup.family_targets``), its ``model_type`` from ``model_index.json``,
        the memory runtimes' settings derived from the others. Writing the defaults would make
        them explicit, and the resumed adapter would not be the checkpoint's."""
        config = {"name": name, **preset.model_dump(mode="json", exclude_unset=True)}
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=2))

    def scan(self, preset: Preset) -> list[Sample]:
        """The usable samples of the data folder (``stage1.scan_data``)."""
        return scan_data(preset, self.family, self.telemetry, self.progress)

    def stage1(
        self, preset: Preset, vae_dir, encoder_dir, samples: list[Sample]
    ) -> loop.Batchable | None:
        """The stage-1 cache (``stage1.build_cache``); None when a stop request arrived."""
        return build_cache(
            preset,
            self.family,
            vae_dir,
            encoder_dir,
            samples,
            device=self.device,
            telemetry=self.telemetry,
            stage=self.stage,
            should_stop=lambda: self.poll_control() is not None,
        )

    def planned_peak(self, preset: Preset) -> int:
        """The activation peak (bytes) ``"auto"`` limits resolve with at build: the planner's
        (``activation_peak``, given by ``workbench train``: the inventory ``workbench plan``
        measures) when the run has ``"auto"`` fields and a budget (``plans_activations``), so
        the run starts with the watermarks its plan shows; else 0. A preset the planner cannot
        model starts with 0 and says so; the trace step's measured peak replaces either."""
        if self.activation_peak is None or not plans_activations(preset.memory, self.device):
            return 0
        t0 = time.perf_counter()
        try:
            peak = self.activation_peak(preset)
        except ValueError as exc:  # the planner's PlanInputError names the field
            self.progress.line(
                f'"auto" limits: no planned activation peak ({exc}); 0 until measured'
            )
            return 0
        took = time.perf_counter() - t0
        self.progress.line(
            f'"auto" limits: planned activation peak {peak / 2**20:.1f} MB ({took:.1f} s)'
        )
        return peak

    def stage2(self, preset: Preset, model_dir: Path, data: loop.Batchable) -> loop.LoopState:
        dtype = loop.DTYPES[preset.train_dtype]
        self.stage("train", 0, preset.max_steps, f"loading {model_dir.name}")
        model = loop.load_transformer(self.family, model_dir, dtype)
        check_text_dim(model, data.text["hidden"].shape[-1], self.family)
        preset = family_targets(preset, self.family)
        trainable = loop.attach_adapter(model, preset)
        self.model = model
        if preset.memory.gradient_checkpointing:
            loop.enable_checkpointing(model)
        model.train()
        self.strategy = build_strategy(
            model,
            preset.memory,
            device=self.device,
            telemetry=self.telemetry,
            checkpoint_dir=model_dir,
            mode="training",
            activation_peak=self.planned_peak(preset),
        )
        self.apply_held_limits()  # before the first step: applied at its begin
        optimizer, scheduler = loop.make_optimizer(preset, trainable)
        if self.resume:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is not None:
                self.start_step = load_checkpoint(ckpt, model, optimizer, scheduler)
                self.progress.line(f"resumed from {ckpt} (step {self.start_step})")
                records.resumed(self.telemetry, self.run_dir, ckpt, self.start_step)
        self.steps_done = self.start_step
        message = f"{sum(p.numel() for p in trainable):,} trainable parameters"
        self.stage("train", self.start_step, preset.max_steps, message)

        def draw_samples(step: int) -> None:
            t0 = time.perf_counter()
            self.sampler().during_training(model, self.strategy, preset, data, self.vae_dir, step)
            self.sample_s = time.perf_counter() - t0

        def on_step(step: int, loss: float, step_s: float) -> None:
            self.steps_done = step
            self.progress.step(step, preset.max_steps, loss, step_s)
            every = preset.samples.every
            if every and preset.samples.prompts and step % every == 0:
                if step < preset.max_steps:  # the last step's samples are the final ones
                    draw_samples(step)

        try:
            if preset.samples.prompts and self.start_step == 0:
                draw_samples(0)  # the model before training: what the final samples face
            state = self.train(preset, model, trainable, optimizer, scheduler, data, on_step)
        except OutOfMemoryEnd as exc:  # nothing lost: a checkpoint to resume, the LoRA
            self.close_strategy()
            saved = ""
            if self.steps_done > self.start_step:
                self.checkpoint_at_stop(self.steps_done, model, optimizer, scheduler)
                self.save()
                saved = f"; checkpoint step-{self.steps_done} and the LoRA saved (--resume)"
            raise OutOfMemoryEnd(f"{exc}{saved}") from exc.__cause__
        self.stage("train", state.steps_done, preset.max_steps, state.stopped or "done")
        self.close_strategy()
        if state.stopped and state.steps_done > self.start_step:
            self.checkpoint_at_stop(state.steps_done, model, optimizer, scheduler)
        return state

    def train(self, preset, model, trainable, optimizer, scheduler, data, on_step):
        """``loop.run_steps`` with the run's control, figures and recovery."""
        return loop.run_steps(
            preset=preset,
            family=self.family,
            model=model,
            trainable=trainable,
            strategy=self.strategy,
            optimizer=optimizer,
            scheduler=scheduler,
            data=data,
            start_step=self.start_step,
            device=self.device,
            dtype=loop.DTYPES[preset.train_dtype],
            telemetry=self.telemetry,
            between_steps=self.poll_control,
            on_step=on_step,
            after_step=lambda step: self.effects.step_done(step, StepFigures.of(self.strategy)),
            run_dir=self.run_dir,
            recovery=self.recovery,
        )

    def checkpoint_at_stop(self, step: int, model, optimizer, scheduler) -> None:
        """A stopped run leaves what its Continue (``--resume``) needs: the checkpoint of the
        last step trained, unless ``checkpoint_every`` wrote that step's already. A resumed run
        repeats the losses the run would have had (test_control.py)."""
        latest = latest_checkpoint(self.run_dir)
        if latest is not None and latest.name == f"step-{step}":
            return
        folder = save_checkpoint(self.run_dir, step, model, optimizer, scheduler)
        self.progress.line(f"stopped at step {step}: checkpoint {folder.name} to continue from")

    def sampler(self) -> Sampler:
        return Sampler(self.run_dir, self.family, self.device, self.telemetry, self.recovery)

    def samples(self, preset: Preset, vae_dir: Path, data: loop.Batchable) -> None:
        self.sampler().final(self.model, preset, data, vae_dir, self.steps_done)

    def stopped_samples(self, preset: Preset, vae_dir: Path, data: loop.Batchable) -> None:
        """The final samples of a run stopped mid-training, its LoRA saved first. Drawn for a
        stop request when the last samples took at most ``STOP_SAMPLES_S``; none after a SIGTERM
        (the server's escalation, or the machine going down), and a SIGTERM while they are drawn
        ends them. What was not drawn is said in a ``trainer/event`` record
        (``final_samples_skipped``)."""
        if not preset.samples.prompts or self.steps_done <= self.start_step:
            return  # nothing to draw, or nothing trained since the last samples
        self.save()
        why = None
        if self.stop.terminated:
            why = "the run was stopped by SIGTERM"
        elif self.sample_s is not None and self.sample_s > STOP_SAMPLES_S:
            why = f"the last samples took {self.sample_s:.0f} s, over {STOP_SAMPLES_S:.0f} s"
        if why is None:
            try:
                with self.stop.interruptible():
                    self.samples(preset, vae_dir, data)
                return
            except Interrupted:
                why = "SIGTERM while they were drawn"
        self.progress.line(f"final samples not drawn: {why}")
        self.telemetry.emit("trainer", "event", event="final_samples_skipped", message=why)

    # -- endings --------------------------------------------------------------------------------
    def close_strategy(self) -> None:
        if self.strategy is not None:
            strategy, self.strategy = self.strategy, None
            strategy.close()
            gc.collect()

    def save(self) -> None:
        """Save the LoRA when at least one step ran (the user's work is never lost), once per
        step count (a stopped run saves it before its final samples)."""
        if self.model is not None and self.steps_done > 0 and self.saved_step != self.steps_done:
            self.lora_path = save_lora(self.model, self.family, self.run_dir, self.steps_done)
            self.saved_step = self.steps_done

    def finish(self, status: str, timings: dict[str, float]) -> str:
        self.close_strategy()
        self.refuse_held_limits()
        self.save()
        self.telemetry.step, self.telemetry.phase = self.steps_done or None, None
        lora = str(self.lora_path.relative_to(self.run_dir)) if self.lora_path else None
        self.telemetry.emit(
            *RUN_FINISHED,
            status=status,
            lora_path=lora,
            steps_done=self.steps_done,
            timings_s=timings,
            stop_reason=self.stop.reason,
            recoveries=self.recovery.recoveries,
        )
        self.progress.line(
            f"{status}: {self.steps_done} steps"
            + "".join(f", {k} {v:.1f} s" for k, v in timings.items())
            + (f", LoRA {self.lora_path}" if self.lora_path else "")
        )
        return status

    def fail(self, exc: BaseException) -> None:
        """Save what exists, then write the final ``trainer/error`` record. An error that means
        the run folder cannot be written (gone, read-only, full) says so, naming the folder.

        Raises:
            OSError: the error record itself cannot be written (the run folder's state).
        """
        problem = folder_problem(self.run_dir, exc) if isinstance(exc, OSError) else None
        message = problem or str(exc)
        self.progress.line(f"failed: {type(exc).__name__}: {message}")
        self.refuse_held_limits()
        save_error = None
        try:
            if self.run_dir.is_dir():  # saving into a removed folder would make a new one
                self.save()
        except Exception as inner:  # the original error is the one to report
            save_error = f"{type(inner).__name__}: {inner}"
        self.telemetry.phase = None
        self.telemetry.emit(
            "trainer",
            "error",
            **records.error_record(
                exc,
                message,
                self.device,
                steps_done=self.steps_done,
                lora_path=str(self.lora_path.relative_to(self.run_dir)) if self.lora_path else None,
                save_error=save_error,
            ),
        )
