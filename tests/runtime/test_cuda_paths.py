"""The lagging device on a real GPU (``gpu``: skipped without CUDA): the bookkeeping the lagging-device
double checks on CPU (``test_device_double.py``), now with real streams, events, pinned memory
and the caching allocator; allocator health, pinned accounting and release, no pageable copy in
the hot path, and exact gradients under a compute stream slowed down against the copies."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from stagehand.common.nested import in_backward
from stagehand.config.memory import MB
from stagehand.strategy import build_strategy
from stagehand.weights import WeightRuntime
from stagehand.weights.pool import PinnedPool, Slab
from workbench.bench.probes import SYNC_CALLS
from workbench.worker.assets import output_tensor

from .exact import assert_exact, inputs_for, make_model, train
from .test_exactness import memory_section
from .weights._train import Wide, config

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def check_bookkeeping_cuda(strategy) -> None:
    """``test_device_double.check_bookkeeping`` with the real device catching up."""
    weights, conductor = strategy.weights, strategy.conductor
    pool, transfer = weights.pool, weights.transfer
    held = {id(s) for s in pool.slabs if s.holder is not None}
    owned = {id(e.staging) for e in transfer.inflight if isinstance(e.staging, Slab)}
    assert held == owned, "a slab is held without a copy in flight"
    torch.cuda.synchronize()
    transfer.retire()
    assert not transfer.inflight and all(s.holder is None for s in pool.slabs)
    if conductor is not None:
        assert conductor.transfer.inflight("h2d") == conductor.transfer.inflight("d2h") == 0


@pytest.mark.parametrize("strategy", ["stream-file", "composed", "layer-offload"])
def test_six_steps_exact_clean_and_healthy_on_cuda(tiny_flux, strategy):
    reference = make_model("flux", tiny_flux, "lora", "non-reentrant", ordinary=True).cuda()
    expected = train(reference, build_strategy(reference, {"strategy": "none"}, device="cuda"), 6)
    model = make_model("flux", tiny_flux, "lora", "non-reentrant")
    memory = memory_section(strategy, True)
    if strategy == "stream-file":
        memory["stagehand"]["conductor_config"] = {"enabled": True}
    built = build_strategy(model, memory, device="cuda", checkpoint_dir=tiny_flux)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    got = train(model, built, 6, after_step=check_bookkeeping_cuda)
    assert_exact(expected, got)
    assert torch.cuda.memory_stats().get("num_alloc_retries", 0) == before  # no cudaFree+retry
    assert built.counters()["pageable_copies"] == 0


def test_pinned_pool_accounting_and_release():
    """One page-locked allocation for the pool, exactly its size (no power-of-two rounding);
    unregistered at close (the OS gets the memory back)."""
    pool = PinnedPool(96 * MB, 32 * MB, pin=True, timeout_s=1)
    assert pool.pin and pool.locked_bytes == 96 * MB and pool.allocated_bytes == 96 * MB
    assert all(s.buffer.is_pinned() for s in pool.slabs)
    pool.close()
    assert pool.locked_bytes == 0 and not pool.slabs


def _tight(**overrides):
    return config(
        pinned_pool_mb=1024,
        pinned_slab_mb=512,
        prefetch_window_blocks=1,
        vram_high_watermark_mb=0,
        vram_low_watermark_mb=0,
        **overrides,
    )


def _grads(model: torch.nn.Module, runtime: WeightRuntime | None) -> list[torch.Tensor]:
    x = torch.randn(64, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    for step in range(3):
        if runtime is not None:
            runtime.begin_step(step)
        with runtime.managed_forward() if runtime else torch.enable_grad():
            loss = model(x).square().mean()
        with runtime.managed_backward() if runtime else torch.enable_grad():
            loss.backward()
        if runtime is not None:
            runtime.end_step()
    torch.cuda.synchronize()
    return [p.grad.detach().cpu() for p in model.parameters() if p.requires_grad]


def test_race_stress_slow_compute_against_256_mb_copies():
    """Compute slowed down (``torch.cuda._sleep`` before every block) so copies and evictions
    race it: LoRA-like trainable biases get bit-identical gradients to a resident run."""
    torch.manual_seed(0)
    reference = Wide(width=4096, depth=4).requires_grad_(False).cuda()
    for block in reference.blocks:
        block[2].bias.requires_grad_(True)
    state = {k: v.cpu().clone() for k, v in reference.state_dict().items()}
    expected = _grads(reference, None)
    del reference
    torch.cuda.empty_cache()
    model = Wide(width=4096, depth=4).requires_grad_(False)
    model.load_state_dict(state)
    for block in model.blocks:
        block[2].bias.requires_grad_(True)
        block.register_forward_pre_hook(lambda *_: torch.cuda._sleep(2_000_000))
    runtime = WeightRuntime(model, _tight(), device="cuda")
    got = _grads(model, runtime)
    runtime.close()
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_second_device_without_set_device(tiny_flux):
    """Defect 6: the compute stream of ``cuda:1`` (not the current device's) waits for copies."""
    reference = make_model("flux", tiny_flux, "lora", None, ordinary=True).to("cuda:1")
    expected = train(reference, build_strategy(reference, {"strategy": "none"}, device="cuda:1"))
    model = make_model("flux", tiny_flux, "lora", None)
    built = build_strategy(
        model, memory_section("stream-file", False), device="cuda:1", checkpoint_dir=tiny_flux
    )
    assert torch.cuda.current_device() == 0
    assert_exact(expected, train(model, built))


def test_host_syncs_per_training_step_stay_within_budget(tiny_flux):
    """The host waits on the device only where a result is read: at most one D2H wait per
    evicted trainable block and a few per phase, counted with the profiler over two steps and
    the close, beyond the syncs of the same loop without the runtime (its inputs' H2D copies and
    ``loss.item()``)."""
    memory = memory_section("composed", True)
    model = make_model("flux", tiny_flux, "full", "non-reentrant")
    train(model, build_strategy(model, memory, device="cuda", checkpoint_dir=tiny_flux), 1)
    plain = make_model("flux", tiny_flux, "full", "non-reentrant", ordinary=True).cuda()
    baseline = _host_syncs(plain, build_strategy(plain, {"strategy": "none"}, device="cuda"))
    model = make_model("flux", tiny_flux, "full", "non-reentrant")
    built = build_strategy(model, memory, device="cuda", checkpoint_dir=tiny_flux)
    blocks = len(built.weights.blocks)
    syncs = _host_syncs(model, built)
    where = Counter(_sync_site(e) for e in syncs).most_common(8)
    extra = len(syncs) - len(baseline)
    assert extra <= 2 * (3 * blocks + 8), f"{extra} more host syncs in 2 steps: {where}"


def _host_syncs(model, strategy) -> list:
    """The host syncs of 2 training steps and the strategy's close (profiler events). The CUDA
    activity is what records the runtime API calls: with the CPU activity alone none is seen."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        train(model, strategy, 2)
    syncs = [e for e in prof.events() if e.name in SYNC_CALLS]
    # Not vacuous: the kernel launches of the steps are there.
    assert any(e.name.startswith("cudaLaunchKernel") for e in prof.events())
    return syncs


def _sync_site(event) -> str:
    """The op around a host sync and the innermost project frame that called it."""
    op, parent = event.name, event.cpu_parent
    while parent is not None and not parent.stack:
        op, parent = parent.name, parent.cpu_parent
    frames = [f for f in (parent.stack if parent is not None else []) if "/runtime/" in f]
    return f"{parent.name if parent is not None else op} @ {frames[0] if frames else '?'}"


def _accumulating(model, strategy, steps=3):
    """``steps`` AdamW steps with ``zero_grad(set_to_none=False)``; per step the loss, the
    runtime's host waits in forward and backward (read inside the backward), and whether every
    streamed block's gradients were on the host at each forward use."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    weights, seen, on_host = getattr(strategy, "weights", None), [], []
    for block in weights.blocks if weights is not None else ():
        block.module.register_forward_pre_hook(  # after the runtime's: the block is loaded
            lambda *_, b=block: (
                None
                if in_backward()  # a recomputation: its backward use moved the gradients
                else on_host.append(
                    all(s.param.grad is None or not s.param.grad.is_cuda for s in b.trainable)
                )
            )
        )
    for step in range(steps):
        with strategy.step(step):
            waits = strategy.counters()["host_waits"]
            with strategy.forward():
                inputs = {
                    k: v.cuda() if isinstance(v, torch.Tensor) else v
                    for k, v in inputs_for(model, step).items()
                }
                loss = output_tensor(model(**inputs)).pow(2).mean()
            with strategy.backward():
                loss.backward()
                seen.append((loss.item(), strategy.counters()["host_waits"] - waits))
            with strategy.optimizer(opt):
                opt.step()
                opt.zero_grad(set_to_none=False)
    strategy.close()
    return seen, on_host


def test_hot_path_without_host_waits_and_unchanged_gradients_stay_on_the_host(tiny_flux):
    """On a GPU: the runtime's own host waits (``cudaEventSynchronize``,
    which ``set_sync_debug_mode`` does not see) are 0 in forward and backward; with
    ``set_to_none=False`` a block's kept gradients stay on the host through its forward (no H2D
    and D2H of unchanged gradients); the losses equal the plain model's."""
    reference = make_model("flux", tiny_flux, "full", "non-reentrant", ordinary=True).cuda()
    plain = build_strategy(reference, {"strategy": "none"}, device="cuda")
    expected, _ = _accumulating(reference, plain)
    model = make_model("flux", tiny_flux, "full", "non-reentrant")
    memory = memory_section("stream-module", True)  # every block evicted after each use
    built = build_strategy(model, memory, device="cuda", checkpoint_dir=tiny_flux)
    got, on_host = _accumulating(model, built)
    assert [loss for loss, _ in got] == [loss for loss, _ in expected]
    assert [waits for _, waits in got] == [0, 0, 0]
    assert on_host and all(on_host)
