"""CUDA: the same parity as on CPU, H2D copies on the transfer stream overlapping compute, and
no host synchronisation in the forward hot path. Skipped without CUDA."""

import pytest
import torch

from stagehand.common import ListSink, Telemetry
from stagehand.weights import WeightRuntime
from tests.runtime import exact
from workbench.worker.assets import example_inputs, output_tensor

from ._train import Wide, config, make_model

pytestmark = pytest.mark.gpu


def _train_cuda(model, runtime=None, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        inputs = example_inputs(model, seed=step, device="cuda")
        with runtime.managed_forward() if runtime else torch.enable_grad():
            loss = output_tensor(model(**inputs)).pow(2).mean()
        with runtime.managed_backward() if runtime else torch.enable_grad():
            loss.backward()
        losses.append(loss.item())
        # A copy: an evicted trainable block's ``.grad`` is its host buffer, reused next step.
        grads.append(
            {
                n: p.grad.detach().to("cpu", copy=True)
                for n, p in model.named_parameters()
                if p.requires_grad
            }
        )
        with runtime.optimizer_context(opt) if runtime else torch.enable_grad():
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses, grads


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-gc", "gc"])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_cuda_parity(tiny_flux, method, checkpointing):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    reference = make_model("flux", tiny_flux, method, checkpointing).cuda()
    loss_a, grads_a = _train_cuda(reference)
    model = make_model("flux", tiny_flux, method, checkpointing)
    runtime = WeightRuntime(model, config(), device="cuda", checkpoint_dir=tiny_flux)
    loss_b, grads_b = _train_cuda(model, runtime)
    # Block views start at 512-byte offsets (registry.ALIGN), as the caching allocator aligns an
    # ordinary tensor: cuBLAS chooses the same kernels, so bit-identical (NOTE [ Exact numbers ]).
    assert loss_a == loss_b
    for ga, gb in zip(grads_a, grads_b, strict=True):
        for name in ga:
            assert torch.equal(ga[name], gb[name]), name
    runtime.close()


def test_cuda_bf16_streams_as_the_plain_model(tiny_flux):
    """bf16 LoRA training under the weight runtime (no SquareQ), the dtype a run on the GPU
    trains in (the other training tests here are fp32, where SDPA never takes cuDNN), under the
    trainer's attention guard: step 0's gradients finite in both runs (a non-finite one shows
    only as a NaN loss at step 1), then losses and every gradient equal the plain model's.
    ``./dev gpu-check diagnose`` runs it with cuDNN SDPA on: SquareQ's bf16 case without
    SquareQ."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    bf16 = {"ordinary": True, "dtype": torch.bfloat16}  # from_pretrained(torch_dtype=bf16)
    reference = exact.make_model("flux", tiny_flux, "lora", **bf16).cuda()
    loss_a, grads_a = _train_cuda(reference)
    model = exact.make_model("flux", tiny_flux, "lora", **bf16)
    runtime = WeightRuntime(model, config(), device="cuda", checkpoint_dir=tiny_flux)
    try:
        loss_b, grads_b = _train_cuda(model, runtime)
        work = runtime.counters()
    finally:
        runtime.close()
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    for label, grads in (("plain model", grads_a), ("weight runtime", grads_b)):
        assert grads[0] and all(g.dtype == torch.bfloat16 for g in grads[0].values())
        bad = sorted(n for n, g in grads[0].items() if not torch.isfinite(g).all())
        assert not bad, (
            f"step 0: {len(bad)} of {len(grads[0])} gradients of the {label} are not finite "
            f"(cuDNN SDPA enabled: {cudnn}), first {bad[:4]}"
        )
    assert work["blocks_loaded"] > 0 and work["blocks_evicted"] > 0  # it really streamed
    assert loss_a == loss_b
    for ga, gb in zip(grads_a, grads_b, strict=True):
        for name in ga:
            assert torch.equal(ga[name], gb[name]), name


def test_cuda_block_views_are_aligned_as_ordinary_tensors(tiny_flux):
    """Every parameter view of a loaded block starts at a multiple of 512 bytes, and a forward
    under the runtime equals the model moved to the GPU bit for bit."""
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = make_model("flux", tiny_flux).cuda().eval()
    model = make_model("flux", tiny_flux).eval()
    runtime = WeightRuntime(model, config(), device="cuda", checkpoint_dir=tiny_flux)
    ptrs: list[int] = []
    for block in runtime.blocks:  # after the runtime's pre-hook: the block is loaded
        block.module.register_forward_pre_hook(
            lambda module, args: ptrs.extend(p.data_ptr() for p in module.parameters())
        )
    inputs = example_inputs(model, seed=3, device="cuda")
    with torch.no_grad():
        expected = output_tensor(reference(**inputs))
        got = output_tensor(model(**inputs))
    assert ptrs and all(ptr % 512 == 0 for ptr in ptrs)
    assert torch.equal(got, expected)
    runtime.close()


def test_h2d_copies_overlap_compute_without_host_syncs():
    """Copies overlap kernels, no host sync in the profiled steps, and every use of the steady
    step is a prefetch hit.

    Hits are counted on the host, at a block's use. An H2D copy holds its in-flight slot (and
    slab) until it completes on the device, and it is queued after the compute issued before it
    (``TransferStream.use(after=...)``). Nothing here waits for the GPU, so the host runs ahead
    of it by as many blocks as the host is faster; with 2 slots both are soon held by copies
    waiting behind queued compute, the next prefetch is skipped and that use is a demand load.
    How many, is a race between the host's and the GPU's speed (an H100 host ran far enough
    ahead to leave fewer than 6 hits of 8). So the slots are sized to the most loads the two
    profiled steps can have issued (2 at the trace step's end + 8 + 8): no prefetch is ever
    skipped for a slot, and the count is decided by the schedule alone: 8 of 8.
    """
    model = Wide().requires_grad_(False)
    sink = ListSink()
    runtime = WeightRuntime(
        model,
        config(
            pinned_pool_mb=20 * 65,
            pinned_slab_mb=65,  # a 64.02 MB block in one slab
            max_inflight_transfers=20,
            prefetch_window_blocks=2,
            vram_high_watermark_mb=20000,
            vram_low_watermark_mb=0,  # every block streams: none kept after its use
        ),
        device="cuda",
        telemetry=Telemetry(sink),
        mode="inference",
    )
    x = torch.randn(16384, 2048, device="cuda")  # ~1 ms of matmul per linear
    with torch.no_grad():
        model(x)  # trace step
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host sync in the hot path raises
        waits = runtime.transfer.host_waits  # what the debug mode does not see
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                model(x)
                model(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert runtime.transfer.host_waits == waits  # no cudaEventSynchronize of the runtime's
        torch.cuda.synchronize()
    runtime.end_step()
    events = prof.events()
    copies = [e for e in events if "Memcpy HtoD" in e.name]
    kernels = [
        e
        for e in events
        if e.device_type.name == "CUDA" and "Memcpy" not in e.name and "Memset" not in e.name
    ]
    assert copies and kernels
    overlapping = [
        c
        for c in copies
        if any(
            k.time_range.start < c.time_range.end and c.time_range.start < k.time_range.end
            for k in kernels
        )
    ]
    assert overlapping, "no H2D copy ran while a compute kernel ran"
    last = sink.of("stagehand", "step")[-1]
    assert last["prefetch_skipped"] == 0
    assert (last["prefetch_hits"], last["prefetch_misses"]) == (8, 0)


def test_copies_back_run_beside_prefetches():
    """Full fine-tune: after a block's backward its gradients go back on the D2H stream while
    the next blocks' weights come in on the H2D stream; the copy engines run both directions at
    once, which one shared stream would serialise. At least one D2H copy overlaps an H2D one."""
    model = Wide(depth=6)
    runtime = WeightRuntime(
        model,
        config(
            pinned_pool_mb=8 * 65,
            pinned_slab_mb=65,  # a 64.02 MB block in one slab
            max_inflight_transfers=4,
            prefetch_window_blocks=2,
            resident_trainable_max_fraction=0,  # trainable weights stream with their block
            vram_high_watermark_mb=20000,
            vram_low_watermark_mb=0,  # every block streams: none kept after its use
        ),
        device="cuda",
    )
    x = torch.randn(8192, 2048, device="cuda")

    def step():
        with runtime.managed_forward():
            loss = model(x).pow(2).mean()
        with runtime.managed_backward():
            loss.backward()
        model.zero_grad(set_to_none=True)
        runtime.end_step()

    step()  # trace step
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    runtime.close()
    events = prof.events()
    h2d = [e for e in events if "Memcpy HtoD" in e.name]
    d2h = [e for e in events if "Memcpy DtoH" in e.name]
    assert h2d and d2h
    assert any(
        a.time_range.start < b.time_range.end and b.time_range.start < a.time_range.end
        for a in h2d
        for b in d2h
    ), "no D2H copy ran while an H2D copy ran"


def test_uses_that_wait_on_their_copy_are_timed_and_grow_a_derived_window():
    """NOTE [ Window growth ] on CUDA: 24 blocks of 64 MB whose copies (~1.2 ms each at 55 GB/s)
    take far longer than their compute (64 rows): uses wait on copies in flight, the device's
    timing events measure it (``copy_waits``, ``copy_wait_ms``), and the derived window (8
    blocks: 1 GiB ahead) doubles after the first steady step, then stops at the blocks less
    one."""
    model = Wide(depth=24).requires_grad_(False)
    sink = ListSink()
    runtime = WeightRuntime(
        model,
        config(
            pinned_pool_mb=20 * 65,
            pinned_slab_mb=65,
            max_inflight_transfers=20,
            prefetch_window_blocks=None,  # derived: the runtime's to grow
            vram_high_watermark_mb=20000,
            vram_low_watermark_mb=0,
        ),
        device="cuda",
        telemetry=Telemetry(sink),
        mode="inference",
    )
    x = torch.randn(64, 2048, device="cuda")
    with torch.no_grad():
        for _ in range(4):
            model(x)
            torch.cuda.current_stream().synchronize()  # a step's end, as a loss read is
            runtime.end_step()
    runtime.close()
    records = sink.of("stagehand", "step")
    assert records[1]["copy_waits"] > 0 and records[1]["copy_wait_ms"] > 0
    assert [r["prefetch_window_blocks"] for r in records] == [8, 8, 16, 23]
