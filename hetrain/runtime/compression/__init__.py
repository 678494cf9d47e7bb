"""Gradient compression that torch does not ship: int8 and top-k, with error feedback."""

from hetrain.runtime.compression.int8 import Int8State, dequantize, int8_allreduce, int8_bytes, quantize
from hetrain.runtime.compression.runner import SerialRunner
from hetrain.runtime.compression.stats import CommStats, allgather_bytes, allreduce_bytes
from hetrain.runtime.compression.topk import TopkState, topk_allreduce, topk_bytes, topk_count

__all__ = [
    "CommStats", "Int8State", "SerialRunner", "TopkState", "allgather_bytes", "allreduce_bytes",
    "dequantize", "int8_allreduce", "int8_bytes", "quantize", "topk_allreduce", "topk_bytes", "topk_count",
]
