"""``POST /api/pipelines/inspect``: what a diffusers pipeline folder holds, before a run starts
(family, each component's class, parameter count and dtype, the blocks the weight runtime will
stream and their size). Reads JSON and safetensors headers only; no weights are loaded."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from backend.errors import Invalid

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


@router.post("/inspect")
def inspect(body: PipelineInspect) -> dict:
    from contract.preset import MODEL_TYPES
    from worker.pipelines import PipelineFolderError, inspect_pipeline, trainable

    try:
        info = inspect_pipeline(
            body.path,
            model_type=body.model_type,
            aliases=MODEL_TYPES,
            transformer_path=body.transformer_path,
        )
    except PipelineFolderError as exc:
        raise Invalid(str(exc), field=_field(str(exc))) from None
    return {**info.as_dict(), "trainable": trainable(info)}
