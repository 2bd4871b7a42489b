"""``POST /api/pipelines/inspect``: what a diffusers pipeline folder holds, before a run starts
(family, each component's class, parameter count and dtype, the blocks the weight runtime will
stream and their size). Reads JSON and safetensors headers only; no weights are loaded."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from backend.api.errors import Invalid
from contract.preset import MODEL_TYPES

router = APIRouter(prefix="/api/pipelines", tags=["pipelines"])


class PipelineInspect(BaseModel):
    """The folder to inspect, as the preset's ``model`` section and ``model_type`` name it."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1, max_length=4096)
    transformer_path: str | None = Field(default=None, max_length=4096)
    model_type: str | None = Field(default=None, max_length=64)


def _field(message: str) -> str:
    """The request field an inspection error names (its message starts with it)."""
    for name in ("transformer_path", "model_type"):
        if message.startswith((name, f"model.{name}")):
            return name
    return "path"


def _expanded(path: str) -> str:
    return str(Path(path).expanduser())


@router.post("/inspect")
def inspect(body: PipelineInspect) -> dict:
    """What the pipeline folder ``path`` holds (``worker.pipelines.inspect_pipeline``).

    Raises:
        Invalid (422): not a pipeline folder, or a path the file system refuses (a name over
            its 255-byte limit, no permission), naming ``path`` or ``transformer_path``.
    """
    from worker.pipelines import (  # lazy: the server starts without torch
        PipelineFolderError,
        inspect_pipeline,
        trainable,
    )

    try:
        info = inspect_pipeline(
            body.path,
            model_type=body.model_type,
            aliases=MODEL_TYPES,
            transformer_path=body.transformer_path,
        )
    except PipelineFolderError as exc:
        raise Invalid(str(exc), field=_field(str(exc))) from None
    except OSError as exc:  # a name the file system refuses (ENAMETOOLONG, EACCES, ELOOP...)
        name = str(exc.filename or body.path)
        single = body.transformer_path
        field = "transformer_path" if single and name.startswith(_expanded(single)) else "path"
        shown = repr(name[:80]) + ("..." if len(name) > 80 else "")
        raise Invalid(
            f"{field}: cannot read {shown} ({exc.strerror or exc})", field=field
        ) from None
    return {**info.as_dict(), "trainable": trainable(info)}
