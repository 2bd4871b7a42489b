"""Layer offload (``memory.strategy: "layer_offload"``): a fraction of the blocks resident,
the rest loaded before and evicted after each layer, every layer checkpointed, checkpoint
inputs moved to the host between layers, all on the weight and activation runtimes' mechanisms.
The strategy a training loop drives is ``stagehand.strategy.layer_offload.LayerOffloadStrategy``
(this package imports nothing of ``stagehand.strategy``).

Source: the Flux 2048 px layer-offload case study.
"""

from stagehand.layer_offload.checkpoint_layer import OffloadCheckpointLayer
from stagehand.layer_offload.manager import LayerOffloadManager
from stagehand.layer_offload.schedule import LayerOrderScheduler, resident_count
from stagehand.layer_offload.section import layer_offload_section

__all__ = [
    "LayerOffloadManager",
    "LayerOrderScheduler",
    "OffloadCheckpointLayer",
    "layer_offload_section",
    "resident_count",
]
