"""A step out of device memory is re-planned and run again, never lost (issue 57 items 1, 3, 4):
tiny-ci runs in this process (``workbench.worker.run.Run``) on an emulated CPU card (``--card-gb``: the
runtimes' tracked device bytes), NOTE [ Out-of-memory recovery ] (backend/workbench/worker/recovery.py).

The card is put in place at stage 2 (``CardRun``): stage 1's text encoder (MiniLM, blocks of
several MB) does not fit a card sized to the tiny Flux, and its figures are not what is tested.
"""

import json

import pytest
import torch

from stagehand.common.card import emulate_card
from stagehand.config.limits import PATHS
from stagehand.config.memory import MB
from workbench.contract.control import write_request
from workbench.contract.preset import PRESETS_DIR
from workbench.worker.cli import main
from workbench.worker.run import Run

CPU = torch.device("cpu")
STEPS = 3
DEFAULT_MEMORY = json.loads((PRESETS_DIR / "default.json").read_text())["memory"]
"""The ``default`` preset's memory section (40/30 MB weight, 26/20 MB activation watermarks):
on the tiny Flux every block stays, a tracked peak of 2.18 MB a step."""
CARD_BELOW_PEAK_MB = 2.1


class CardRun(Run):
    """A run on an emulated card of ``card_mb`` from stage 2 on; ``hook(run, optimizer)`` runs
    before the steps."""

    def __init__(self, *args, card_mb=None, hook=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.card_mb, self.hook = card_mb, hook

    def stage2(self, *args, **kwargs):
        if self.card_mb is not None:
            emulate_card(CPU, int(self.card_mb * MB))
        try:
            return super().stage2(*args, **kwargs)
        finally:
            emulate_card(CPU, None)

    def train(self, preset, model, trainable, optimizer, scheduler, data, on_step):
        if self.hook is not None:
            self.hook(self, optimizer)
        return super().train(preset, model, trainable, optimizer, scheduler, data, on_step)


def execute(run: Run) -> str:
    try:
        return run.execute()
    except Exception as exc:
        run.fail(exc)
        return "failed"
    finally:
        run.stop.uninstall()
        run.progress.close()
        run.telemetry.close()
        emulate_card(CPU, None)


def losses(recs, of) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in of(recs, "trainer", "step")}


def lora_bytes(run_dir) -> dict[str, bytes]:
    """The saved LoRA's tensors, each as its bytes (the file's header holds the run's own
    metadata, its base model's path among them)."""
    from safetensors.torch import load_file

    tensors = load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors")
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in tensors.items()}


def memory_with(limits: dict) -> dict:
    """``DEFAULT_MEMORY`` with the live ``limits`` written at their config paths."""
    memory = json.loads(json.dumps(DEFAULT_MEMORY))
    for field, value in limits.items():
        node = memory
        *parents, name = PATHS[field].split(".")[1:]  # below "memory"
        for part in parents:
            node = node[part]
        node[name] = value
    return memory


def test_a_card_below_the_peak_recovers_and_the_run_is_bit_identical_to_one_started_lowered(
    cache_env, make_preset, tmp_path, run_io
):
    preset = make_preset(max_steps=STEPS, checkpoint_every=None, memory=DEFAULT_MEMORY)
    run_dir = tmp_path / "card"
    run_dir.mkdir()
    run = CardRun(str(preset), run_dir, CPU, False, card_mb=CARD_BELOW_PEAK_MB)
    assert execute(run) == "succeeded"
    recs = run_io.records(run_dir)
    [rec] = run_io.of(recs, "trainer", "oom_recovery")
    assert (rec["step"], rec["phase"], rec["attempt"]) == (1, "forward", 1)
    assert rec["card_bytes"] == int(CARD_BELOW_PEAK_MB * MB)
    assert 0 < rec["failure_bytes"] <= rec["card_bytes"] and "emulated" in rec["message"]
    assert rec["limits_before"]["vram_high_watermark_mb"] == 40
    after = rec["limits_after"]
    assert after["vram_high_watermark_mb"] < CARD_BELOW_PEAK_MB  # below the card, with margin
    # The rerun's limits_applied record (request "oom") follows the recovery record.
    applied = [r for r in run_io.of(recs, "strategy", "limits_applied") if r["request_id"] == "oom"]
    assert applied and applied[0]["seq"] > rec["seq"] and applied[0]["step"] == 1
    assert recs[-1]["kind"] == "run_finished" and recs[-1]["recoveries"] == 1
    # Every training step's record is under the card (tracked MB; stage 1's are step 0).
    steps = [r for r in run_io.of(recs, "stagehand", "step") if r["step"] >= 1]
    assert all(r["vram_peak_mb"] <= CARD_BELOW_PEAK_MB for r in steps if not r.get("aborted"))
    assert [r["step"] for r in steps if r.get("aborted")] == [1]

    lowered = tmp_path / "lowered"
    preset2 = make_preset(
        name="lowered", max_steps=STEPS, checkpoint_every=None, memory=memory_with(after)
    )
    assert main([str(preset2), "--run-dir", str(lowered)]) == 0
    recs2 = run_io.records(lowered)
    assert not run_io.of(recs2, "trainer", "oom_recovery")
    assert losses(recs, run_io.of) == losses(recs2, run_io.of)
    assert len(losses(recs, run_io.of)) == STEPS
    assert lora_bytes(run_dir) == lora_bytes(lowered)


def test_an_error_inside_the_optimizer_step_is_rolled_back_and_run_again(
    cache_env, make_preset, tmp_path, run_io
):
    """``optimizer.step()`` updates every parameter, then raises: the rerun must start from
    the step's parameters and Adam state, or the LoRA takes step 2's update twice."""
    preset = make_preset(max_steps=STEPS, checkpoint_every=None)
    reference = tmp_path / "reference"
    assert main([str(preset), "--run-dir", str(reference)]) == 0

    def fail_once(run, optimizer):
        real, failed = optimizer.step, []

        def step(*args, **kwargs):
            out = real(*args, **kwargs)
            if run.steps_done == 1 and not failed:  # inside step 2
                failed.append(True)
                raise torch.OutOfMemoryError("Tried to allocate 2.00 MiB (in optimizer.step)")
            return out

        optimizer.step = step

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert execute(CardRun(str(preset), run_dir, CPU, False, hook=fail_once)) == "succeeded"
    recs = run_io.records(run_dir)
    [rec] = run_io.of(recs, "trainer", "oom_recovery")
    assert (rec["step"], rec["phase"], rec["card_bytes"]) == (2, "optimizer", None)
    ref = run_io.records(reference)
    assert losses(recs, run_io.of) == losses(ref, run_io.of)
    assert lora_bytes(run_dir) == lora_bytes(reference)


class LiveRaise(CardRun):
    """Sends a limits request raising the weight watermarks to 40/30 MB (every block kept:
    above the card) once one step is done."""

    def poll_control(self):
        if self.steps_done >= 1 and not getattr(self, "sent", False):
            limits = {"vram_high_watermark_mb": 40, "vram_low_watermark_mb": 30}
            write_request(
                self.run_dir, 1, {"command": "limits", "limits": limits, "request_id": "up"}
            )
            self.sent = True
        return super().poll_control()


def test_a_live_change_above_the_card_recovers_at_the_next_step(
    cache_env, make_preset, tmp_path, run_io
):
    preset = make_preset(max_steps=STEPS, checkpoint_every=None)
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    assert execute(LiveRaise(str(preset), run_dir, CPU, False, card_mb=1.6)) == "succeeded"
    recs = run_io.records(run_dir)
    [user] = [r for r in run_io.of(recs, "strategy", "limits_applied") if r["request_id"] == "up"]
    [rec] = run_io.of(recs, "trainer", "oom_recovery")
    assert user["step"] == rec["step"] == 2
    assert rec["limits_before"]["vram_high_watermark_mb"] == 40
    assert rec["limits_after"]["vram_high_watermark_mb"] < 1.6
    assert sorted(losses(recs, run_io.of)) == [1, 2, 3]


def test_an_out_of_memory_error_while_sampling_recovers(cache_env, make_preset, tmp_path, run_io):
    """The step-0 samples (through the training strategy) meet a card just above what is in
    use at their first attempt: recovered, drawn again, and training goes on."""
    samples = {"prompts": ["a handwritten digit three"], "steps": 2}
    preset = make_preset(max_steps=2, checkpoint_every=None, samples=samples)

    class Squeezed(CardRun):
        def sampler(self):
            sampler = super().sampler()
            real = sampler.draw

            def draw(*args, **kwargs):
                strategy = kwargs.get("strategy")
                if strategy is not None and not getattr(self, "squeezed", False):
                    self.squeezed = True
                    strategy.memory.capacity_bytes = strategy.memory.tracked_bytes() + 1
                    try:
                        return real(*args, **kwargs)
                    finally:
                        strategy.memory.capacity_bytes = None
                return real(*args, **kwargs)

            sampler.draw = draw
            return sampler

    run_dir = tmp_path / "sampling"
    run_dir.mkdir()
    assert execute(Squeezed(str(preset), run_dir, CPU, False)) == "succeeded"
    recs = run_io.records(run_dir)
    [rec] = run_io.of(recs, "trainer", "oom_recovery")
    assert (rec["step"], rec["phase"]) == (0, "sampling")
    paths = [r["path"] for r in run_io.of(recs, "trainer", "sample")]
    assert paths == ["samples/step-000000-00.png", "samples/sample-00.png"]
    assert sorted(losses(recs, run_io.of)) == [1, 2]


class ShrinkAfter(CardRun):
    """After ``after`` steps the card shrinks to the resident weights and one byte: nothing
    fits any more (another process took the rest)."""

    def train(self, preset, model, trainable, optimizer, scheduler, data, on_step):
        def shrinking(step, loss, step_s):
            on_step(step, loss, step_s)
            if step == 2:
                memory = self.strategy.memory
                memory.capacity_bytes = memory.tracked_bytes("weights") + 1

        return super().train(preset, model, trainable, optimizer, scheduler, data, shrinking)


def test_a_card_too_small_for_anything_ends_with_a_clear_error_and_a_checkpoint(
    cache_env, make_preset, tmp_path, run_io
):
    preset = make_preset(max_steps=4, checkpoint_every=None)
    run_dir = tmp_path / "small"
    run_dir.mkdir()
    assert execute(ShrinkAfter(str(preset), run_dir, CPU, False)) == "failed"
    recs = run_io.records(run_dir)
    last = recs[-1]
    assert (last["kind"], last["oom"], last["steps_done"]) == ("error", True, 2)
    message = last["message"]
    # tiny-ci's limits are low already: the rule reaches the floors at the third attempt.
    for part in ("step 3", "every limit at its floor", "needs", "the card holds", "8-bit"):
        assert part in message, message
    assert "checkpoint step-2 and the LoRA saved" in message
    assert [r["attempt"] for r in run_io.of(recs, "trainer", "oom_recovery")] == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2"]
    assert last["lora_path"] == "lora/pytorch_lora_weights.safetensors"

    # Nothing lost: resumed without the card, step 3 and 4 are what they would have been.
    resumed = main([str(run_dir / "config.json"), "--run-dir", str(run_dir), "--resume"])
    assert resumed == 0
    reference = tmp_path / "reference"
    assert main([str(preset), "--run-dir", str(reference)]) == 0
    got = losses(run_io.records(run_dir), run_io.of)
    assert got == losses(run_io.records(reference), run_io.of)


@pytest.mark.parametrize("value", ["0", "-1", "5000", "nan", "big"])
def test_card_gb_is_refused_out_of_range(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["tiny-ci", "--run-dir", str(tmp_path / "r"), "--card-gb", value])
    assert caught.value.code == 2
    assert "--card-gb" in capsys.readouterr().err
