"""Request and response models, split by direction (Create / Update / Public) as the API uses them.

Field names and shapes are docs/contracts.md's; lists are ``{data, count}``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from stagehand.config.limits import PAIRS, PATHS, low_above_high
from stagehand.config.memory import AUTO_DEVICE, MAX_MB, LiveLimits, check_device
from workbench.api.fields import (  # RunId, TuneId, Since, bounded_int, NAME_RE: re-exported
    DEVICE_SCHEMA,
    MAX_ID,
    MAX_NOTES_CHARS,
    MAX_RUN_NAME,
    MAX_TAG_CHARS,
    MAX_TAGS,
    NAME_RE,  # noqa: F401
    PRESET_NAME_SCHEMA,
    RUN_NAME_DESCRIPTION,
    RUN_NAME_SCHEMA,
    TAG_SCHEMA,
    RunId,  # noqa: F401
    Since,  # noqa: F401
    TuneId,  # noqa: F401
    bounded_int,  # noqa: F401
    check_preset_name,
    check_run_name,
)
from workbench.contract.plan_inputs import DEVICE_PROFILES
from workbench.contract.preset import field_error
from workbench.contract.status import RunStatus
from workbench.contract.text import shown_json

PresetConfig = Annotated[
    dict[str, Any],
    WithJsonSchema({"allOf": [{"$ref": "#/components/schemas/Preset"}], "description": "a Preset"}),
]
"""A preset's config: validated as ``workbench.worker.preset.Preset`` (its schema, with its bounds, is
published in the OpenAPI document)."""
Overrides = Annotated[
    dict[str, Any],
    WithJsonSchema(
        {
            "type": "object",
            "description": "Preset fields to change (a partial Preset: see the Preset schema), "
            "merged deep into the preset's config and validated as a whole, every problem "
            "listed. null removes the preset's key (the field's default applies). A model.path "
            "or data.path where the preset names no folder drops the preset's fields bound to "
            "it (GET /api/overrides/folders: its factory, data limit, caption length, sample "
            "prompts) unless the overrides set them too",
        }
    ),
]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PresetCreate(_In):
    name: str = Field(max_length=64, json_schema_extra=PRESET_NAME_SCHEMA)
    config: PresetConfig
    description: str = Field(default="", max_length=2000)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_preset_name(v)


class PresetUpdate(_In):
    config: PresetConfig
    description: str | None = Field(default=None, max_length=2000)


class PresetDuplicate(_In):
    name: str = Field(max_length=64, json_schema_extra=PRESET_NAME_SCHEMA)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_preset_name(v)


class PresetPublic(BaseModel):
    name: str
    description: str
    builtin: bool
    config: dict[str, Any]
    created_at: float | None = None
    updated_at: float | None = None


class PresetsPublic(BaseModel):
    data: list[PresetPublic]
    count: int


class RunCreate(_In):
    preset: str = Field(max_length=64)
    name: str | None = Field(
        default=None,
        max_length=MAX_RUN_NAME,
        description=RUN_NAME_DESCRIPTION,
        json_schema_extra=RUN_NAME_SCHEMA,
    )
    overrides: Overrides = Field(default_factory=dict)
    device: str = Field(
        default=AUTO_DEVICE,
        description='the worker\'s device: "auto" (CUDA when present, else the CPU), "cpu", '
        '"cuda" or "cuda:N"; runs on one device share its --max-parallel slots',
        json_schema_extra=DEVICE_SCHEMA,
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_device(v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return None if v is None else check_run_name(v)


class ScanRequest(_In):
    """What ``POST /api/data/scan`` scans: the data of a run of ``preset`` with ``overrides``."""

    preset: str = Field(max_length=64)
    overrides: Overrides = Field(default_factory=dict)


class ScanSkipped(BaseModel):
    file: str
    """Relative to the data folder; a folder ends with ``/``."""
    reason: str
    bad: bool
    """Counts for ``data.on_bad_file`` (an unreadable image or clip, a caption without image)."""


class ScanWarning(BaseModel):
    file: str
    message: str


class DatasetScan(BaseModel):
    """The dataset scan (``backend/workbench/worker/scan.py``; the worker records the same fields as
    ``trainer/dataset_scan``). ``usable`` is null when the folder is a factory's, built and
    scanned by the worker (``note`` says so)."""

    folder: str | None
    usable: int | None
    skipped: list[ScanSkipped] = []
    warnings: list[ScanWarning] = []
    bad: int = 0
    captions_defaulted: int = 0
    on_bad_file: Literal["skip", "fail"]
    problem: str | None = None
    """Why a run would fail on this data (naming the files), or null."""
    note: str | None = None


class RunUpdate(_In):
    notes: str | None = Field(default=None, max_length=MAX_NOTES_CHARS)
    tags: list[Annotated[str, Field(json_schema_extra=TAG_SCHEMA)]] | None = Field(
        default=None, max_length=MAX_TAGS
    )
    name: str | None = Field(
        default=None,
        max_length=MAX_RUN_NAME,
        description=RUN_NAME_DESCRIPTION,
        json_schema_extra=RUN_NAME_SCHEMA,
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return None if v is None else check_run_name(v)

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        for tag in v:
            if not 1 <= len(tag) <= MAX_TAG_CHARS or not tag.isprintable() or "," in tag:
                raise ValueError(
                    f"expected tags of 1-{MAX_TAG_CHARS} printable characters without ',', "
                    f"got {tag!r}"
                )
        return v


class RunSummary(BaseModel):
    steps_done: int | None = None
    max_steps: int | None = None
    final_loss: float | None = None
    peak_vram_mb: float | None = None
    """The training stage's peak (stage 2): what Compare and the runs list compare."""
    encode_peak_vram_mb: float | None = None
    """Stage 1's peak (text encoders, VAE encoding, caching), when it reported one."""
    mean_step_time_ms: float | None = None
    spill_bytes: int | None = None
    stall_ms: float | None = None
    weights_mode: str | None = None
    """How weight streaming reached the GPU in training (``host-cache``, ``host-cache-partial``,
    ``file-backed``, ``module-backed``; None without streaming): the last ``stagehand/step``
    record's, with its ``weights_mode_reason`` (README "Which mode weight streaming runs in")."""
    weights_mode_reason: str | None = None
    weights_squareq: str | None = None
    """The last ``squareq/step`` record's ``note`` (format, bytes saved, dequantization, worst
    layer's error) when the run kept frozen weights in 8 bits, else None."""
    recoveries: int | None = None
    """Out-of-memory recoveries: the run's ``trainer/oom_recovery`` records (each lowered its
    limits and ran the step again); None in a summary stored before they were counted."""


class RunError(BaseModel):
    """Why a run failed, was killed or crashed (docs/contracts.md, ``Run.error``)."""

    message: str
    error_type: str | None = None
    traceback: str | None = None
    oom: bool | None = None
    log_tail: str | None = None
    """Last lines of ``worker.log``: the reason when the worker died before writing telemetry."""
    last_record: dict[str, Any] | None = None


class RunPublic(BaseModel):
    id: int
    name: str
    preset: str
    config: dict[str, Any]
    status: RunStatus
    device: str | None = None
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    pid: int | None = None
    executor: str | None = None
    """``local`` or ``ray``: where the run's worker was started (None: not started yet)."""
    job_id: str | None = None
    """The executor's name for the worker: a pid, or a Ray job's submission id."""
    node: str | None = None
    """The machine the worker runs on: this host's name, or a Ray node's IP address."""
    exit_code: int | None = None
    signal: str | None = None
    error: RunError | None = None
    notes: str = ""
    tags: list[str] = []
    summary: RunSummary = RunSummary()
    last_seq: int = -1
    group_id: int | None = None
    """The tune this run is a trial of (``/api/tunes/{group_id}``), or null."""


class RunsPublic(BaseModel):
    data: list[RunPublic]
    count: int


class LimitsUpdate(LiveLimits):
    """The ``PATCH /api/runs/{id}/limits`` body: ``LiveLimits`` with strict, finite numbers
    (``true``, ``"5"``, ``NaN`` and ``1.0`` for a whole number are refused), one field at least
    not null, and a low watermark above its high one reported at the low field with a sentence
    (NOTE [ Cross-field errors ] in backend/workbench/worker/preset/load.py)."""

    model_config = ConfigDict(
        strict=True,
        allow_inf_nan=False,
        json_schema_extra={  # "no limits given" (runs.set_limits), said in JSON Schema
            "anyOf": [
                {"required": [f], "properties": {f: {"not": {"type": "null"}}}} for f in PATHS
            ]
        },
    )

    @model_validator(mode="after")
    def _pairs(self) -> LimitsUpdate:  # replaces LiveLimits._pairs, which names the model
        for names in PAIRS:
            top, bottom = (getattr(self, name) for name in names)
            sentence = None if top is None or bottom is None else low_above_high(top, bottom, names)
            if sentence:
                raise field_error("LimitsUpdate", names[1], bottom, sentence)
        return self


class LimitsAccepted(BaseModel):
    request_id: str


class LimitsChange(BaseModel):
    """One ``strategy/limits_applied`` record: ``changed`` is ``{field: [old, new]}`` (old is
    ``"auto"`` in the record that resolves an ``"auto"`` watermark, request id ``auto``)."""

    seq: int | None
    step: int | None
    time: float | None
    request_id: str | None
    changed: dict[str, list[float | int | str | None]]


class LimitFields(BaseModel):
    """``GET /api/limits/fields``: every LiveLimits field's config path and the (high, low)
    watermark pairs (``stagehand.config.limits``); the other fields are whole numbers."""

    paths: dict[str, str]
    pairs: list[tuple[str, str]]


class FolderFields(BaseModel):
    """``GET /api/overrides/folders``: folder field (``data.path``) -> the preset fields a run
    naming its own folder there drops (``workbench.contract.preset.bound_fields``)."""

    bound: dict[str, list[str]]


class LimitsPublic(LimitFields):
    """``GET /api/runs/{id}/limits``: LiveLimits field -> value, for the runtimes that are on
    (None: derived by the runtime at start, ``workbench.services.limits.config_limits``)."""

    preset: dict[str, float | int | None]
    now: dict[str, float | int | None]
    history: list[LimitsChange]


class TelemetryPage(BaseModel):
    data: list[dict[str, Any]]
    count: int
    next_since: int


class ClusterNode(BaseModel):
    node_id: str
    ip: str
    alive: bool
    head: bool
    cpus: float
    gpus: float


class ClusterInfo(BaseModel):
    """The Ray cluster a ``--executor ray`` server submits to (``GET /api/system``)."""

    executor: str
    address: str
    reachable: bool
    error: str | None = None
    nodes: list[ClusterNode] = []
    nodes_alive: int = 0
    cpus_total: float = 0
    cpus_used: float = 0
    gpus_total: float = 0
    gpus_used: float = 0


class SystemInfo(BaseModel):
    device: str
    device_name: str | None
    vram_total_mb: float | None
    cuda_devices: int = 0
    ram_total_mb: float
    torch_version: str | None
    cuda_version: str | None
    version: str
    executor: str = "local"
    cluster: ClusterInfo | None = None


RUN_FIELDS = tuple(RunPublic.model_fields)


def run_public(row: dict[str, Any], summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """A store row as the API's ``Run`` (plain JSON-able dict), every string shown
    (``workbench.contract.text.shown``): a worker's error naming a file that is not UTF-8, or a config
    sent with a lone ``\\udcff`` escape, must not make the runs list unanswerable."""
    out = {k: row.get(k) for k in RUN_FIELDS if k in row}
    out["notes"] = row.get("notes") or ""
    out["summary"] = summary if summary is not None else (row.get("summary") or {})
    out["summary"] = RunSummary.model_validate(
        {k: v for k, v in out["summary"].items() if k in RunSummary.model_fields}
    ).model_dump()
    if out.get("last_seq") is None:
        out["last_seq"] = -1
    return shown_json(out)


class TuneCreate(_In):
    """``POST /api/tunes``: trials of ``preset`` (with ``overrides``) within ``budget_mb``."""

    preset: str = Field(max_length=64)
    budget_mb: float = Field(gt=0, le=MAX_MB, allow_inf_nan=False)
    """The VRAM budget (MB of 2**20 bytes) every trial's predicted peak must fit."""
    device: str = Field(
        default="cpu", max_length=32, json_schema_extra={"enum": list(DEVICE_PROFILES)}
    )
    """The device profile the trials are planned on (``POST /api/plan``'s)."""
    trial_steps: int = Field(default=3, ge=1, le=100)
    """Steps of each trial after its trace step."""
    max_trials: int = Field(default=5, ge=1, le=12)
    overrides: Overrides = Field(default_factory=dict)


class TunePreset(_In):
    """``POST /api/tunes/{id}/preset``: save a trial's limits as a new preset."""

    run_id: int = Field(ge=1, le=MAX_ID)
    name: str = Field(max_length=64, json_schema_extra=PRESET_NAME_SCHEMA)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_preset_name(v)
