"""``POST /api/pipelines/inspect``: what a diffusers pipeline folder holds, before a run starts
(family, each component's class, parameter count and dtype, the blocks the weight runtime will
stream and their size). Reads JSON and safetensors headers only (regular files only, the JSON's
nesting bounded: ``stagehand.config.safe_read``); no weights are loaded. The read runs in one of the
server's folder-read slots, under its time limit (``workbench.services.folder_reads``)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from workbench.api.errors import Invalid
from workbench.contract.preset import MODEL_TYPES
from workbench.services.folder_reads import READS, RESPONSES
from workbench.services.torch_side import import_torch_side

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


@router.post("/inspect", responses=RESPONSES)
def inspect(body: PipelineInspect) -> dict:
    """What the pipeline folder ``path`` holds (``workbench.worker.pipelines.inspect_pipeline``).

    Raises:
        Invalid (422): not a pipeline folder (a file of it malformed, too deep, or not a
            regular file: names the file and key), or a path the file system refuses (a name
            over its 255-byte limit, no permission), naming ``path`` or ``transformer_path``.
        Busy (503): every folder-read slot is taken.
        ReadTimeout (504): the folder did not answer within the time limit.
    """
    import_torch_side()
    from workbench.worker.diffusers_classes import (  # lazy: the server starts without torch
        diffusers_class,
    )
    from workbench.worker.pipelines import (  # lazy: the server starts without torch
        PipelineFolderError,
        inspect_pipeline,
        trainable,
    )
    from workbench.worker.pipelines.folder import (  # lazy: the server starts without torch
        detect_family,
    )

    try:
        _, index = READS.run(lambda: detect_family(body.path), path=body.path, field="path")
        # Outside the time limit: diffusers imports a pipeline's modules on its first use, which
        # took over 30 s on a loaded 2-core machine; no file of the folder is read here.
        diffusers_class(index["_class_name"])
        info = READS.run(
            lambda: inspect_pipeline(
                body.path,
                model_type=body.model_type,
                aliases=MODEL_TYPES,
                transformer_path=body.transformer_path,
            ),
            path=body.path,
            field="path",
        )
    except PipelineFolderError as exc:
        raise Invalid(str(exc), field=_field(str(exc))) from None
    except AttributeError as exc:  # diffusers_class: a pipeline class this diffusers lacks
        raise Invalid(f"path: {body.path}/model_index.json names {exc}", field="path") from None
    except OSError as exc:  # a name the file system refuses (ENAMETOOLONG, EACCES, ELOOP...)
        name = str(exc.filename or body.path)
        single = body.transformer_path
        field = "transformer_path" if single and name.startswith(_expanded(single)) else "path"
        shown = repr(name[:80]) + ("..." if len(name) > 80 else "")
        raise Invalid(
            f"{field}: cannot read {shown} ({exc.strerror or exc})", field=field
        ) from None
    return {**info.as_dict(), "trainable": trainable(info)}
