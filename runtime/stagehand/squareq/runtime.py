"""SquareQ on a weight runtime's blocks: which weights are quantized, their images, the cache,
the dequantization timer and the ``squareq/step`` record.

``SquareQ.attach(blocks, source, config)`` is called by the weight runtime at set-up, after its
blocks are registered: every block with a quantizable weight gets ``block.image`` (a
``BlockImage``), which the transfer engine, the pinned pool and the host cache then stage in
place of the block buffer. Which weights: the 2-D ``weight`` of each ``nn.Linear`` inside a block
(peft's LoRA-wrapped ``base_layer`` included), frozen and floating; everything else (biases,
norms, embeddings, convolutions, trainable weights) stays in the model's dtype.

File-backed blocks read their images from SquareQ's cache (``store.py``: every file-backed block
tensor, so ``folder`` replaces the runtime's checkpoint for the blocks); module-backed ones are quantized in memory and
their compute-dtype host masters are released (the host holds 8 bits).
"""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

import torch
from torch import nn

from stagehand.config.memory import MB
from stagehand.config.records import SQUAREQ_STEP
from stagehand.squareq import prequantized, store
from stagehand.squareq.formats import LayerError, dequantize, error_table, quantize, relative_rms
from stagehand.squareq.image import BlockImage, pack


def linear_weight(
    module: nn.Module, leaf: str, shape: Any, dtype: torch.dtype, frozen: bool
) -> bool:
    """SquareQ's rule: parameter ``leaf`` of ``module`` is quantized when it is the 2-D floating
    ``weight`` of an ``nn.Linear`` (peft's ``base_layer`` of a LoRA target is one) and frozen."""
    return (
        leaf == "weight"
        and isinstance(module, nn.Linear)
        and len(shape) == 2
        and dtype.is_floating_point
        and frozen
    )


def quantizable(block_module: nn.Module, slot: Any) -> bool:
    """``linear_weight`` for layout slot ``slot`` of a block."""
    owner, _, leaf = slot.name.rpartition(".")
    module = block_module.get_submodule(owner) if owner else block_module
    return linear_weight(module, leaf, slot.shape, slot.dtype, not slot.trainable)


def slot_kinds(block: Any, source: Any) -> list[tuple[Any, bool, bool]]:
    """``(slot, quantized, stored)`` for each slot of ``block``'s layout: whether SquareQ
    quantizes it (``quantizable``) and whether its checkpoint tensor is already float8_e4m3fn
    (``prequantized.is_prequantized``; ``source`` None: module-backed, never).

    Raises:
        PrequantizedCheckpointError: a float8_e4m3fn tensor whose parameter is not a frozen
            linear weight (names the key and the parameter).
    """
    out = []
    for slot in block.layout:
        quantized = quantizable(block.module, slot)
        stored = prequantized.is_prequantized(source, slot.key)
        if stored and not quantized:
            raise prequantized.PrequantizedCheckpointError(
                f"checkpoint tensor {slot.key!r} is float8_e4m3fn but parameter "
                f"{slot.qualname!r} is not a frozen linear weight SquareQ streams"
            )
        out.append((slot, quantized, stored))
    return out


def cache_entries(blocks: list[Any], source: Any) -> list[store.Entry]:
    """The tensors SquareQ's cache holds for ``blocks`` (weight runtime ``Block``s whose
    file-backed slots carry their checkpoint ``key``): every keyed slot, in layout order, with
    its compute dtype and whether it is quantized (``slot_kinds``). What ``store.cache_key``
    hashes: the run's set-up and the planner (``workbench.plan.quant_error``) both build it here.
    """
    return [
        store.Entry(slot.key, slot.dtype, tuple(slot.shape), quantized, stored)
        for block in blocks
        for slot, quantized, stored in slot_kinds(block, source)
        if slot.key is not None
    ]


class DequantTimer:
    """Bytes dequantized and the time it took: host time on CPU, CUDA events on a GPU (read
    when they completed). Thread-safe: reader threads issue copies too."""

    def __init__(self) -> None:
        self.bytes = 0
        self.blocks = 0
        self.ms = 0.0
        self._pending: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def launch(self, stream: Any, image: BlockImage, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``image.dequantize(src, dst)`` launched on ``stream`` (a ``TransferStream``, inside
        ``use()``), timed: between two CUDA events on the stream, or on the host while the
        kernel runs where there are no streams (at once on the CPU, late under a device double)."""
        if stream.stream is None:
            stream.launch(partial(self._timed, image), src, dst)
            return
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record(stream.stream)
        stream.launch(image.dequantize, src, dst)
        end.record(stream.stream)
        with self._lock:
            self.bytes += image.dequantized_bytes
            self.blocks += 1
            self._pending.append((start, end))

    def _timed(self, image: BlockImage, src: torch.Tensor, dst: torch.Tensor) -> None:
        t0 = time.perf_counter()
        image.dequantize(src, dst)
        with self._lock:
            self.bytes += image.dequantized_bytes
            self.blocks += 1
            self.ms += (time.perf_counter() - t0) * 1e3

    def totals(self) -> tuple[int, int, float]:
        """(bytes, blocks, ms) so far; events not yet complete are counted later."""
        with self._lock:
            keep = []
            for start, end in self._pending:
                if end.query():
                    self.ms += start.elapsed_time(end)
                else:
                    keep.append((start, end))
            self._pending = keep
            return self.bytes, self.blocks, self.ms


class SquareQ:
    """SquareQ attached to a weight runtime's blocks (see the module docstring)."""

    def __init__(self, fmt: str | None) -> None:
        self.format = fmt
        """``int8`` or ``fp8_e4m3``; None: off."""
        self.timer = DequantTimer()
        self.folder = None
        """SquareQ's cache checkpoint folder (file-backed blocks), else None."""
        self.info: dict[str, Any] = {}
        """The first record's fields: error table, quantize time, cache reuse."""
        self.image_bytes = 0
        """Bytes of every block image (what the host cache would hold)."""
        self.block_bytes = 0
        """Bytes of those blocks' compute-dtype buffers (what they would hold without SquareQ)."""
        self.largest_image = 0
        self._last = (0, 0, 0.0)
        self._first = True

    @classmethod
    def attach(
        cls,
        blocks: list[Any],
        source: Any,
        config: Any,
        progress: bool = True,
        device: torch.device | None = None,
    ) -> tuple[SquareQ, Any]:
        """``(squareq, source)``: each block with a quantizable weight given its ``image``, and
        the checkpoint the blocks now read (SquareQ's cache, opened as ``source``'s class; the
        old one closed). When ``config`` is None (off) or no block has a quantizable weight,
        ``source`` unchanged and a SquareQ that is off (``enabled`` False, ``emit`` a no-op).

        ``source``: the runtime's ``SafetensorsCheckpoint`` (None: module-backed); ``config``:
        ``memory.stagehand.squareq`` (``SquareQConfig``) or None; ``device``: the compute
        device (a CUDA one quantizes what the cache lacks there: NOTE [ Quantizing on the
        GPU ] in ``store.py``).
        """
        keys = [
            s.key
            for b in blocks
            for s in b.layout
            if s.key is not None and s.dtype.is_floating_point
        ]
        for key in keys:  # 8-bit checkpoint tensors: readable as stored, or refused by name
            prequantized.check(source, key, squareq_on=config is not None)
        if config is None:
            return cls(None), source
        self = cls(config.format)
        images: list[tuple[Any, BlockImage]] = []
        for block in blocks:
            image = BlockImage(config.format, timer=self.timer)
            for slot, quantized, stored in slot_kinds(block, source):
                image.add(slot, quantized, slot.key, "fp8_e4m3" if stored else None)
            if image.dequantized_bytes:
                images.append((block, image))
        entries = cache_entries(blocks, source)
        if not images:
            return cls(None), source
        t0 = time.perf_counter()
        if entries:
            bar = store.progress_bar(config.format) if progress else None
            root = store.cache_root(config.cache_dir)
            self.folder, self.info = store.ensure(
                source, entries, config.format, root, bar, device=device
            )
        errors = _pack_hosts([image for _, image in images], config.format)
        for block, image in images:
            block.image = image
            self.image_bytes += image.nbytes
            self.block_bytes += block.nbytes
            self.largest_image = max(self.largest_image, image.nbytes)
        if errors:
            self.info = {
                **error_table(errors),
                "quantize_s": time.perf_counter() - t0,
                "cached": False,
                "format": config.format,
            }
        if self.folder is not None:
            source.close()
            source = type(source)(self.folder)
        return self, source

    @property
    def enabled(self) -> bool:
        return self.format is not None

    def emit(self, telemetry: Any) -> None:
        """Write the ``squareq/step`` record (``step_record``) when SquareQ is on."""
        if self.enabled:
            telemetry.emit(*SQUAREQ_STEP, **self.step_record())

    def _note(self, nbytes: int, ms: float) -> str:
        """One line for the run page's weights fact."""
        ratio = self.image_bytes / max(self.block_bytes, 1)
        note = (
            f"SquareQ {self.format}: blocks held and copied in 8 bits ({ratio:.2f}x of "
            f"{self.block_bytes / MB:.1f} MB), {nbytes / MB:.1f} MB dequantized on the device "
            f"in {ms:.1f} ms this step"
        )
        if "worst_layer" in self.info:
            note += (
                f"; worst layer {self.info['worst_layer']} at {100 * self.info['rel_rms_max']:.2f}% "
                "relative RMS error"
            )
        return note

    def step_record(self) -> dict[str, Any]:
        """The ``squareq/step`` fields since the last record (a step's, and the prefetch of its
        first blocks issued at the previous step's end); the first one also carries the error
        table and the quantization time (``info``)."""
        nbytes, blocks, ms = self.timer.totals()
        b0, k0, m0 = self._last
        self._last = (nbytes, blocks, ms)
        record = {
            "format": self.format,
            "bytes_dequantized": nbytes - b0,
            "blocks_dequantized": blocks - k0,
            "dequant_ms": ms - m0,
            "image_mb": self.image_bytes / MB,
            "block_mb": self.block_bytes / MB,
            "image_ratio": self.image_bytes / self.block_bytes if self.block_bytes else None,
            "note": self._note(nbytes - b0, ms - m0),
        }
        if self._first:
            self._first = False
            record.update({k: v for k, v in self.info.items() if k != "format"})
        return record


def _pack_hosts(images: list[BlockImage], fmt: str) -> list[LayerError]:
    """Quantize the module-backed weights of ``images`` in memory (their packed entries become
    the host copies; the compute-dtype masters are released: the host keeps 8 bits only)."""
    errors = []
    for image in images:
        for slot in image.slots:
            if not slot.quantized or slot.key is not None:
                continue
            target = slot.target
            codes, scales = quantize(target.host, fmt)
            restored = dequantize(codes, scales, target.dtype)
            errors.append(
                LayerError(
                    target.qualname, tuple(target.shape), relative_rms(target.host, restored)
                )
            )
            slot.packed = pack(codes, scales)
            target.host = None
            target.param.data = torch.empty(0, dtype=target.dtype)
    return errors


def image_nbytes(block: Any) -> int:
    """Bytes of ``block``'s 8-bit image (both formats store 1-byte codes and fp32 row scales)
    from its layout alone, no data: what SquareQ would stage, cache and copy per load (the
    planner's figure; equal to ``block.nbytes``'s share when nothing in it is quantizable)."""
    image = BlockImage("int8")
    for slot in block.layout:
        image.add(slot, quantizable(block.module, slot))
    return image.nbytes if image.dequantized_bytes else block.nbytes


def dequantized_in_place(blocks: list[nn.Module], fmt: str) -> int:
    """Replace every quantizable weight of ``blocks`` (block modules, ``find_blocks``) by
    ``dequantize(quantize(w))``: the model a SquareQ run computes with, all resident (the
    exactness suite's reference; a user's "what does 8 bits cost" check). Returns the count.
    Parameters shared by several blocks are not skipped: the weight runtime keeps those
    resident and unquantized (NOTE [ Shared parameters ]), so leave them out of ``blocks``."""
    count = 0
    with torch.no_grad():
        for block in blocks:
            for module in block.modules():
                weight = getattr(module, "weight", None)
                if weight is not None and linear_weight(
                    module, "weight", weight.shape, weight.dtype, not weight.requires_grad
                ):
                    weight.data = dequantize(*quantize(weight, fmt), weight.dtype)
                    count += 1
    return count


# NOTE [ Resident blocks stay dequantized ]
# Should blocks that stay on the device be held as their 8-bit image and dequantized
# at each use, so that more of them stay? Measured and planned, not adopted:
# - Bytes: a FLUX.1-dev double block is 648.2 MiB in bf16 and 324.5 MiB as an int8 image, a
#   single block 270.1 vs 135.2 MiB (``image_nbytes``). Planned (``workbench plan``'s path,
#   flux-dev-24gb's memory section with ``squareq: int8``, the sparse real-size folder of
#   tests/fixtures/sparse_pipelines.py, rtx4090 profile, 1024 px): today 23 blocks stay and 34
#   are loaded per step, 7.20 GB of images copied (14.39 GB in bf16); with every block held as
#   its image on the device (block bytes = image bytes, plus two bf16 working buffers of the
#   largest block) all 57 stay, peak 14983 MiB of 24576: 34 more blocks, 7.20 GB/step less H2D.
# - Time saved: none. The step is compute-bound: 4250 ms of compute, the 7.20 GB of copies take
#   288 ms at 25 GB/s on the copy engine and are all hidden (0 ms exposed), with or without 8-bit
#   residency (the meta-config plan, workbench.plan.reference.flux_dev_plan, at 512 px likewise:
#   1245 ms compute, 4.51 GB copied, 0 ms exposed; 22 loads, all 57 blocks stay in 8 bits).
# - Time added: every use dequantizes, forward and backward (one use each under gradient
#   checkpointing: the buffer lives through recomputation and backward), 2 x 57 block
#   dequantizations per step instead of the 34 loads'. Modelled, no GPU measured: bytes read
#   and written over device memory bandwidth, 11.88 B parameters per pass; today's GPU formula
#   (``formats.dequantize_into``: codes copied into the output, then an in-place product) moves
#   7 bytes per parameter, a fused kernel 3. At the rtx4090 profile's 1008 GB/s: +116 ms/step
#   (+50 fused), 2.7% (1.2%) of the step; at 3 TB/s: +39 (+17) ms. Per block and use: double
#   2.36 ms (1.01 fused), single 0.99 ms (0.42) at 1008 GB/s. On the CPU (NOTE [ CPU
#   dequantization ]) one use costs 67 ms (double) and 30 ms (single) in int8: 0.21 ms per MiB
#   kept, 4.8 s per real-size step for all 57 blocks twice.
# So on the 24 GB target the trade buys PCIe bytes the step does not wait for with device time
# it does; it would pay only where copies are exposed with SquareQ on (a card or resolution where
# the 8-bit images still outrun compute), which none of the planned FLUX cases is. Reproduce:
# the planner with ``BlockInfo.nbytes`` replaced by ``image_bytes`` (its compute then reads the
# weights at half size, 36 ms less: an artefact, GEMMs read bf16).
