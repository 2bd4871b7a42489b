"""Weight streaming (Stagehand): a model's repeated blocks visit the compute device one at a
time through a pinned host pool, traced, prefetched and evicted.

Source: the LTX-2 bf16 on 24 GB case study.
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
from stagehand.weights.runtime import WeightRuntime
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
    "WeightRuntime",
    "StagehandSetupError",
    "UnmatchedParameterError",
    "checkpoint_key",
    "find_blocks",
]
