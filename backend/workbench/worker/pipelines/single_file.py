"""``model.transformer_path``: a single-file transformer checkpoint (``.safetensors`` as model
makers and ComfyUI distribute them), converted once into the cache, sharded, in the folder layout
the weight runtime streams from (file-backed streaming reads tensors by the model's own parameter
names, which the original layout does not use).

A file of ordinary precision is loaded with diffusers' ``from_single_file`` against the pipeline
folder's ``transformer/config.json`` and saved. A file whose weights are 8 bits (ComfyUI's fp8
files: ``float8_e4m3fn`` weights with a ``<layer>.scale_weight`` per tensor, or a per-row
``<layer>.weight_scale``, or none) is, with SquareQ on, converted without touching its codes
(``convert_prequantized``) and then streams as stored (``runtime/stagehand/squareq/prequantized.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from stagehand.squareq.formats import dequantize
from stagehand.squareq.prequantized import (
    EIGHT_BIT,
    SCALE_SUFFIXES,
    PrequantizedCheckpointError,
    check_weight,
    row_scales,
)
from stagehand.weights.sources import DTYPES
from workbench.worker.diffusers_classes import diffusers_class
from workbench.worker.encode import cache_key
from workbench.worker.pipelines.folder import (
    DENOISERS,
    PipelineFolderError,
    PipelineInfo,
    safetensors_header,
)

SHARD_BYTES = 2 * 1024**3
"""Shard size of the converted copy (the Hub's usual 2-10 GB shards; any size streams)."""
DROPPED = ("scaled_fp8", "scale_input", "input_scale")
"""Keys of an 8-bit file that hold no weight: ComfyUI's ``scaled_fp8`` flag (an empty fp8
tensor) and the activation scales of fp8 matmuls (``<layer>.scale_input``), which the weights'
values do not depend on."""
ROW_BITS = 32
"""``convert_prequantized``'s row labels: ``weight index * 2**ROW_BITS + row`` (exact in fp64)."""


def eight_bit_weights(
    single: Path, header: dict, squareq_on: bool, field: str = "model.transformer_path"
) -> dict[str, str | None]:
    """``{key: its scale key or None}`` of the file's 8-bit tensors (``DROPPED`` keys aside),
    checked as SquareQ reads folders (``prequantized.check_weight``): all with ``squareq_on``
    (they are kept as stored), else the scaled ones (the others are upcast as they are read).
    ``field`` names the config field the file came from in the error.

    Raises:
        PipelineFolderError: a tensor that cannot be read as stored (e5m2, int8, not 2-D, a
            block-wise scale, or scaled with ``squareq_on`` False): names the key, its dtype
            and its scale's shape.
    """
    out = {}
    for key, entry in sorted(header.items()):
        dtype = DTYPES.get(entry["dtype"])
        if dtype not in EIGHT_BIT or key.rpartition(".")[2] in DROPPED:
            continue
        owner = key.rpartition(".")[0]
        scales = [f"{owner}.{s}" for s in SCALE_SUFFIXES if f"{owner}.{s}" in header]
        out[key] = scales[0] if scales else None
        if not (squareq_on or scales):  # upcast on reading, as any precision
            continue
        try:
            check_weight(
                f"{field}: checkpoint tensor {key!r} in {single.name}",
                dtype,
                tuple(entry["shape"]),
                out[key],
                tuple(header[out[key]]["shape"]) if scales else None,
                squareq_on,
            )
        except PrequantizedCheckpointError as exc:
            raise PipelineFolderError(str(exc)) from None
    return out


def convert_single_file(
    info: PipelineInfo, cache_dir: Path, dtype: torch.dtype, prequantized: bool = False
) -> Path:
    """The converted transformer folder for ``info.transformer_path`` (built once per file, and
    written under a temporary name first). ``prequantized``: SquareQ streams the run's blocks
    (``memory.stagehand.squareq``), so a file of 8-bit weights is converted as stored
    (``convert_prequantized``); without it, an unscaled one is upcast to ``dtype`` as any file
    and a scaled one is refused (its codes read without their scale would be wrong values).

    Raises:
        PipelineFolderError: the file's keys do not fit the transformer class (lists a few of
            the file's and of the expected keys), or an 8-bit weight cannot be read (names the
            key, dtype and scale shape).
    """
    single = Path(info.transformer_path).expanduser()
    header = safetensors_header(single)
    weights = eight_bit_weights(single, header, prequantized)
    as_stored = bool(weights) and prequantized
    stat = single.stat()
    key = cache_key(
        kind="single-file-8bit" if as_stored else "single-file",
        file=str(single),
        size=stat.st_size,
        mtime=stat.st_mtime_ns,
        dtype=str(dtype),  # the copy is written in the run's dtype
        config=str(Path(info.path).resolve()),  # and read against this folder's config
    )
    out = cache_dir / f"transformer-{key}"
    if (out / "config.json").is_file():
        return out
    comp = next(c for c in info.components if c.name in DENOISERS)  # transformer / unet
    cls = diffusers_class(comp.class_name)
    tmp = cache_dir / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if as_stored:
        convert_prequantized(info, single, weights, cls, tmp, dtype)
    else:
        try:
            model = cls.from_single_file(
                str(single), config=info.path, subfolder=comp.name, torch_dtype=dtype
            )
        except Exception as exc:  # the loaders raise anything from KeyError to IndexError
            raise not_loadable(info, single, cls, exc) from exc
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=SHARD_BYTES)
    tmp.rename(out)
    return out


def not_loadable(
    info: PipelineInfo, single: Path, cls: type, exc: Exception
) -> PipelineFolderError:
    """The error for a file that does not convert to ``cls``: a few of its keys and of the
    expected ones."""
    comp = next(c for c in info.components if c.name in DENOISERS)
    found = sorted(safetensors_header(single))[:5]
    config = cls.load_config(Path(info.path) / comp.name)
    with torch.device("meta"):
        expected = sorted(cls.from_config(config).state_dict())[:5]
    return PipelineFolderError(
        f"model.transformer_path: {single} does not load as {cls.__name__} "
        f"({type(exc).__name__}: {exc}); its keys start {found}, expected keys like "
        f"{expected} (diffusers) or the original layout of the model's release"
    )


def convert_prequantized(
    info: PipelineInfo,
    single: Path,
    weights: dict[str, str | None],
    cls: type,
    folder: Path,
    dtype: torch.dtype,
) -> None:
    """Write into ``folder`` the diffusers layout of ``single``, whose ``weights`` (``{8-bit
    key: scale key or None}``, ``eight_bit_weights``) keep their codes: diffusers' own
    single-file converter of ``cls`` (``diffusers/loaders/single_file_utils.py``, found as
    ``from_single_file`` finds it) runs twice, once on the file's tensors (the float8 codes
    are moved, never converted) and once with each 8-bit weight replaced by its row labels,
    an ``(rows, 1)`` fp64 tensor. Each converted 8-bit weight must come out as labels of
    source rows whose codes are its codes, byte for byte (the converter only moved rows:
    splits of fused q/k/v, swapped halves); its per-row fp32 scales are gathered by the
    same labels. A file already in diffusers' names is not converted.

    Written: in a block (``info.blocks``), the codes as float8_e4m3fn and, where the file
    had a scale, ``<layer>.weight_scale`` ``(rows,)`` fp32; outside the blocks (resident
    weights, loaded by ``from_pretrained``, which reads no scale) ``codes * scale`` in
    ``dtype`` (``squareq.formats.dequantize``, the images' rule); every other tensor as the
    file stores it (the model is loaded in its dtype as from any folder). Host memory: about
    twice the file.

    Raises:
        PipelineFolderError: the converter failed, or made an 8-bit weight of anything but
            whole source rows (names the converted key), or the result does not have the
            model's keys and shapes (lists a few).
    """
    from diffusers.loaders.single_file_model import (
        SINGLE_FILE_LOADABLE_CLASSES,
        _get_single_file_loadable_mapping_class,
    )
    from safetensors.torch import load_file

    tensors = load_file(str(single))
    names = sorted(weights)
    codes = {k: tensors.pop(k) for k in names}
    scales = {k: row_scales(tensors.get(s), codes[k].shape[0]) for k, s in weights.items()}
    for key in list(tensors):
        leaf = key.rpartition(".")[2]
        owner = key.rpartition(".")[0] + ".weight"
        if leaf in DROPPED or (leaf in SCALE_SUFFIXES and owner in weights):
            del tensors[key]
    labels = {
        k: (j * 2**ROW_BITS + torch.arange(codes[k].shape[0], dtype=torch.float64))[:, None]
        for j, k in enumerate(names)
    }
    comp = next(c for c in info.components if c.name in DENOISERS)
    config = cls.load_config(Path(info.path) / comp.name)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in cls.from_config(config).state_dict().items()}
    if set(tensors) | set(codes) == set(expected):  # diffusers' names already
        moved, rows_of = {**tensors, **codes}, dict(labels)
    else:
        mapping = _get_single_file_loadable_mapping_class(cls)
        if mapping is None:
            raise PipelineFolderError(
                f"model.transformer_path: diffusers has no single-file converter for "
                f"{cls.__name__}; expected a file in diffusers' names"
            )
        convert = SINGLE_FILE_LOADABLE_CLASSES[mapping]["checkpoint_mapping_fn"]
        placeholders = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in tensors.items()}  # fmt: skip
        try:
            moved = convert(checkpoint={**tensors, **codes}, config=config)
            rows_of = convert(checkpoint={**placeholders, **labels}, config=config)
        except Exception as exc:  # the converters raise anything from KeyError to IndexError
            raise not_loadable(info, single, cls, exc) from exc
    blocks = tuple(f"{b.name}." for b in info.blocks)
    out: dict[str, torch.Tensor] = {}
    for key, value in moved.items():
        label = rows_of.get(key)
        from_codes = label is not None and label.device.type != "meta"
        if value.dtype != torch.float8_e4m3fn and not from_codes:
            out[key] = value
            continue
        source, row = _rows(
            key, value, label if from_codes else None, codes, names, convert_name(info)
        )
        scale = torch.empty(value.shape[0], dtype=torch.float32)
        scaled = False
        for j in source.unique().tolist():
            hit = source == j
            scale[hit] = scales[names[j]][row[hit]]
            scaled = scaled or weights[names[j]] is not None
        if not key.startswith(blocks):
            out[key] = dequantize(value, scale, dtype)
            continue
        out[key] = value
        if scaled:
            out[f"{key.rpartition('.')[0]}.weight_scale"] = scale
    _check_keys(out, expected, single)
    _save(out, Path(info.path) / comp.name / "config.json", folder)


def convert_name(info: PipelineInfo) -> str:
    """How the error messages name the conversion."""
    return f"diffusers' single-file conversion of {Path(info.transformer_path).name}"


def _rows(
    key: str,
    value: torch.Tensor,
    label: torch.Tensor | None,
    codes: dict[str, torch.Tensor],
    names: list[str],
    conversion: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(source weight index, source row)`` per row of converted 8-bit weight ``key``, checked:
    its labels are whole source rows and its codes those rows' codes, byte for byte."""
    wrong = PipelineFolderError(
        f"model.transformer_path: {conversion} does not only move whole rows of 8-bit weights: "
        f"{key!r} ({value.dtype} {tuple(value.shape)}) is not made of the file's codes row "
        "for row, so they cannot be kept as stored; convert the file to bf16 first"
    )
    if label is None or value.dtype != torch.float8_e4m3fn or value.dim() != 2:
        raise wrong
    flat = label.reshape(-1)
    if label.shape != (value.shape[0], 1) or not torch.equal(flat, flat.floor()) or flat.min() < 0:
        raise wrong
    ids = flat.long()
    source, row = ids >> ROW_BITS, ids & (2**ROW_BITS - 1)
    if int(source.max()) >= len(names):
        raise wrong
    want = torch.empty_like(value.view(torch.uint8))
    for j in source.unique().tolist():
        hit = source == j
        src = codes[names[j]]
        if int(row[hit].max()) >= src.shape[0] or src.shape[1:] != value.shape[1:]:
            raise wrong
        want[hit] = src.view(torch.uint8)[row[hit]]
    if not torch.equal(want, value.view(torch.uint8)):
        raise wrong
    return source, row


def _check_keys(out: dict[str, torch.Tensor], expected: dict[str, tuple], single: Path) -> None:
    """Raise ``PipelineFolderError`` unless ``out`` holds the model's keys in their shapes
    (scales aside)."""
    got = {k: tuple(v.shape) for k, v in out.items() if not k.endswith(".weight_scale")}
    missing = sorted(set(expected) - set(got))[:5]
    unexpected = sorted(set(got) - set(expected))[:5]
    shapes = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])[:5]
    if missing or unexpected or shapes:
        raise PipelineFolderError(
            f"model.transformer_path: {single} converted does not fit the transformer: missing "
            f"{missing}, unexpected {unexpected}, other shapes {shapes}"
        )


def _save(tensors: dict[str, torch.Tensor], config: Path, folder: Path) -> None:
    """``tensors`` as diffusers saves a model: ``SHARD_BYTES`` shards (an index when more than
    one) and ``config`` copied as ``config.json``."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    split = split_torch_state_dict_into_shards(
        tensors,
        filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
        max_shard_size=SHARD_BYTES,
    )
    for name, keys in split.filename_to_tensors.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(folder / name))
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copyfile(config, folder / "config.json")
