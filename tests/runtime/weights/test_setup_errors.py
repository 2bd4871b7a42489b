"""Bad input raises a named error at set-up, naming the parameter, block or field."""

import shutil
import struct

import pydantic
import pytest
import torch
from torch import nn

from stagehand.config.memory import MB, StagehandConfig
from stagehand.weights import (
    BlockState,
    BlockStateError,
    BlockTooLargeError,
    ParameterMismatchError,
    PinnedPool,
    PoolConfigError,
    SlabTimeoutError,
    UnmatchedParameterError,
    WeightRuntime,
)
from stagehand.weights.errors import StagehandSetupError
from stagehand.weights.registry import Block
from stagehand.weights.sources import SafetensorsCheckpoint

from ._train import config, make_model


class Tower(nn.Module):
    """Four 2.1 MB blocks (two 512x512 linears each) between a resident stem and head."""

    def __init__(self, width: int = 512, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(16, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 16) -> (B, 4)
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_unmatched_checkpoint_key_names_the_parameter(tiny_flux):
    model = make_model("flux", tiny_flux)
    model.transformer_blocks[0].extra_scale = nn.Parameter(torch.ones(3), requires_grad=False)
    with pytest.raises(UnmatchedParameterError, match=r"transformer_blocks\.0\.extra_scale"):
        WeightRuntime(model, config(), device="cpu", checkpoint_dir=tiny_flux)


def test_shape_and_dtype_mismatch_name_the_parameter(tiny_flux):
    model = make_model("flux", tiny_flux)
    linear = model.single_transformer_blocks[1].proj_out
    linear.weight = nn.Parameter(torch.zeros(linear.weight.shape[0], 7), requires_grad=False)
    with pytest.raises(
        ParameterMismatchError, match=r"single_transformer_blocks\.1\.proj_out\.weight.*\(64, 7\)"
    ):
        WeightRuntime(model, config(), device="cpu", checkpoint_dir=tiny_flux)
    model = make_model("flux", tiny_flux)  # another float precision is converted; ints not
    linear = model.transformer_blocks[1].norm1.linear
    linear.weight = nn.Parameter(linear.weight.data.to(torch.int8), requires_grad=False)
    with pytest.raises(
        ParameterMismatchError, match=r"transformer_blocks\.1\.norm1\.linear\.weight.*int8"
    ):
        WeightRuntime(model, config(), device="cpu", checkpoint_dir=tiny_flux)


def test_a_checkpoint_header_length_past_its_file_names_the_file(tiny_flux, tmp_path):
    """Read as is, the length field asked for 2^62 bytes: a ``MemoryError`` with no message."""
    folder = shutil.copytree(tiny_flux, tmp_path / "flux")
    shard = sorted(folder.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 2**62)
    shard.write_bytes(bytes(data))
    with pytest.raises(StagehandSetupError) as info:
        SafetensorsCheckpoint(folder)
    assert str(info.value).startswith(f"{shard}: header length 4611686018427387904 bytes")


def test_block_larger_than_pool_is_refused_with_sizes():
    with pytest.raises(BlockTooLargeError, match=r"'blocks\.0' needs 2\.00 MB.*pool \(1\.00 MB"):
        WeightRuntime(Tower(), config(pinned_pool_mb=1, pinned_slab_mb=1), device="cpu")


def test_block_larger_than_slab_takes_direct_path():
    torch.manual_seed(0)
    plain, streamed = Tower(), Tower()
    streamed.load_state_dict(plain.state_dict())
    runtime = WeightRuntime(streamed, config(pinned_pool_mb=4, pinned_slab_mb=1), device="cpu")
    assert all(b.nbytes > runtime.pool.slab_bytes for b in runtime.blocks)
    x = torch.randn(3, 16)
    for _ in range(2):
        with runtime.managed_forward():
            out = streamed(x)
        with runtime.managed_backward():  # gradients are readable once backward ended
            out.sum().backward()
    plain(x).sum().backward()
    plain(x).sum().backward()
    assert torch.equal(out, plain(x))
    for (name, p), q in zip(plain.named_parameters(), streamed.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert runtime.pool.allocated_bytes == 0  # the direct path never touched a slab


def test_low_watermark_above_high_is_refused():
    with pytest.raises(pydantic.ValidationError, match="vram_low_watermark_mb"):
        StagehandConfig(vram_high_watermark_mb=100, vram_low_watermark_mb=200)
    unchecked = StagehandConfig.model_construct(
        vram_high_watermark_mb=100, vram_low_watermark_mb=200
    )
    with pytest.raises(
        ValueError, match=r"vram_low_watermark_mb \(200\).*vram_high_watermark_mb \(100\)"
    ):
        WeightRuntime(Tower(), unchecked, device="cpu")


def test_zero_slabs_is_refused():
    with pytest.raises(pydantic.ValidationError, match="zero slabs"):
        StagehandConfig(pinned_pool_mb=1, pinned_slab_mb=2)
    unchecked = StagehandConfig.model_construct(pinned_pool_mb=1, pinned_slab_mb=2)
    with pytest.raises(PoolConfigError, match="zero slabs"):
        WeightRuntime(Tower(), unchecked, device="cpu")
    with pytest.raises(PoolConfigError, match="positive"):
        PinnedPool(0, 1024, pin=False, timeout_s=1)


def test_slab_acquire_times_out_naming_holders():
    pool = PinnedPool(2048, 1024, pin=False, timeout_s=0.05)
    pool.acquire("transformer_blocks.3", lambda: False)
    pool.acquire("transformer_blocks.4", lambda: False)
    with pytest.raises(
        SlabTimeoutError, match=r"slab 0: transformer_blocks\.3, slab 1: transformer_blocks\.4"
    ):
        pool.acquire("transformer_blocks.5", lambda: False)


def test_illegal_block_transition_names_both_states():
    block = Block(name="transformer_blocks.0", index=0, module=nn.Linear(2, 2))
    with pytest.raises(BlockStateError, match="UNLOADED -> GPU_READY .*expected HOST_STAGED"):
        block.to(BlockState.GPU_READY)


def test_a_pool_that_cannot_be_page_locked_fails_at_set_up_or_falls_back():
    """The pinned pool is page-locked at set-up in one allocation. Here
    (no CUDA) page-locking fails as it does under a pinned-memory cap: a clear error naming
    pinned_pool_mb and the way out, or pageable slabs, all allocated now, with the fallback."""
    with pytest.raises(PoolConfigError, match=r"pinned_pool_mb.*allow_pageable_fallback"):
        PinnedPool(4 * MB, MB, pin=True, timeout_s=1)
    pool = PinnedPool(4 * MB, MB, pin=True, timeout_s=1, allow_pageable=True)
    assert not pool.pin and pool.locked_bytes == 0
    assert pool.allocated_bytes == 4 * MB  # at set-up, not mid-step
    slab = pool.try_acquire("block 0")
    assert slab.buffer.numel() == MB
    pool.close()
    assert pool.slabs == [] and pool.allocated_bytes == 0


def test_a_renamed_middle_segment_still_finds_its_checkpoint_tensor(tmp_path):
    """transformers 5 saves Qwen2.5-VL's language layers as ``model.layers.N`` and loads them
    as ``model.language_model.layers.N``: the file-backed runtime matches the unique tail."""
    from safetensors.torch import save_file

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.language_model = Inner()

        def forward(self, x):
            for layer in self.model.language_model.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Outer().requires_grad_(False)
    state = {k.replace("language_model.", ""): v.clone() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    x = torch.randn(2, 8)
    expected = model(x)
    runtime = WeightRuntime(model, config(), device="cpu", checkpoint_dir=tmp_path)
    assert all(s.key.startswith("model.layers.") for b in runtime.blocks for s in b.layout)
    with torch.no_grad(), runtime.managed_forward():
        assert torch.equal(model(x), expected)
    runtime.close()
