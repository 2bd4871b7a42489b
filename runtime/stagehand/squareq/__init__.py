"""SquareQ: frozen block weights kept, cached and streamed in 8 bits (``int8`` or ``fp8_e4m3``,
one fp32 scale per output row), dequantized on the device into the compute dtype as each block
loads. Only the LoRA trains; the LoRA file is the ordinary one.

Source: "Conductor: Resource Arbitration Across Memory Runtimes" (SquareQ, "INT8 dequant staging").
"""

from stagehand.squareq.formats import FORMATS, dequantize, quantize
from stagehand.squareq.image import BlockImage
from stagehand.squareq.runtime import SquareQ

__all__ = ["FORMATS", "BlockImage", "SquareQ", "dequantize", "quantize"]
