"""Layer offload (``memory.strategy: "layer_offload"``): a fraction of the blocks resident,
the rest loaded before and evicted after each layer, every layer checkpointed, checkpoint
inputs moved to the host between layers, all on the weight and activation runtimes' mechanisms.
The strategy a training loop drives is ``runtime.strategy.layer_offload.LayerOffloadStrategy``
(this package imports nothing of ``runtime.strategy``).

Source: the Flux 2048 px layer-offload case study.
"""

from runtime.layer_offload.checkpoint_layer import OffloadCheckpointLayer
from runtime.layer_offload.manager import LayerOffloadManager
from runtime.layer_offload.schedule import LayerOrderScheduler, resident_count
from runtime.layer_offload.section import layer_offload_section

__all__ = [
    "LayerOffloadManager",
    "LayerOrderScheduler",
    "OffloadCheckpointLayer",
    "layer_offload_section",
    "resident_count",
]
