"""Weight streaming (Stagehand): a model's repeated blocks visit the compute device one at a
time through a pinned host pool, traced, prefetched and evicted.

Source: ``shared/seeds/case-study-ltx2-bf16-24gb.md``.
"""

from stagehand.weights.errors import (
    BlockDiscoveryError,
    BlockStateError,
    BlockTooLargeError,
    ParameterMismatchError,
    PoolConfigError,
    SlabTimeoutError,
    StagehandError,
    StagehandSetupError,
    UnmatchedParameterError,
)
from stagehand.weights.pool import PinnedPool
from stagehand.weights.registry import Block, BlockState, find_blocks
from stagehand.weights.runtime import StagehandRuntime
from stagehand.weights.scheduler import BlockScheduler
from stagehand.weights.sources import SafetensorsCheckpoint, checkpoint_key

__all__ = [
    "Block",
    "BlockDiscoveryError",
    "BlockScheduler",
    "BlockState",
    "BlockStateError",
    "BlockTooLargeError",
    "ParameterMismatchError",
    "PinnedPool",
    "PoolConfigError",
    "SafetensorsCheckpoint",
    "SlabTimeoutError",
    "StagehandError",
    "StagehandRuntime",
    "StagehandSetupError",
    "UnmatchedParameterError",
    "checkpoint_key",
    "find_blocks",
]
