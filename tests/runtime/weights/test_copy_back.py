"""What an eviction copies back to the host in a full fine-tune: the gradients, and the weights
only when an optimizer step changed them on the device (``Block.dirty``), on a D2H stream of
their own; training stays bit-identical to the plain model."""

from __future__ import annotations

import pytest
import torch

from stagehand.common import ListSink, Telemetry
from stagehand.strategy import build_strategy
from stagehand.weights.errors import FrozenParameterError
from tests.runtime import exact
from tests.runtime.test_exactness import memory_section


def _reference(path):
    model = exact.make_model("flux", path, "full", "non-reentrant", ordinary=True)
    return exact.train(model, build_strategy(model, {"strategy": "none"}, device="cpu"))


def _train(path, strategy, after_step=None):
    model = exact.make_model("flux", path, "full", "non-reentrant")
    sink = ListSink()
    built = build_strategy(
        model,
        memory_section(strategy, True),
        device="cpu",
        checkpoint_dir=path,
        telemetry=Telemetry(sink),
    )
    return built, sink, exact.train(model, built, after_step=after_step)


def test_streamed_blocks_copy_back_their_gradients_once_and_no_weights(tiny_flux):
    built, sink, got = _train(tiny_flux, "stream-module")
    exact.assert_exact(_reference(tiny_flux), got)
    runtime = built.weights
    trainable = sum(s.nbytes for b in runtime.blocks for s in b.trainable)
    assert trainable > 0
    for record in sink.of("stagehand", "step"):
        # Every block is loaded twice a step (forward, backward) and evicted after each use;
        # the optimizer runs with all of them evicted: only each block's gradients come back
        # (before: its weights at every eviction too, 3x these bytes).
        assert record["blocks_loaded"] == 2 * len(runtime.blocks)
        assert record["d2h_bytes"] == trainable
    assert runtime.transfer.back.stream is not runtime.transfer.stream


def test_blocks_loaded_at_the_optimizer_step_copy_their_weights_back(tiny_flux):
    """Layer offload keeps part of the blocks on the device: the optimizer updates those there
    (they become dirty) and close copies them back (the final weights equal the plain model's);
    the offloaded blocks send their gradients only."""
    seen = []

    def after_step(strategy):
        seen.append([(b.resident, b.dirty) for b in strategy.weights.blocks])

    built, sink, got = _train(tiny_flux, "layer-offload", after_step)
    exact.assert_exact(_reference(tiny_flux), got)
    blocks = built.weights.blocks
    flags = [(b.resident, b.resident) for b in blocks]  # dirty exactly when kept on the device
    assert any(r for r, _ in flags) and not all(r for r, _ in flags)
    assert seen == [flags] * len(seen)
    grads = sum(s.nbytes for b in blocks if not b.resident for s in b.trainable)
    assert [r["d2h_bytes"] for r in sink.of("stagehand", "step")] == [grads] * len(seen)


@pytest.mark.parametrize("strategy", ["stream-module", "stream-file", "composed"])
def test_weights_written_between_steps_are_kept(tmp_path, strategy):
    """Blocks left on the device between steps (loose watermarks; loaded again by an eval
    forward after the optimizer step, so not changed by it) are written by the user's code (a
    state dict loaded back, EMA weights swapped in): their eviction copies the writes back.
    Before, an eviction dropped them (the block was not dirty): the next steps trained on the
    weights from before the write."""
    path = exact.build_toy("dual", tmp_path / "dual")

    def run(ordinary, section=None):
        model = exact.make_model("dual", path, "full", ordinary=ordinary)
        built = build_strategy(
            model, section or {"strategy": "none"}, device="cpu", checkpoint_dir=path
        )
        evals = []

        def after_step(strategy):
            with strategy.step(100 + len(evals)):
                with torch.no_grad(), strategy.forward():
                    evals.append(model(**exact.inputs_for(model, 9)).sum().item())
            with torch.no_grad():
                model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})

        run = exact.train(model, built, steps=4, after_step=after_step)
        return run, evals

    section = memory_section(strategy, False)
    section["stagehand"].update(vram_high_watermark_mb=1000, vram_low_watermark_mb=1000)
    reference, ref_evals = run(True)
    got, evals = run(False, section)
    exact.assert_exact(reference, got)
    assert evals == ref_evals


@pytest.mark.parametrize("strategy", ["stream-module", "stream-file", "layer-offload"])
def test_unfreezing_a_streamed_parameter_mid_run_is_refused(tmp_path, strategy):
    """Which block parameters train is fixed when the strategy is built: one unfrozen later
    (progressive unfreezing) is named at the next optimizer step. Before, its update was lost
    at its block's eviction (host memory) or the step failed on the empty placeholder of a
    file-backed weight ("size of tensor a (0) must match")."""
    path = exact.build_toy("dual", tmp_path / "dual")
    model = exact.make_model("dual", path, "full", "non-reentrant")
    model.blocks[0].requires_grad_(False)
    built = build_strategy(model, memory_section(strategy, True), device="cpu", checkpoint_dir=path)
    model.blocks[0].to_q.weight.requires_grad_(True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with built.step(0):
        with built.forward():
            loss = model(**exact.inputs_for(model, 0)).pow(2).mean()
        with built.backward():
            loss.backward()
        with pytest.raises(FrozenParameterError, match=r"'blocks\.0\.to_q\.weight' was frozen"):
            with built.optimizer(opt):
                opt.step()
    built.close()


@pytest.mark.parametrize("strategy", ["stream-module", "stream-file", "composed", "layer-offload"])
def test_gradients_accumulated_across_steps_train_exactly(tmp_path, strategy):
    """Gradient accumulation as the phase error advises: one step per micro-batch, the optimizer
    in the last; gradients kept (``set_to_none=False``) and momentum state: an evicted block's
    host gradient comes back to the device at its next load and adds up as in the plain model."""
    path = exact.build_toy("dual", tmp_path / "dual")

    def run(model, built):
        params = dict(model.named_parameters())
        opt = torch.optim.SGD(params.values(), lr=1e-2, momentum=0.9, weight_decay=0.01)
        losses, grads = [], []
        for step in range(6):
            with built.step(step):
                with built.forward():
                    loss = model(**exact.inputs_for(model, step)).pow(2).mean()
                with built.backward():
                    loss.backward()
                losses.append(loss.item())
                if step % 3 == 2:  # 3 micro-batches per update
                    grads.append(
                        {n: p.grad if p.grad is None else p.grad.clone() for n, p in params.items()}
                    )
                    with built.optimizer(opt):
                        opt.step()
                        opt.zero_grad(set_to_none=False)
        built.close()
        final = {n: p.detach().clone() for n, p in params.items()}
        return exact.Run(losses, grads, final)

    plain = exact.make_model("dual", path, "full", ordinary=True)
    reference = run(plain, build_strategy(plain, {"strategy": "none"}, device="cpu"))
    model = exact.make_model("dual", path, "full", "non-reentrant")
    built = build_strategy(
        model,
        memory_section(strategy, strategy == "layer-offload"),
        device="cpu",
        checkpoint_dir=path,
    )
    exact.assert_exact(reference, run(model, built))
