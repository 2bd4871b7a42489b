"""Inspect a diffusers pipeline folder before a run: family, components, blocks.

A pipeline folder is what ``save_pretrained`` writes (and the Hub serves): ``model_index.json``
naming the pipeline class and, per component, ``[library, class]``; one sub-folder per
component. ``inspect_pipeline`` reads only JSON and safetensors headers (no weights), so it is
cheap enough for the New run page: each component's class, parameter count and dtype, and the
blocks the weight runtime will stream (found by ``stagehand.weights.registry.find_blocks`` on the
transformer built on the meta device from its config) with their sizes in bytes.

Every problem raises ``PipelineFolderError`` naming the file, the field and what was expected.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stagehand.common.safetensors_header import SafetensorsHeaderError, read_header
from stagehand.config.safe_read import JsonTooDeep, NotRegularFile, loads, read_prefix
from stagehand.weights.registry import find_blocks
from workbench.worker.diffusers_classes import diffusers_class

PIPELINE_FAMILIES: dict[str, str] = {
    "FluxPipeline": "flux",
    "QwenImagePipeline": "qwenimage",
    "WanPipeline": "wan",
    "LTX2Pipeline": "ltx2",
    "ZImagePipeline": "zimage",
    "StableDiffusion3Pipeline": "sd3",
    "StableDiffusionXLPipeline": "sdxl",
    "Flux2Pipeline": "flux2",
    "Flux2KleinPipeline": "flux2",
}
"""``model_index.json`` ``_class_name`` -> family (in priority order)."""

DENOISERS = ("transformer", "unet")
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}
DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
MAX_JSON_BYTES = 64 << 20
"""Largest ``model_index.json``, ``config.json`` or safetensors index read, 64 MiB (a sharded
index of a large model is a few MB): a bigger file is refused, not read into memory."""


class PipelineFolderError(ValueError):
    """A pipeline folder (or a file in it) is not what the family needs."""


@dataclass
class Component:
    """One entry of ``model_index.json``."""

    name: str  # transformer, text_encoder_2, ...
    library: str  # diffusers | transformers
    class_name: str
    parameters: int | None = None  # from the safetensors headers; None for tokenizers etc.
    dtype: str | None = None  # the dtype holding most of the bytes
    nbytes: int | None = None


@dataclass
class BlockInfo:
    name: str  # qualified module name, e.g. single_transformer_blocks.2
    nbytes: int  # bytes streamed per load, in the checkpoint's dtype


@dataclass
class PipelineInfo:
    """What ``inspect_pipeline`` found; ``as_dict`` is the API's JSON."""

    path: str
    pipeline_class: str
    family: str
    components: list[Component] = field(default_factory=list)
    blocks: list[BlockInfo] = field(default_factory=list)
    transformer_path: str | None = None
    experts: list[str] = field(default_factory=list)
    """``model.expert`` choices (Wan 2.2: ``high_noise``, ``low_noise``); empty for one
    transformer."""

    @property
    def block_bytes(self) -> int:
        return max((b.nbytes for b in self.blocks), default=0)

    def component(self, name: str) -> Component:
        return next(c for c in self.components if c.name == name)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["blocks_total_bytes"] = sum(b.nbytes for b in self.blocks)
        out["largest_block_bytes"] = self.block_bytes
        return out


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from the regular file ``path`` (``stagehand.config.safe_read``: a FIFO or device is
    never opened, at most ``MAX_JSON_BYTES`` bytes, ``MAX_JSON_DEPTH`` levels of nesting).

    Raises:
        PipelineFolderError: missing, not a regular file, too large, too deep, not JSON or not
            an object; names the file and what was expected.
    """
    if not path.exists():
        raise PipelineFolderError(f"{path}: not found; expected {what}")
    try:
        raw, size = read_prefix(path, MAX_JSON_BYTES + 1)
        if size > MAX_JSON_BYTES:
            raise PipelineFolderError(
                f"{path}: {size} bytes, over the {MAX_JSON_BYTES} read; expected {what}"
            )
        data = loads(raw)
    except NotRegularFile as exc:
        raise PipelineFolderError(f"{path}: {exc.strerror}; expected {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, JsonTooDeep) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise PipelineFolderError(f"{path}: not readable JSON ({why}); expected {what}") from None
    if not isinstance(data, dict):
        raise PipelineFolderError(f"{path}: a JSON {type(data).__name__}; expected {what}")
    return data


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: ``{key: {dtype, shape, data_offsets}}``.

    Raises:
        PipelineFolderError: the file cannot be read, or its header does not describe it
            (``stagehand.common.safetensors_header``: a length past the file's end, not JSON,
            ranges that do not tile the data); names the file.
    """
    try:
        header, _ = read_header(path)
    except SafetensorsHeaderError as exc:
        raise PipelineFolderError(str(exc)) from None
    except NotRegularFile as exc:
        raise PipelineFolderError(f"{path}: {exc.strerror}; expected safetensors weights") from None
    except OSError as exc:
        raise PipelineFolderError(f"{path}: not readable ({exc})") from None
    header.pop("__metadata__", None)
    return header


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a component folder (all shards), sorted.

    Raises:
        PipelineFolderError: a shard that the folder's ``*.safetensors.index.json`` names is
            missing (an interrupted download): found here, not when the model loads after
            stage 1; or its ``weight_map`` is not an object of file names (names the key).
    """
    for index in sorted(folder.glob("*.safetensors.index.json")):
        weight_map = read_json(index, "a safetensors index").get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise PipelineFolderError(
                f"{index}: weight_map is a JSON {type(weight_map).__name__}; expected an object "
                '{"tensor name": "shard file name"}'
            )
        for key, shard in weight_map.items():
            if not isinstance(shard, str):
                raise PipelineFolderError(
                    f"{index}: weight_map[{key!r}] is {repr(shard)[:80]}; expected a shard's "
                    "file name (a string)"
                )
        shards = set(weight_map.values())
        missing = sorted(str(s) for s in shards if not (folder / str(s)).is_file())
        if missing:
            raise PipelineFolderError(
                f"{index}: shard(s) {missing} missing; expected every shard its weight_map "
                "names (download the folder again)"
            )
    return sorted(folder.glob("*.safetensors"))


def tensors_of(files: list[Path]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for f in files:
        out.update(safetensors_header(f))
    return out


def _count(tensors: dict[str, dict[str, Any]]) -> tuple[int, str | None, int]:
    """``(parameters, dominant dtype name, bytes)`` of a safetensors header."""
    params, by_dtype = 0, {}
    for info in tensors.values():
        n = 1
        for d in info["shape"]:
            n *= d
        params += n
        size = n * DTYPE_BYTES.get(info["dtype"], 4)
        by_dtype[info["dtype"]] = by_dtype.get(info["dtype"], 0) + size
    dtype = max(by_dtype, key=by_dtype.get) if by_dtype else None
    return params, DTYPE_NAMES.get(dtype, dtype), sum(by_dtype.values())


def detect_family(path: str | Path) -> tuple[str, dict[str, Any]]:
    """``(family, model_index)`` of a pipeline folder.

    Raises:
        PipelineFolderError: no folder, no ``model_index.json`` (or not a JSON object), or a
            ``_class_name`` that is not one of ``PIPELINE_FAMILIES`` (a list, an object...).
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise PipelineFolderError(f"model.path: {str(root)!r} is not a folder")
    index = read_json(
        root / "model_index.json",
        "a diffusers pipeline folder's model_index.json (the layout save_pretrained writes: "
        "model_index.json, scheduler/, text_encoder*/, tokenizer*/, transformer/ or unet/, vae/)",
    )
    name = index.get("_class_name")
    if not isinstance(name, str) or name not in PIPELINE_FAMILIES:
        raise PipelineFolderError(
            f"{root / 'model_index.json'}: _class_name is {repr(name)[:80]}; expected one of "
            f"{sorted(PIPELINE_FAMILIES)}"
        )
    return PIPELINE_FAMILIES[name], index


def check_model_type(model_type: str | None, family: str, aliases: dict[str, str]) -> None:
    """Raise when an explicit ``model_type`` names another family than the folder's."""
    if model_type is None:
        return
    if model_type != family and aliases.get(model_type) != family:
        raise PipelineFolderError(
            f"model_type is {model_type!r} but model.path's model_index.json names a {family!r} "
            f"pipeline: set model_type to {family!r} or leave it out"
        )


def _expected_components(class_name: str) -> tuple[set[str], set[str]]:
    """``(required, optional)`` component names of the pipeline class (its ``__init__``)."""
    cls = diffusers_class(class_name)
    expected, _ = cls._get_signature_keys(cls)
    optional = set(getattr(cls, "_optional_components", []) or [])
    return set(expected) - optional, optional


def components_of(root: Path, index: dict[str, Any]) -> list[Component]:
    """Every non-null component of ``model_index.json``, checked against the pipeline class.

    Raises:
        PipelineFolderError: a required component is missing (in the index or on disk), the
            index lists one the pipeline class does not take, or an entry is not
            ``["library", "Class"]`` (names the key).
    """
    required, optional = _expected_components(index["_class_name"])
    where = root / "model_index.json"
    for key, value in index.items():
        entry = isinstance(value, list) and len(value) == 2 and value[0] is not None
        if entry and not all(isinstance(v, str) for v in value):
            raise PipelineFolderError(
                f'{where}: {key} is {repr(value)[:80]}; expected ["library", "Class"] (two '
                "strings, as save_pretrained writes) or [null, null]"
            )
    listed = {
        k: v
        for k, v in index.items()
        if not k.startswith("_") and isinstance(v, list) and len(v) == 2 and v[0] is not None
    }
    extra = sorted(set(listed) - required - optional)
    if extra:
        raise PipelineFolderError(
            f"{where}: component(s) {extra} are not taken by {index['_class_name']}; expected "
            f"only {sorted(required | optional)}"
        )
    missing = sorted(n for n in required if n not in listed or not (root / n).is_dir())
    if missing:
        raise PipelineFolderError(
            f"{where}: required component(s) {missing} missing (each needs an entry "
            f'["library", "Class"] and a folder {root}/<name>/)'
        )
    out = []
    for name in sorted(listed):
        library, class_name = listed[name]
        comp = Component(name=name, library=library, class_name=class_name)
        files = weight_files(root / name) if (root / name).is_dir() else []
        if files:
            comp.parameters, comp.dtype, comp.nbytes = _count(tensors_of(files))
        out.append(comp)
    return out


def denoiser(root: Path, index: dict[str, Any]) -> str:
    for name in DENOISERS:
        if name in index and (root / name).is_dir():
            return name
    raise PipelineFolderError(f"{root}: no transformer/ or unet/ folder")


def find_streamed_blocks(
    root: Path, index: dict[str, Any], tensors: dict[str, dict[str, Any]], pattern: str | None
) -> list[BlockInfo]:
    """The blocks the weight runtime will stream, sized from the checkpoint's headers.

    The denoiser is built on the meta device from its ``config.json`` (no memory) and
    ``find_blocks`` chooses its blocks exactly as the runtime will.
    """
    import torch

    name = denoiser(root, index)
    config = read_json(root / name / "config.json", f"the {name}'s config")
    cls = diffusers_class(index[name][1])
    try:
        with torch.device("meta"):
            model = cls.from_config(config)
    # A config.json from_config cannot take fails with whatever its values trip (TypeError,
    # KeyError, ZeroDivisionError...): each is this file's fault.
    except Exception as exc:  # noqa: BLE001
        raise PipelineFolderError(
            f"{root / name / 'config.json'}: does not build a {cls.__name__} "
            f"({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    dtype_bytes = DTYPE_BYTES.get(_dominant(tensors), 4)
    blocks = []
    for block_name, module in find_blocks(model, pattern):
        n = sum(p.numel() for p in module.parameters())
        blocks.append(BlockInfo(name=block_name, nbytes=n * dtype_bytes))
    return blocks


def _dominant(tensors: dict[str, dict[str, Any]]) -> str:
    by: dict[str, int] = {}
    for info in tensors.values():
        by[info["dtype"]] = by.get(info["dtype"], 0) + 1
    return max(by, key=by.get) if by else "F32"


def inspect_pipeline(
    path: str | Path,
    *,
    model_type: str | None = None,
    aliases: dict[str, str] | None = None,
    transformer_path: str | None = None,
    block_pattern: str | None = None,
) -> PipelineInfo:
    """Inspect the pipeline folder ``path`` (see the module doc).

    ``model_type``: the preset's explicit ``model_type`` (None when unset), checked against the
    folder's family with ``aliases`` (``workbench.worker.preset.MODEL_TYPES``).

    Raises:
        PipelineFolderError: naming the file and field at fault and what was expected.
    """
    family, index = detect_family(path)
    root = Path(path).expanduser()
    check_model_type(model_type, family, aliases or {})
    components = components_of(root, index)
    name = denoiser(root, index)
    if transformer_path is not None:
        single = Path(transformer_path).expanduser()
        if not single.is_file() or single.suffix != ".safetensors":
            raise PipelineFolderError(
                f"model.transformer_path: {str(single)!r} is not a .safetensors file"
            )
        tensors = safetensors_header(single)
        comp = next(c for c in components if c.name == name)
        comp.parameters, comp.dtype, comp.nbytes = _count(tensors)
    else:
        tensors = tensors_of(weight_files(root / name))
        if not tensors:
            raise PipelineFolderError(
                f"{root / name}: no .safetensors weights; expected the {name}'s (sharded) "
                "safetensors with their index"
            )
    info = PipelineInfo(
        path=str(root),
        pipeline_class=index["_class_name"],
        family=family,
        components=components,
        transformer_path=transformer_path,
    )
    info.blocks = find_streamed_blocks(root, index, tensors, block_pattern)
    second = index.get("transformer_2")
    entry = isinstance(second, list) and len(second) == 2 and second[0] is not None
    if entry and index.get("boundary_ratio"):
        info.experts = ["high_noise", "low_noise"]
    return info


def load_component(root: Path, name: str, dtype: Any = None, folder: Path | None = None) -> Any:
    """Component ``name`` of the pipeline folder ``root``, loaded with the class its
    ``model_index.json`` names (weights in ``dtype`` where it applies), from ``folder``
    (default ``root / name``; ``model.vae_path`` names another).

    Raises:
        PipelineFolderError: the component does not load (names its folder and class).
    """
    index = read_json(root / "model_index.json", "a pipeline's model_index.json")
    library, class_name = index[name]
    if library not in ("diffusers", "transformers"):
        # A class of a pipeline's own module (LTX-2's ["ltx2", "LTX2TextConnectors"]), which
        # diffusers' loader looks up under diffusers.pipelines.
        library = f"diffusers.pipelines.{library}"
    try:
        cls = getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError) as exc:
        raise PipelineFolderError(
            f"{root / 'model_index.json'}: {name} is {library}.{class_name}, which this "
            f"installation does not have ({exc})"
        ) from None
    kwargs = {"dtype": dtype} if dtype is not None else {}
    folder = folder or root / name
    try:
        return cls.from_pretrained(folder, **kwargs)
    except Exception as exc:  # any loader failure: name the folder, keep the cause
        raise PipelineFolderError(
            f"{folder}: {class_name}.from_pretrained failed: {type(exc).__name__}: {exc}"
        ) from exc
