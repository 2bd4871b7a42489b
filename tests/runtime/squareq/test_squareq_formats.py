"""SquareQ's formats: the codes and scales follow their published conventions, quantization is
deterministic, a zero row survives, and the error table names the worst layer."""

import pytest
import torch

from stagehand.config.memory import SQUAREQ_FORMATS
from stagehand.squareq.formats import (
    CPU_CHUNK_ELEMENTS,
    FORMATS,
    QMAX,
    cpu_scratch,
    dequantize,
    dequantize_into,
    error_table,
    quantize,
    relative_rms,
)
from stagehand.squareq.image import pack, packed_bytes, unpack


def weight(rows=48, cols=80, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.linspace(0.01, 4, rows)[:, None]
    return w.to(dtype)


def test_every_format_a_config_names_is_implemented():
    """The names are ``stagehand.config.memory.SQUAREQ_FORMATS`` (the Literal a config is checked
    against); ``FORMATS`` holds one storage dtype per name, in the same order."""
    assert tuple(FORMATS) == SQUAREQ_FORMATS == ("int8", "fp8_e4m3")
    assert QMAX == {"int8": 127.0, "fp8_e4m3": 448.0}


def test_int8_is_symmetric_per_row_with_the_half_step_bound():
    w = weight()
    codes, scales = quantize(w, "int8")
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (48,)
    wf = w.float()
    assert torch.equal(scales, wf.abs().amax(dim=1) / 127)
    assert int(codes.abs().max()) == 127  # each row's largest weight takes the largest code
    restored = dequantize(codes, scales, torch.float32)
    # Rounding to nearest: at most half a step per element, per row.
    assert bool(((restored - wf).abs() <= scales[:, None] / 2 * (1 + 1e-6)).all())


def test_fp8_follows_musubi_fp8_scaled_per_channel():
    """musubi-tuner's ``quantize_fp8``: ``(w / scale).clamp(-448, 448).to(float8_e4m3fn)`` with
    ``scale = max|w_row| / 448``; the weight is ``q.to(dtype) * scale`` (ComfyUI's
    ``scale_weight`` convention)."""
    w = weight(dtype=torch.float32)
    codes, scales = quantize(w, "fp8_e4m3")
    expected = (w / (w.abs().amax(dim=1) / 448)[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert codes.dtype == torch.float8_e4m3fn
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(dequantize(codes, scales, torch.float32), codes.float() * scales[:, None])


@pytest.mark.parametrize("fmt", SQUAREQ_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_deterministic_and_dequantized_in_one_rounding(fmt, dtype):
    w = weight(dtype=dtype)
    a, b = quantize(w, fmt), quantize(w.clone(), fmt)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
    got = dequantize(*a, dtype)
    assert got.dtype == dtype
    assert torch.equal(got, (a[0].float() * a[1][:, None]).to(dtype))
    # The GPU's formula (codes copied into the output, then a mixed-dtype product) on the same
    # operands: the same bits as the CPU's one fp32 buffer.
    gpu_formula = torch.empty_like(got).copy_(a[0])
    torch.mul(gpu_formula, a[1][:, None], out=gpu_formula)
    assert torch.equal(got, gpu_formula)
    bound = 0.01 if fmt == "int8" else 0.04  # int8 ~0.4-0.7%, e4m3 ~2.5% on Gaussian rows
    assert 0 < relative_rms(w, got) < bound


def bits(t):
    """The raw bits of ``t`` (NaN compares equal to the same NaN)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("fmt", SQUAREQ_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_row_chunks_equal_the_one_rounding_formula(fmt, dtype):
    """The CPU path's row chunks through a reused fp32 scratch give the bits of
    ``(float(q) * s).to(dtype)`` on random weights: one chunk, a remainder chunk, one row per
    chunk, a row wider than the default chunk, and every float8 code (NaN ones included)."""
    cases = [weight(rows=48, cols=80, dtype=dtype, seed=1)]
    cases.append(weight(rows=CPU_CHUNK_ELEMENTS // 100 + 7, cols=100, dtype=dtype, seed=2))
    cases.append(weight(rows=2, cols=CPU_CHUNK_ELEMENTS + 3, dtype=dtype, seed=3))
    for w in cases:
        codes, scales = quantize(w, fmt)
        reference = (codes.float() * scales[:, None]).to(dtype)
        rows, cols = codes.shape
        for scratch in (None, cpu_scratch(rows, cols), torch.empty(cols + 5), torch.empty(1)):
            out = torch.full_like(w, float("nan"))
            assert dequantize_into(out, codes, scales, scratch) is out
            assert torch.equal(bits(out), bits(reference))
    if fmt == "fp8_e4m3":  # all 256 bit patterns, two rows of 128, scales not powers of two
        codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(2, 128)
        scales = torch.tensor([0.0123, 3.7])
        reference = (codes.float() * scales[:, None]).to(dtype)
        got = dequantize_into(torch.empty(2, 128, dtype=dtype), codes, scales, torch.empty(130))
        assert torch.equal(bits(got), bits(reference))


def test_zero_row_gets_scale_one_and_zero_codes():
    w = weight(dtype=torch.float32)
    w[3] = 0
    for fmt in SQUAREQ_FORMATS:
        codes, scales = quantize(w, fmt)
        assert float(scales[3]) == 1.0 and not codes[3].float().any()
        assert not dequantize(codes, scales, torch.float32)[3].any()


def test_refuses_what_it_cannot_quantize():
    with pytest.raises(ValueError, match="int4"):
        quantize(weight(), "int4")
    with pytest.raises(ValueError, match=r"2-D floating weights, got shape \(4, 4, 4\)"):
        quantize(torch.zeros(4, 4, 4), "int8")


def test_packed_entry_round_trips():
    codes, scales = quantize(weight(rows=5, cols=7), "int8")
    entry = pack(codes, scales)
    assert (
        entry.dtype == torch.uint8 and entry.numel() == packed_bytes(5, 7) == 32 + 35
    )  # 20 bytes of scales padded to 32
    c, s = unpack(entry, 5, 7, "int8")
    assert torch.equal(c, codes) and torch.equal(s, scales)


def test_error_table_names_the_worst_layer():
    from stagehand.squareq.formats import LayerError

    table = error_table(
        [
            LayerError("a", (2, 2), 0.01),
            LayerError("b", (2, 2), 0.03),
            LayerError("c", (2, 2), 0.02),
        ]
    )
    assert table["worst_layer"] == "b" and table["rel_rms_max"] == 0.03
    assert table["quantized_layers"] == 3 and abs(table["rel_rms_mean"] - 0.02) < 1e-12
    assert [n for n, _ in table["worst_layers"]] == ["b", "c", "a"]


@pytest.mark.parametrize("fmt", SQUAREQ_FORMATS)
def test_block_image_fills_mixed_dtype_layouts_bit_exactly(fmt):
    """``BlockImage.dequantize`` (typed views of the image and the buffer, one scratch per
    block) writes each quantized weight as the one-rounding formula and copies the rest, in a
    block mixing bf16 and fp32 linears, biases and a norm."""
    from torch import nn

    from stagehand.squareq.image import BlockImage
    from stagehand.weights.registry import Block, build_layout

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(80, 48), nn.LayerNorm(48), nn.Linear(48, 40).float())
    module[0].to(torch.bfloat16)
    module[1].to(torch.bfloat16)
    block = Block("b", 0, module)
    build_layout(block, {p: n for n, p in module.named_parameters()})
    image = BlockImage(fmt)
    host = {}
    for slot in block.layout:
        entry = image.add(slot, slot.name.endswith("weight") and len(slot.shape) == 2)
        param = module.get_parameter(slot.name).detach()
        host[id(entry)] = pack(*quantize(param, fmt)) if entry.quantized else param
    packed = torch.zeros(image.nbytes, dtype=torch.uint8)
    for entry in image.slots:
        view = packed[entry.offset : entry.offset + entry.nbytes]
        view.view(entry.dtype).view(entry.shape).copy_(host[id(entry)])
    flat = torch.zeros(block.nbytes, dtype=torch.uint8)
    image.dequantize(packed, flat)
    for slot in block.layout:
        got = flat[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        param = module.get_parameter(slot.name).detach()
        if len(slot.shape) == 2:
            codes, scales = quantize(param, fmt)
            param = (codes.float() * scales[:, None]).to(slot.dtype)
        assert got.dtype == param.dtype and torch.equal(bits(got), bits(param)), slot.name


@pytest.mark.parametrize("fmt", SQUAREQ_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_is_its_rule_computed_plainly_in_fp32(fmt, dtype):
    """The row maximum taken without a |w| temporary and the division promoted from the
    weight's dtype give the codes and scales of the rule written out in fp32, over rows of
    nine decades, a zero row and an all-negative one."""
    w = weight(257, 301, dtype=torch.float32) * torch.logspace(-6, 3, 257)[:, None]
    w[3], w[5] = 0, -w[5].abs()
    w = w.to(dtype)
    qmax = {"int8": 127.0, "fp8_e4m3": 448.0}[fmt]
    wf = w.float()
    scale = wf.abs().amax(dim=1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    x = (wf / scale[:, None]).clamp(-qmax, qmax)
    expected = x.round().to(torch.int8) if fmt == "int8" else x.to(torch.float8_e4m3fn)
    codes, scales = quantize(w, fmt)
    assert torch.equal(scales, scale)
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))


def test_relative_rms_in_chunks_is_the_whole_weight_figure(monkeypatch):
    """Chunked, with the difference in fp32, it is the one-pass fp64 figure up to summation order."""
    import stagehand.squareq.formats as formats

    w = weight(64, 96, dtype=torch.float32)
    restored = dequantize(*quantize(w, "int8"), torch.float32)
    whole = float(
        torch.linalg.vector_norm(w.double() - restored.double())
        / torch.linalg.vector_norm(w.double())
    )
    monkeypatch.setattr(formats, "RMS_CHUNK_ELEMENTS", 1000)  # 7 chunks, the last one short
    assert relative_rms(w, restored) == pytest.approx(whole, rel=1e-9) and whole > 0
