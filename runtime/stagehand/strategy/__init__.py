"""Memory strategies: the object a training loop drives (see ``base.MemoryStrategy``)."""

from stagehand.strategy.base import MemoryStrategy
from stagehand.strategy.build import build_strategy

__all__ = ["MemoryStrategy", "build_strategy"]
