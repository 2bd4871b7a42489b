"""Pack/unpack contract: ``unpack(pack(t))`` equals ``t`` in value, size, stride, dtype and
device for views and non-contiguous tensors; what is never spilled; checksums; refusals."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from stagehand.activations import (
    STEP_FIELDS,
    ActivationRuntime,
    ActivationState,
    ActivationStateError,
    ChecksumError,
    SpilledTensor,
)
from stagehand.common.telemetry import ListSink, Telemetry
from stagehand.conductor.transfer import TransferManager
from stagehand.config.memory import ActivationStagehandConfig

SPILL_ALL = {
    "vram_high_watermark_mb": 0,
    "vram_low_watermark_mb": 0,
    "min_spill_bytes": 0,
    "pinned_pool_classes_mb": (0.0625, 0.25),
    "slabs_per_class": (8, 2),
}
DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _base(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype)


def _view(t, kind):
    if kind == "transpose" and t.dim() >= 2:
        return t.transpose(0, -1)
    if kind == "permute":
        return t.permute(*reversed(range(t.dim())))
    if kind == "step_slice":
        return t[::2]
    if kind == "narrow" and t.shape[0] > 1:
        return t.narrow(0, 1, t.shape[0] - 1)  # storage offset > 0
    if kind == "expand":
        return t[:1].expand(3, *t.shape[1:])  # stride 0
    if kind == "diagonal" and t.dim() >= 2:
        return t.diagonal(dim1=0, dim2=1)
    return t


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(
        ["contiguous", "transpose", "permute", "step_slice", "narrow", "expand", "diagonal"]
    ),
    seed=st.integers(0, 2**16),
)
@pytest.mark.sync_device  # a spill is SPILLED when pack returns
def test_unpack_of_pack_equals_the_tensor(shape, dtype, kind, seed):
    runtime = ActivationRuntime(ActivationStagehandConfig(**SPILL_ALL), device="cpu")
    runtime.begin_step(0)
    base = _base(tuple(shape), dtype, seed)
    t = _view(base, kind)
    handle = runtime.packer(t)
    assert isinstance(handle, SpilledTensor)
    record = handle.record
    assert record.state is ActivationState.SPILLED
    # Only the storage span of the view is copied, never the rest of its base.
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    assert record.nbytes == span * t.element_size() <= base.nbytes
    out = handle.unpack()
    assert out.shape == t.shape and out.stride() == t.stride()
    assert out.dtype == t.dtype and out.device == t.device
    assert torch.equal(out, t)
    assert out.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    del handle, out
    assert record.state is ActivationState.RELEASED
    runtime.end_step()
    m = runtime.step_metrics()
    assert (m["activations_spilled"], m["activations_restored"], m["stall_count"]) == (1, 1, 1)
    assert runtime.pool.in_use() == 0


def test_parameters_buffers_and_their_views_are_never_spilled():
    model = nn.Linear(64, 64)
    model.register_buffer("scale", torch.ones(4096))
    runtime = ActivationRuntime(ActivationStagehandConfig(**SPILL_ALL), device="cpu", model=model)
    runtime.begin_step(0)
    for weight in (model.weight, model.weight.t(), model.weight[2:], model.scale, model.bias):
        assert not isinstance(runtime.packer(weight), SpilledTensor)
    assert runtime.memory.tracked_bytes("activations") == 0  # weights are not activations
    assert isinstance(runtime.packer(torch.randn(64, 64)), SpilledTensor)
    runtime.end_step()
    m = runtime.step_metrics()
    assert (m["activations_saved"], m["activations_kept"], m["activations_spilled"]) == (6, 5, 1)
    # Without the model, a leaf that requires grad is taken for a parameter.
    bare = ActivationRuntime(ActivationStagehandConfig(**SPILL_ALL), device="cpu")
    bare.begin_step(0)
    assert not isinstance(bare.packer(torch.randn(64, 64, requires_grad=True)), SpilledTensor)
    assert isinstance(bare.packer(torch.randn(64, 64)), SpilledTensor)
    bare.end_step()


def test_small_tensors_stay_below_min_spill_and_recompute_threshold():
    fields = dict(SPILL_ALL, min_spill_bytes=1024, recompute_threshold_bytes=4096)
    runtime = ActivationRuntime(ActivationStagehandConfig(**fields), device="cpu")
    runtime.begin_step(0)
    assert not isinstance(runtime.packer(torch.zeros(256)), SpilledTensor)  # 1 KB < 4 KB
    assert not isinstance(runtime.packer(torch.zeros(1023)), SpilledTensor)
    assert isinstance(runtime.packer(torch.zeros(1024)), SpilledTensor)  # 4 KB
    runtime.end_step()


@pytest.mark.sync_device  # corrupts the host copy right after the spill
def test_checksum_mismatch_raises_with_record_id():
    fields = dict(SPILL_ALL, debug_checksums=True)
    runtime = ActivationRuntime(ActivationStagehandConfig(**fields), device="cpu")
    runtime.begin_step(0)
    good = runtime.packer(torch.randn(32, 32))
    assert torch.equal(good.unpack(), good.unpack())
    bad = runtime.packer(torch.randn(32, 32))
    bad.record.buffer[17] ^= 0xFF  # the host copy is corrupted while spilled
    with pytest.raises(ChecksumError, match=rf"activation record {bad.record.id} .*CRC32"):
        bad.unpack()
    runtime.end_step()


@pytest.mark.sync_device  # D2H grants released when pack returns
def test_conductor_denial_keeps_the_tensor_and_grants_are_released():
    manager = TransferManager(h2d_slots=1, d2h_slots=1)
    runtime = ActivationRuntime(ActivationStagehandConfig(**SPILL_ALL), device="cpu")
    runtime.conductor = manager
    runtime.begin_step(0)
    held = manager.request_transfer("d2h", "required")  # someone else holds the only slot
    t = torch.randn(64, 64)
    kept = runtime.packer(t)
    assert not isinstance(kept, SpilledTensor) and kept.unpack() is t
    assert runtime.registry.counts()["KEPT"] == 1
    held.release()
    spilled = runtime.packer(t)
    assert isinstance(spilled, SpilledTensor)
    assert manager.inflight("d2h") == 0  # released once the copy completed
    runtime.transfer.set_caps(0, None)  # the Conductor's "no new spills" cap (OPTIMIZER)
    assert not isinstance(runtime.packer(t), SpilledTensor)
    assert runtime.metrics.spills_denied == 2
    runtime.end_step()
    m = runtime.step_metrics()
    assert (m["activations_saved"], m["activations_kept"], m["activations_spilled"]) == (3, 2, 1)
    assert len(runtime.registry) == 0


def test_step_end_releases_records_and_emits_the_seed_record():
    sink = ListSink()
    runtime = ActivationRuntime(
        ActivationStagehandConfig(**SPILL_ALL), device="cpu", telemetry=Telemetry(sink)
    )
    runtime.begin_step(7)
    handle = runtime.packer(torch.randn(64, 64))
    runtime.end_step()  # backward never ran
    assert handle.record.state is ActivationState.RELEASED
    assert runtime.pool.in_use() == 0
    with pytest.raises(ActivationStateError, match="was released"):
        handle.unpack()
    (record,) = sink.of("activation_stagehand", "step")
    envelope = {"seq", "time", "source", "kind", "step", "phase"}
    assert set(record) == envelope | set(STEP_FIELDS)
    assert record["step"] == 7 and record["activations_spilled"] == 1
    assert record["activations_restored"] == 0 and record["spill_bytes"] == 64 * 64 * 4
