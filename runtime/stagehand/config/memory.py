"""Configuration of the memory runtimes, with the field names and defaults of the source documents.

Every model here is a pydantic model with ``extra="forbid"``: an unknown field or a wrong type
raises ``pydantic.ValidationError`` whose ``loc`` is the JSON path of the field. Sizes ending in
``_mb`` are MB of 2**20 bytes, as the seeds use them (``torch.cuda.memory_allocated() / 2**20``).

Sources:
- ``StagehandConfig``: the LTX-2 bf16 on 24 GB case study (the ``memory.stagehand`` JSON).
- ``ActivationStagehandConfig``: "Activation Stagehand" (config table and JSON).
- ``ConductorConfig``: "Conductor: Resource Arbitration Across Memory Runtimes" (``conductor_config`` JSON, policy rules).
- ``MemoryConfig`` layer-offload fields: the Flux 2048 px layer-offload case study.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args, get_type_hints

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_validator,
)

from stagehand.config.limits import AS, PAIRS, PATHS, SH, WEIGHT_PAIR, check_pair, check_watermarks

MB = 2**20
"""Bytes in one MB as the seeds count it."""

MAX_MB = 2**30
"""The largest size a ``_mb`` field takes: 2**30 MB (1 PiB), more memory than one machine has;
``_bytes`` fields take up to ``MAX_MB * MB``. Anything larger is a typo or an attack (``1e308``
MB is an infinite byte count, which the runtimes' integer arithmetic cannot hold)."""


def _at_most(bound: int, unit: str) -> BeforeValidator:
    """Refuses a number above ``bound`` with a sentence giving the bound and its unit, before
    the type check (a 401-digit integer is not a float, but it is above the bound first)."""

    def check(value: object) -> object:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > bound:
            shown = f"a {len(str(value))}-digit integer" if isinstance(value, int) else f"{value:g}"
            raise ValueError(
                f"must be at most {bound} {unit} (1 PiB: more than any machine has), got {shown}"
            )
        return value

    return BeforeValidator(check)


NonNegMB = Annotated[float, Field(ge=0, le=MAX_MB), _at_most(MAX_MB, "MB")]
WholeMB = Annotated[int, Field(gt=0, le=MAX_MB), _at_most(MAX_MB, "MB")]
NonNegBytes = Annotated[int, Field(ge=0, le=MAX_MB * MB), _at_most(MAX_MB * MB, "bytes")]
PosInt = Annotated[int, Field(gt=0)]

MAX_WINDOW_BLOCKS = 128
"""The largest prefetch window (blocks): twice the deepest transformer trained here
(Qwen-Image's 60 blocks; FLUX.1 has 57). A window past the block count already prefetches
every block, so a larger one means nothing more; ``10**400`` is a typo or an attack."""
MAX_INFLIGHT = 64
"""The most copies in flight per direction: four times the largest derived default (16, twice
a window of 8: NOTE [ Pipeline depth ] in ``runtime/stagehand/weights/defaults.py``). A GPU's copy
engine runs one direction's copies one after another, so more slots only hold more pinned
buffers while they wait."""
WindowBlocks = Annotated[
    int,
    Field(
        ge=0,
        le=MAX_WINDOW_BLOCKS,
        description=f"blocks, at most {MAX_WINDOW_BLOCKS}: twice the deepest transformer trained "
        "here (Qwen-Image, 60 blocks); a window past the block count prefetches every block",
    ),
]
_INFLIGHT_WHY = (
    f"copies, at most {MAX_INFLIGHT}: four times the largest derived default (16); a copy "
    "engine runs one direction's copies one after another, so more only hold pinned buffers"
)
InflightCopies = Annotated[int, Field(gt=0, le=MAX_INFLIGHT, description=_INFLIGHT_WHY)]
"""Copies in flight, at least 1 (a direction that must make progress)."""
InflightOrOff = Annotated[int, Field(ge=0, le=MAX_INFLIGHT, description=_INFLIGHT_WHY)]
"""Copies in flight, 0 turning the direction off (no new activation spills)."""

MBOrAuto = NonNegMB | Literal["auto"]
"""A watermark field: MB >= 0, or ``"auto"`` (``stagehand.config.limits.AUTO``)."""


AUTO_DEVICE = "auto"
"""The worker's device when a run names none: CUDA device 0 when present, else the CPU."""
_DEVICE_RE = re.compile(r"^(cpu|cuda(:[0-9]{1,2})?)$")


def check_device(name: str) -> str:
    """``name`` as a worker device: ``"auto"``, ``"cpu"`` or ``"cuda:N"`` (``"cuda"`` is
    ``"cuda:0"``), so that one device has one name wherever runs are counted per device.

    Raises ``ValueError`` naming what was expected for anything else."""
    if name == AUTO_DEVICE:
        return name
    if not isinstance(name, str) or not _DEVICE_RE.match(name):
        raise ValueError(f'device must be "auto", "cpu", "cuda" or "cuda:N", got {name!r}')
    return "cuda:0" if name == "cuda" else name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


@dataclass(frozen=True)
class Watermarks:
    """A checked pair of VRAM watermarks, as the runtimes hold them; the rule (both numbers of MB
    >= 0, the low one not above the high one) is ``stagehand.config.limits.check_watermarks``. The weight runtime stops prefetching at the
    high watermark and evicts down to the low one; the activation runtime spills from the high
    one until below the low one (the seeds' ``vram_high_watermark_mb``/``vram_low_watermark_mb``).
    ``names`` are the fields errors name.

    Raises:
        ValueError: a watermark that is not a number >= 0 (bools and NaN included), or the low
            one above the high one, naming the field.
    """

    high_mb: float
    low_mb: float
    names: tuple[str, str] = WEIGHT_PAIR

    def __post_init__(self) -> None:
        check_watermarks(self.high_mb, self.low_mb, self.names)
        object.__setattr__(self, "high_mb", float(self.high_mb))
        object.__setattr__(self, "low_mb", float(self.low_mb))

    @property
    def high_bytes(self) -> int:
        return int(self.high_mb * MB)

    @property
    def low_bytes(self) -> int:
        return int(self.low_mb * MB)


SquareQFormat = Literal["int8", "fp8_e4m3"]
"""SquareQ's formats (``runtime/stagehand/squareq/formats.py`` implements each)."""
SQUAREQ_FORMATS: tuple[str, ...] = get_args(SquareQFormat)
"""The same names as a tuple (served to the dashboard in ``/static/js/contract.js``)."""


class SquareQConfig(_Strict):
    """``memory.stagehand.squareq``: frozen block weights kept and streamed in 8 bits
    (``runtime/stagehand/squareq``). Absent: off."""

    format: SquareQFormat
    """``int8``: symmetric, one fp32 scale per output row (SquareQ's layout); ``fp8_e4m3``:
    float8_e4m3fn with one fp32 scale per row (musubi-tuner's ``fp8_scaled``)."""
    cache_dir: str | None = None
    """Where the quantized copy of a checkpoint is cached; None: ``squareq/`` in the workbench
    cache (``$STAGEHAND_WORKBENCH_CACHE``)."""


class StagehandConfig(_Strict):
    """Weight streaming (block swap). Defaults are the seed's LTX-2 24 GB run."""

    pinned_pool_mb: WholeMB | None = None
    """Host pool of uniform slabs, allocated once (pinned when CUDA is present). None: one slab
    per copy in flight plus one on CUDA, 8192 on CPU (``runtime/stagehand/weights/defaults.py``)."""
    pinned_slab_mb: WholeMB | None = None
    """Size of one slab; a block larger than a slab takes the direct path. None: the largest
    block (whole MB) on CUDA, 1024 on CPU."""
    vram_high_watermark_mb: MBOrAuto = 20000.0
    """Speculative prefetch stops when a load would cross this. ``"auto"`` (with the low one):
    derived from the card at build (NOTE [ Auto watermarks ])."""
    vram_low_watermark_mb: MBOrAuto = 16000.0
    """Blocks stay on the device after their use while usage is under this; above it they are
    evicted, needed furthest ahead first, until usage is under it (NOTE [ Eviction policy ])."""
    prefetch_window_blocks: WindowBlocks | None = None
    """Blocks loaded ahead of use along the traced order (0 disables prefetch); blocks kept on
    the device between them take no place (NOTE [ Prefetch window ]). None: derived
    from the largest block and the card (about 1 GiB ahead, 2 to 8 blocks) on CUDA, 2 on CPU
    (NOTE [ Pipeline depth ] in ``runtime/stagehand/weights/defaults.py``)."""
    max_inflight_transfers: InflightCopies | None = None
    """H2D block copies in flight at once. None: twice the window on CUDA, 2 on CPU."""
    reader_threads: Annotated[int, Field(ge=0, le=16)] | None = None
    """Threads that read prefetched blocks from their safetensors files into slabs and issue
    the H2D copies, so file reads (page-cache speed, ~5 GB/s) run beside the thread that queues
    the kernels instead of on it (a demand load reads on the calling thread: it is waited on at
    once). 0: every read on the calling thread; None: half the cores (2 to 8) on CUDA, 0 on
    CPU. One block's read is shared by every reader."""
    reader_min_block_mb: NonNegMB = 64
    """Only blocks of at least this many MB go to the reader threads: a smaller block's read
    (~13 MB: ~3 ms) costs less than the handoff, which waits for Python's thread switch (an H100
    bench, flux-small's 13 MB blocks: 116 ms per step with 2 readers for all, 103 ms without)."""
    host_cache_mb: NonNegMB | None = None
    """Host RAM (MB) for frozen blocks kept after their first read (page-locked on CUDA), so
    later loads copy straight from it: no file read, no slab (``runtime/stagehand/weights/host_cache.py``).
    None: on CUDA the RAM available at set-up minus a margin (25% of RAM, at least 8 GiB), off
    on CPU; 0: off (module-backed blocks' page-locked images too). Blocks that do not fit keep
    streaming from their files (file-backed)."""
    block_pattern: str | None = None
    """Regex over module names selecting the blocks; None finds the largest ModuleLists."""
    file_backed: bool = True
    """Stream frozen block weights from the model's safetensors files (mmap) when known."""
    resident_trainable_max_fraction: Annotated[float, Field(ge=0, le=1)] = 0.1
    """H2D-only streaming: trainable block parameters (LoRA adapters) stay resident on the
    device when their bytes are at most this fraction of the blocks' bytes, so frozen weights
    only move host -> device and nothing is copied back; above it (a full fine-tune) they stream
    with their block and are copied back at eviction. 0: always stream them."""
    allow_pageable_fallback: bool = False
    """When page-locking the pool fails at set-up, stage in pageable memory (copies then run
    synchronously) instead of refusing to start."""
    slab_acquire_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """A slab acquire that waits longer raises, naming what holds the slabs."""
    block_events: bool = True
    """Emit one telemetry record per block enter/exit/load/evict."""
    squareq: SquareQConfig | None = None
    """Frozen linear weights of the blocks in 8 bits (``SquareQConfig``); None: off."""

    @model_validator(mode="after")
    def _watermarks(self) -> StagehandConfig:
        check_pair(self.vram_high_watermark_mb, self.vram_low_watermark_mb, Watermarks.names)
        slab, pool = self.pinned_slab_mb, self.pinned_pool_mb
        if slab is not None and pool is not None and slab > pool:
            raise ValueError(
                f"pinned_slab_mb ({self.pinned_slab_mb}) is larger than pinned_pool_mb "
                f"({self.pinned_pool_mb}): the pool would hold zero slabs"
            )
        return self


class ActivationStagehandConfig(_Strict):
    """Activation spill through ``saved_tensors_hooks``; defaults from the seed's config table."""

    enabled: bool = True
    vram_high_watermark_mb: MBOrAuto = 20000.0
    """Start spilling above this (``"auto"``: NOTE [ Who gives way ] in runtime/stagehand/conductor)."""
    vram_low_watermark_mb: MBOrAuto = 16000.0
    """Stop spilling below this (hysteresis)."""
    pinned_pool_classes_mb: tuple[Annotated[NonNegMB, Field(gt=0)], ...] = (1, 4, 16, 64, 256)
    """Size-class bucket sizes, ascending."""
    slabs_per_class: PosInt | tuple[Annotated[int, Field(ge=0)], ...] = (512, 2, 2, 2, 2)
    """Slabs per class: one int for every class, or one count per class."""
    max_inflight_d2h: InflightOrOff = 1
    max_inflight_h2d: InflightCopies = 1
    debug_checksums: bool = False
    """CRC32 on spill and restore; a mismatch raises with the record id."""
    telemetry_enabled: bool = True
    telemetry_file: str = "activation_telemetry.jsonl"
    """JSONL of a runtime built without the run's ``Telemetry`` (working directory)."""
    recompute_threshold_bytes: NonNegBytes = 0
    """Tensors below this are never spilled (cheaper to keep or recompute)."""
    min_spill_bytes: NonNegBytes = 4096
    """Tensors below this are never spilled: the copy costs more than the memory saved."""
    predictive_restore: bool = True
    """Restore spilled tensors ahead of need in reverse pack order during backward."""
    restore_ahead: Annotated[int, Field(ge=0)] = 2
    """Spilled records restored ahead of the one backward is consuming."""
    pool_growth_miss_threshold: Annotated[int, Field(ge=0)] = 8
    """Pool misses in one step above which the pool grows between steps (0 disables growth)."""
    pinned_growth_budget_mb: NonNegMB = 512
    """Extra host memory the pool may grow into, in total."""

    @model_validator(mode="after")
    def _check(self) -> ActivationStagehandConfig:
        check_pair(self.vram_high_watermark_mb, self.vram_low_watermark_mb, Watermarks.names)
        classes = self.pinned_pool_classes_mb
        if list(classes) != sorted(set(classes)):
            raise ValueError(
                f"pinned_pool_classes_mb must be strictly ascending sizes, got {list(classes)}"
            )
        if isinstance(self.slabs_per_class, tuple) and len(self.slabs_per_class) != len(classes):
            raise ValueError(
                f"slabs_per_class has {len(self.slabs_per_class)} counts but "
                f"pinned_pool_classes_mb has {len(classes)} classes"
            )
        return self

    def slab_counts(self) -> tuple[int, ...]:
        """Slabs per class, one count per entry of ``pinned_pool_classes_mb``."""
        if isinstance(self.slabs_per_class, int):
            return (self.slabs_per_class,) * len(self.pinned_pool_classes_mb)
        return tuple(self.slabs_per_class)


class ConductorConfig(_Strict):
    """Resource arbitration between the runtimes; fields from the seed's ``conductor_config``."""

    enabled: bool = False
    vram_soft_cap_mb: MBOrAuto = 22000.0
    """``"auto"`` (with the hard cap): the card less the margin (NOTE [ Who gives way ])."""
    vram_hard_cap_mb: MBOrAuto = 23500.0
    """``"auto"``: the card's memory."""
    pinned_budget_mb: NonNegMB = 16384
    """Pinned host memory the runtimes' pools may reserve together (weight slabs, activation
    size classes). The weight runtime's host cache is sized by its own ``host_cache_mb`` from
    the host's RAM and is not counted here; the step records' ``pinned_mb`` counts both."""
    h2d_slots: PosInt = 2
    d2h_slots: PosInt = 2
    backward_pressure_threshold: Annotated[float, Field(gt=0, le=1)] = 0.8
    """Rule 1: VRAM pressure (of the soft cap) above which BACKWARD suppresses speculation."""
    contention_checks: PosInt = 3
    """Rule 3: consecutive all-slots-full checks after which the prefetch window shrinks."""
    telemetry_interval_steps: PosInt = 1
    telemetry_file: str = "conductor_telemetry.jsonl"
    """JSONL of a Conductor built without the run's ``Telemetry`` (working directory)."""
    debug_event_trace: bool = False

    @model_validator(mode="after")
    def _caps(self) -> ConductorConfig:
        # The caps are a (high, low) pair under the watermark rule.
        check_pair(
            self.vram_hard_cap_mb, self.vram_soft_cap_mb, ("vram_hard_cap_mb", "vram_soft_cap_mb")
        )
        return self


RETIRED_STAGEHAND_FIELDS = ("two_stage", "encoder_family", "family")
"""``memory.stagehand`` fields of the seed's presets that no part of a run reads: a run always
caches its embeddings first (``two_stage``), and the model's family and text encoder come from
``model_type`` and ``model``. A preset's loader drops them, so presets and run configs saved with
them still load; the section itself refuses them."""


class StagehandSection(StagehandConfig):
    """The preset's ``memory.stagehand`` block: the weight runtime's fields plus what nests in it."""

    weight_streaming: bool = True
    """Stream the blocks' weights; false keeps every weight resident on the device (activation
    spill and/or the Conductor alone)."""

    text_encoder_block_swap: bool = True
    """Run the stage-1 text encoder under the weight runtime in inference mode."""
    text_encoder_squareq: bool = False
    """With ``squareq`` and ``text_encoder_block_swap``: stage 1's text encoders stream in 8 bits
    too (``MemoryConfig.for_text_encoder``); off, they stream in their own dtype."""
    activation_stagehand: ActivationStagehandConfig | None = None
    conductor_config: ConductorConfig | None = None


def _on_off(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("on", "off"):
        return value == "on"
    raise ValueError(f'expected "on", "off", true or false, got {value!r}')


Strategy = Literal["none", "stagehand", "layer_offload"]
"""The memory strategies (``runtime/stagehand/strategy/build.py`` builds each)."""
STRATEGIES: tuple[str, ...] = get_args(Strategy)
"""The same names as a tuple (served to the dashboard in ``/static/js/contract.js``)."""


class MemoryConfig(_Strict):
    """The preset's ``memory`` section: which strategy runs and its settings."""

    strategy: Strategy = "stagehand"
    gradient_checkpointing: bool = True
    """Accepts the seeds' "on"/"off" as well as booleans."""
    enable_activation_offloading: bool = False
    """layer_offload: move checkpoint inputs to the host between layers."""
    enable_async_offloading: bool = False
    """layer_offload: non_blocking copies on CUDA."""
    layer_offload_fraction: Annotated[float, Field(ge=0, le=1)] = 0.0
    """layer_offload: fraction of the blocks offloaded; the first (1 - f) x N stay resident."""
    stagehand: StagehandSection | None = None

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _gc(cls, value: object) -> bool:
        return _on_off(value)

    @model_validator(mode="after")
    def _fill(self) -> MemoryConfig:
        if self.strategy == "stagehand" and self.stagehand is None:
            self.stagehand = StagehandSection()
        return self

    def squareq_format(self) -> str | None:
        """The format a run of this section streams its frozen blocks in (``"int8"``,
        ``"fp8_e4m3"``), or None when SquareQ is off: it needs the weight runtime (``strategy:
        stagehand`` with ``weight_streaming``) and ``squareq``."""
        sh = self.stagehand
        if self.strategy != "stagehand" or sh is None or not sh.weight_streaming:
            return None
        return sh.squareq.format if sh.squareq is not None else None

    def for_text_encoder(self) -> MemoryConfig:
        """The section stage 1's text encoders run under: without ``squareq`` unless
        ``text_encoder_squareq`` is on (then the same section)."""
        section = self.stagehand
        if section is None or section.squareq is None or section.text_encoder_squareq:
            return self
        return self.model_copy(update={"stagehand": section.model_copy(update={"squareq": None})})


class _LiveLimitsRules(_Strict):
    """What ``LiveLimits`` checks and offers beside its fields."""

    @model_validator(mode="after")
    def _pairs(self) -> _LiveLimitsRules:
        for names in PAIRS:
            high, low = (getattr(self, name) for name in names)
            if high is not None and low is not None:
                check_watermarks(high, low, names)
        return self

    def given(self) -> dict[str, float | int]:
        """The fields that were set, as a plain dict."""
        return self.model_dump(exclude_none=True)


def _limit_type(path: str) -> Any:
    """The type of the live limit at config ``path`` (``stagehand.config.limits.PATHS``): its config
    field's, optional, and without ``"auto"`` for a watermark (a value put in force is MB)."""
    section, name = path.rsplit(".", 1)
    model = {SH: StagehandConfig, AS: ActivationStagehandConfig}[section]
    hint = get_type_hints(model, include_extras=True)[name]
    return (NonNegMB if hint == MBOrAuto else hint) | None


LiveLimits = create_model(
    "LiveLimits",
    __base__=_LiveLimitsRules,
    __doc__="""Limits a user may change during a run; applied at the next STEP_BEGIN.

    Every field is optional: only the given ones change, each only itself (``vram_*`` are the
    weight runtime's watermarks, ``activation_vram_*`` the activation runtime's). Its fields are
    those of ``stagehand.config.limits.PATHS``, each typed as the config field it changes (``_limit_type``).
    """,
    **{field: (_limit_type(path), None) for field, path in PATHS.items()},
)
