"""Memory strategies: the object a training loop drives (see ``base.MemoryStrategy``)."""

from runtime.strategy.base import MemoryStrategy
from runtime.strategy.build import build_strategy

__all__ = ["MemoryStrategy", "build_strategy"]
