"""SquareQ on CUDA (skipped without it; ``./dev gpu-check tests`` runs it on a lent GPU): the
image's H2D copy and its dequantization run on the transfer stream, the compute stream waits on
the load's event, nothing waits on the host, and the numbers equal the dequantized model's.
Every test runs under the trainer's cuDNN SDPA guard (``tests/runtime/conftest.py``) but
``test_cuda_squareq_bf16_with_cudnn_sdp_on``, which keeps cuDNN SDPA on."""

import pytest
import torch

from stagehand.common import ListSink, Telemetry
from stagehand.squareq.runtime import dequantized_in_place
from stagehand.weights import WeightRuntime, find_blocks
from tests.runtime.weights._train import Wide, config, make_model
from workbench.worker.assets import example_inputs, output_tensor

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
        grads.append(
            {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
        )
        with runtime.optimizer_context(opt) if runtime else torch.enable_grad():
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses, grads


def _nonfinite(grads: dict[str, torch.Tensor]) -> list[str]:
    """Names of the gradients holding a NaN or an infinity."""
    return sorted(name for name, g in grads.items() if not torch.isfinite(g).all())


def _check_trains_as_the_dequantized_model(tiny_flux, tmp_path, fmt, dtype):
    """Three AdamW steps of the dequantized model and of the SquareQ runtime: step 0's
    gradients finite in both, then losses and every gradient of every step equal."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    reference = make_model("flux", tiny_flux).to(dtype)
    dequantized_in_place([m for _, m in find_blocks(reference)], fmt)
    loss_a, grads_a = _train_cuda(reference.cuda())
    model = make_model("flux", tiny_flux).to(dtype)
    squareq = {"format": fmt, "cache_dir": str(tmp_path)}
    runtime = WeightRuntime(model, config(squareq=squareq), device="cuda", checkpoint_dir=tiny_flux)
    try:
        loss_b, grads_b = _train_cuda(model, runtime)
    finally:
        runtime.close()
    # A non-finite gradient at step 0 shows only as a NaN loss at step 1 (AdamW carries it into
    # the weights): name where it began, and whether cuDNN SDPA was on (NOTE [ cuDNN SDPA guard ]).
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    for label, grads in (("dequantized model", grads_a), ("SquareQ runtime", grads_b)):
        bad = _nonfinite(grads[0])
        assert not bad, (
            f"step 0: {len(bad)} of {len(grads[0])} gradients of the {label} are not finite "
            f"(cuDNN SDPA enabled: {cudnn}), first {bad[:4]}"
        )
    assert loss_a == loss_b
    for ga, gb in zip(grads_a, grads_b, strict=True):
        for name in ga:
            assert torch.equal(ga[name], gb[name]), name


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_squareq_trains_as_the_dequantized_model(tiny_flux, tmp_path, fmt, dtype):
    """Under the trainer's attention guard (the conftest's ``_cudnn_sdp_guard``)."""
    _check_trains_as_the_dequantized_model(tiny_flux, tmp_path, fmt, dtype)


@pytest.mark.cudnn_sdp("on")
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_cuda_squareq_bf16_with_cudnn_sdp_on(tiny_flux, tmp_path, fmt):
    """The bf16 case as the H200 run had it, before the GPU tests ran under the guard: cuDNN
    SDPA left to PyTorch's choice, which on sm90/sm100 with torch >= 2.11 is to run it (for
    fp16/bf16 only: ``check_dtypes_low_precision`` in ``sdp_utils.cpp``; the fp32 cases never
    take cuDNN). That run's losses were ``[0.2637, nan,
    nan]`` against ``[0.2637, 0.2734, 0.3828]``. A failure here with step 0's gradients not
    finite, while the guarded case passes, is the cuDNN SDPA defect the guard keeps out of runs
    (``./dev gpu-check diagnose``, docs/perf-gpu.md)."""
    _check_trains_as_the_dequantized_model(tiny_flux, tmp_path, fmt, torch.bfloat16)


def test_dequant_on_the_copy_stream_without_host_syncs(tmp_path):
    """Module-backed frozen blocks in 8 bits (page-locked images): two forwards under
    ``set_sync_debug_mode("error")``; dequantization kernels ran (bytes and CUDA event time in
    the ``squareq/step`` record) and the output equals the dequantized model's."""
    torch.manual_seed(0)
    model = Wide().requires_grad_(False)
    reference = Wide().requires_grad_(False)
    reference.load_state_dict(model.state_dict())
    dequantized_in_place(list(reference.blocks), "int8")
    reference.cuda()
    sink = ListSink()
    runtime = WeightRuntime(
        model,
        config(
            pinned_pool_mb=8 * 33,
            pinned_slab_mb=33,  # a 16 MB 8-bit image (64 MB in fp32) in one slab
            max_inflight_transfers=4,
            prefetch_window_blocks=2,
            vram_high_watermark_mb=20000,
            vram_low_watermark_mb=0,
            squareq={"format": "int8", "cache_dir": str(tmp_path)},
        ),
        device="cuda",
        telemetry=Telemetry(sink),
        mode="inference",
    )
    assert all(b.image is not None for b in runtime.blocks)
    x = torch.randn(4096, 2048, device="cuda")
    with torch.no_grad():
        expected = reference(x)
        model(x)  # trace step
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host sync in the hot path raises
        try:
            got = model(x)
            model(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    runtime.end_step()
    assert torch.equal(got, expected)
    records = sink.of("squareq", "step")
    assert sum(r["bytes_dequantized"] for r in records) >= 2 * 8 * 2 * 2048 * 4096 * 4
    assert sum(r["dequant_ms"] for r in records) > 0
    runtime.close()


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_the_cache_quantized_on_the_gpu_is_the_cpus_byte_for_byte(tiny_flux, tmp_path, fmt):
    """NOTE [ Quantizing on the GPU ]: a CUDA runtime quantizes its cache there; the bytes are
    those the CPU writes (bf16 weights), so a cache does not depend on where it was made."""
    from stagehand.squareq import store

    files = []
    for device in ("cpu", "cuda"):
        model = make_model("flux", tiny_flux).to(torch.bfloat16)
        squareq = {"format": fmt, "cache_dir": str(tmp_path / device)}
        runtime = WeightRuntime(
            model, config(squareq=squareq), device=device, checkpoint_dir=tiny_flux
        )
        files.append((runtime.squareq.folder / store.FILE).read_bytes())
        runtime.close()
    assert files[0] == files[1]
