"""``Run``: one training run, the orchestrator ``workbench train`` drives (``cli.py``).

Stage 1 caches text embeddings and latents (``encode.py``), stage 2 trains (``loop.py``) under
the preset's memory strategy; samples, checkpoints, the LoRA and the final record are written
into the run folder (``docs/contracts.md``), and everything it reports goes into ONE telemetry
stream, ``DIR/telemetry.jsonl``, shared with the memory strategy.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import time
import traceback
from pathlib import Path

import torch

from runtime.common.telemetry import JsonlSink, TeeStdoutSink, Telemetry
from runtime.config import MB
from runtime.preset import Preset, load_preset, validate_preset
from runtime.status import RunStatus
from runtime.trainer import encode, loop
from runtime.trainer.clips import scan_clips
from runtime.trainer.control import ControlDir, StopFlag
from runtime.trainer.data import group_by_shape
from runtime.trainer.families import family
from runtime.trainer.outputs import (
    folder_problem,
    latest_checkpoint,
    load_checkpoint,
    sample_images,
    sample_pipeline,
    save_lora,
)
from runtime.trainer.pipelines import PipelineFamily
from runtime.trainer.pipelines import encode as pipeline_encode
from runtime.trainer.progress import Progress
from runtime.trainer.scan import Sample, scan_folder
from runtime.trainer.setup import (
    check_text_dim,
    data_folder,
    family_targets,
    held_out_samples,
    pipeline_family,
    resolve_assets,
)

TELEMETRY_STDOUT_ENV = "STAGEHAND_TELEMETRY_STDOUT"
"""``1``: every telemetry record is also written to stdout after ``STDOUT_MARKER``."""


FLUSH_INTERVAL_S = 0.25
"""The worker's telemetry reaches its JSONL file at most this long after a record (seconds)."""


class Run:
    """One training run in ``run_dir``; ``execute`` returns the final status."""

    def __init__(self, spec: str, run_dir: Path, device: torch.device, resume: bool) -> None:
        self.spec, self.run_dir, self.device, self.resume = spec, run_dir, device, resume
        sink = JsonlSink(run_dir / "telemetry.jsonl")
        if os.environ.get(TELEMETRY_STDOUT_ENV) == "1":
            sink = TeeStdoutSink(sink)  # the Ray executor's log stream (backend/executors)
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

    # -- control ------------------------------------------------------------------------------
    def poll_control(self) -> str | None:
        """Handle pending control requests; return the stop reason, if any."""
        for req in self.control.poll():
            if req.command == "stop":
                self.stop.set("stop")
            elif req.command == "limits" and self.strategy is not None:
                try:
                    self.strategy.set_limits(
                        req.body.get("limits") or {}, request_id=req.request_id
                    )
                except ValueError as exc:  # pydantic.ValidationError is a ValueError
                    self._rejected(req.request_id, f"invalid limits: {exc}")
            else:
                why = req.error or f"command {req.command!r} not understood (or no strategy yet)"
                self._rejected(req.request_id, why)
        return self.stop.reason if self.stop.requested else None

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
        self.progress.log_every = preset.log_every
        self.stop.install()
        (self.run_dir / "config.json").write_text(
            json.dumps(
                {"name": name, **preset.model_dump(mode="json", exclude_none=True)}, indent=2
            )
        )
        self.family = pipeline_family(preset, self.device)
        samples = self.scan(preset)  # before any model is built or loaded
        model_dir, vae_dir, encoder_dir, _ = resolve_assets(preset, self.family, self.progress.line)
        self.family = self.family or family(preset.family)
        self.telemetry.emit(
            "trainer",
            "run_started",
            run_name=self.run_dir.name,
            preset=name,
            pid=os.getpid(),
            host=socket.gethostname(),
            max_steps=preset.max_steps,
            device=str(self.device),
            # The GPU's name: which device profile a calibration from this run is kept under.
            device_name=torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda"
            else None,
            vram_source="cuda" if self.device.type == "cuda" else "tracked",
            model=str(model_dir),
            strategy=preset.memory.strategy,
            resume=self.resume,
        )
        if isinstance(self.family, PipelineFamily):
            self.report_pipeline(self.family.info)
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
            return self.finish(RunStatus.CANCELLED, timings)
        if preset.samples.prompts:
            self.samples(preset, vae_dir, cached)
        return self.finish(RunStatus.SUCCEEDED, timings)

    def scan(self, preset: Preset) -> list[Sample]:
        """The usable samples of the data folder. The scan is recorded (``trainer/dataset_scan``)
        before ``DataError`` ends a run that has no usable sample, or bad files under
        ``data.on_bad_file: fail``; the error names the files. A video family takes clips (and
        images as one-frame clips)."""
        data = preset.data
        folder = data_folder(preset)
        if isinstance(self.family, PipelineFamily):
            self.family.check_caption_tokens(data.max_caption_tokens)
        if isinstance(self.family, PipelineFamily) and self.family.video:
            self.family.check_frames(data.frames)
            samples = scan_clips(
                folder,
                captions=data.captions,
                default_caption=data.default_caption,
                limit=data.limit,
            )
            self.progress.line(f"data: {len(samples)} clips and images from {folder}")
            return samples
        scan = scan_folder(
            folder,
            captions=data.captions,
            default_caption=data.default_caption,
            limit=data.limit,
            frames=data.frames,
            on_bad_file=data.on_bad_file,
        )
        self.telemetry.emit("trainer", "dataset_scan", **scan.record())
        self.progress.line(
            f"data: {len(scan.samples)} samples from {scan.folder}, {len(scan.skipped)} files "
            f"left out ({len(scan.bad)} bad), {len(scan.warnings)} warnings"
        )
        for item in scan.skipped:
            self.progress.line(f"  left out {item.file}: {item.reason}")
        for item in scan.warnings:
            self.progress.line(f"  warning {item.file}: {item.message}")
        scan.check()
        return scan.samples

    def report_pipeline(self, info) -> None:
        """What the pipeline folder holds, as one ``trainer/pipeline`` record and a line."""
        found = info.as_dict()
        self.telemetry.emit("trainer", "pipeline", **found)
        self.progress.line(
            f"{info.family} ({info.pipeline_class}): "
            + ", ".join(f"{c.name} {c.class_name}" for c in info.components)
            + f"; {len(info.blocks)} blocks streamed, largest "
            f"{found['largest_block_bytes'] / MB:.2f} MB, total {found['blocks_total_bytes'] / MB:.2f} MB"
        )

    def stage1(
        self, preset: Preset, vae_dir, encoder_dir, samples: list[Sample]
    ) -> loop.Batchable | None:
        from runtime.assets import cache_root

        data = preset.data
        texts = list(dict.fromkeys([s.caption for s in samples] + preset.samples.prompts))
        total = len(texts) + len(samples)
        cache_dir = cache_root() / "trainer-cache"
        self.stage("cache", 0, total, f"{len(samples)} samples, {len(texts)} distinct texts")

        def should_stop() -> bool:
            return self.poll_control() is not None

        text_kwargs = dict(
            memory=preset.memory,
            device=self.device,
            telemetry=self.telemetry,
            cache_dir=cache_dir,
            max_tokens=data.max_caption_tokens,
            progress=lambda d, t, m: self.stage("cache", d, total, m),
            should_stop=should_stop,
        )
        if isinstance(self.family, PipelineFamily):
            dtype = loop.DTYPES[preset.model.dtype]
            text = pipeline_encode.encode_texts(self.family, texts, dtype=dtype, **text_kwargs)
        else:
            text = encode.encode_texts(texts, encoder_dir, **text_kwargs)
        if text is None:
            return None
        self.stage("cache", len(texts), total, "text encoder released")
        result = encode.encode_latents(
            samples,
            vae_dir,
            resolution=preset.resolution,
            bucketing=data.bucketing,
            background=data.background_rgb,
            device=self.device,
            cache_dir=cache_dir,
            progress=lambda d, t, m: self.stage("cache", len(texts) + d, total, m),
            should_stop=should_stop,
            family=self.family if isinstance(self.family, PipelineFamily) else None,
            frames=data.frames,
        )
        if result is None:
            return None
        latents, _ = result
        row = {t: i for i, t in enumerate(texts)}
        self.family.check_latents(tuple(latents[0].shape))
        held_out = held_out_samples(preset, len(samples))
        train = [i for i in range(len(samples)) if i not in held_out]
        groups = group_by_shape([tuple(latents[i].shape) for i in train])
        return loop.Batchable(
            latents=latents,
            text=text,
            caption_rows=[row[s.caption] for s in samples],
            prompt_rows=[row[p] for p in preset.samples.prompts],
            groups={k: [train[j] for j in v] for k, v in groups.items()},
            held_out=held_out,
        )

    def stage2(self, preset: Preset, model_dir: Path, data: loop.Batchable) -> loop.LoopState:
        from runtime.strategy import build_strategy

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
        )
        optimizer, scheduler = loop.make_optimizer(preset, trainable)
        if self.resume:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is not None:
                self.start_step = load_checkpoint(ckpt, model, optimizer, scheduler)
                self.progress.line(f"resumed from {ckpt} (step {self.start_step})")
        self.steps_done = self.start_step
        message = f"{sum(p.numel() for p in trainable):,} trainable parameters"
        self.stage("train", self.start_step, preset.max_steps, message)

        def draw_samples(step: int) -> None:
            with self.telemetry.tagged(sampling=True):
                if isinstance(self.family, PipelineFamily):
                    self.pipeline_samples(preset, data, step=step)
                else:
                    self.training_samples(preset, data, step)

        def on_step(step: int, loss: float, step_s: float) -> None:
            self.steps_done = step
            self.progress.step(step, preset.max_steps, loss, step_s)
            every = preset.samples.every
            if every and preset.samples.prompts and step % every == 0:
                if step < preset.max_steps:  # the last step's samples are the final ones
                    draw_samples(step)

        if preset.samples.prompts and self.start_step == 0:
            draw_samples(0)  # the model before training: what the final samples are set against

        state = loop.run_steps(
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
            dtype=dtype,
            telemetry=self.telemetry,
            between_steps=self.poll_control,
            on_step=on_step,
            run_dir=self.run_dir,
        )
        self.stage("train", state.steps_done, preset.max_steps, state.stopped or "done")
        self.close_strategy()
        return state

    def samples(self, preset: Preset, vae_dir: Path, data: loop.Batchable) -> None:
        # Sampled on the plain model after the strategy is closed (it restores resident weights).
        if isinstance(self.family, PipelineFamily):
            self.pipeline_samples(preset, data, step=None)
            return
        self.model.to(self.device).eval()
        self.factory_samples(preset, data, vae_dir, "sample")

    def training_samples(self, preset: Preset, data: loop.Batchable, step: int) -> None:
        """Factory families: samples of the model as trained so far, drawn through the training
        strategy as an inference step ``step`` (``no_grad``: blocks loaded now serve training
        next), written as ``samples/step-NNNNNN-ii.png``."""
        model, was_training = self.model, self.model.training
        model.eval()
        try:
            with torch.no_grad(), self.strategy.step(step), self.strategy.forward():
                self.factory_samples(preset, data, self.vae_dir, f"step-{step:06d}")
        finally:
            model.train(was_training)

    def factory_samples(
        self, preset: Preset, data: loop.Batchable, vae_dir: Path, prefix: str
    ) -> None:
        """One ``samples/{prefix}-ii.png`` per prompt from ``self.model`` (its sampler and the
        run's VAE), each with its ``trainer/sample`` record."""
        prompts = preset.samples.prompts
        dtype = loop.DTYPES[preset.train_dtype]
        paths = sample_images(
            self.family,
            self.model,
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
        self.record_samples(paths, prompts)

    def pipeline_samples(self, preset: Preset, data: loop.Batchable, step: int | None) -> None:
        """Samples from the pipeline's ``__call__``: during training (``step``) through the
        training strategy as an inference step, at the end (None) through an inference one."""
        prompts = preset.samples.prompts
        dtype = loop.DTYPES[preset.train_dtype]
        prefix = "sample" if step is None else f"step-{step:06d}"
        paths = sample_pipeline(
            self.family,
            self.model,
            data.text_rows(data.prompt_rows, self.device, dtype),
            tuple(data.latents[0].shape),
            preset=preset,
            device=self.device,
            dtype=dtype,
            telemetry=self.telemetry,
            out_dir=self.run_dir / "samples",
            names=[f"{prefix}-{i:02d}" for i in range(len(prompts))],
            strategy=self.strategy if step is not None else None,
            step=step,
        )
        self.record_samples(paths, prompts)

    def record_samples(self, paths: list[Path], prompts: list[str]) -> None:
        """One ``trainer/sample`` record per written image, its path relative to the run."""
        for path, prompt in zip(paths, prompts, strict=True):
            rel = str(path.relative_to(self.run_dir))
            self.telemetry.emit("trainer", "sample", path=rel, prompt=prompt)

    # -- endings --------------------------------------------------------------------------------
    def close_strategy(self) -> None:
        if self.strategy is not None:
            strategy, self.strategy = self.strategy, None
            strategy.close()
            gc.collect()

    def save(self) -> None:
        """Save the LoRA when at least one step ran (the user's work is never lost)."""
        if self.model is not None and self.steps_done > 0:
            self.lora_path = save_lora(self.model, self.family, self.run_dir, self.steps_done)

    def finish(self, status: str, timings: dict[str, float]) -> str:
        self.close_strategy()
        self.save()
        self.telemetry.step, self.telemetry.phase = self.steps_done or None, None
        lora = str(self.lora_path.relative_to(self.run_dir)) if self.lora_path else None
        self.telemetry.emit(
            "trainer",
            "run_finished",
            status=status,
            lora_path=lora,
            steps_done=self.steps_done,
            timings_s=timings,
            stop_reason=self.stop.reason,
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
        save_error = None
        try:
            if self.run_dir.is_dir():  # saving into a removed folder would make a new one
                self.save()
        except Exception as inner:  # the original error is the one to report
            save_error = f"{type(inner).__name__}: {inner}"
        oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
        vram = {}
        if self.device.type == "cuda" and torch.cuda.is_available():
            vram = {
                "vram_allocated_mb": torch.cuda.memory_allocated(self.device) / MB,
                "vram_reserved_mb": torch.cuda.memory_reserved(self.device) / MB,
                "vram_peak_mb": torch.cuda.max_memory_allocated(self.device) / MB,
                "vram_total_mb": torch.cuda.get_device_properties(self.device).total_memory / MB,
                "vram_source": "cuda",
            }
        self.telemetry.phase = None
        self.telemetry.emit(
            "trainer",
            "error",
            error_type=type(exc).__name__,
            message=message,
            traceback="".join(traceback.format_exception(exc)),
            oom=oom,
            steps_done=self.steps_done,
            lora_path=str(self.lora_path.relative_to(self.run_dir)) if self.lora_path else None,
            save_error=save_error,
            **vram,
        )
