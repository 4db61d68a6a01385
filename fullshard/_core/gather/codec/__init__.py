"""The quantized all-gather's codec: block-wise codes and scales (``quantize.py``), a
unit's gather input encoded and its output decoded, and the wire that carries the codes
(``quantized_gather.py``), and the two fast paths (``fused_codec.py``: inductor loops; ``codec_kernel.py``: a
small C library). This face names what the rest may use.
"""

from .fused_codec import MIN_FUSED_VALUES
from .quantize import BlockQuantizer
from .quantized_gather import QuantizedGather, QuantizedWire

__all__ = ["BlockQuantizer", "MIN_FUSED_VALUES", "QuantizedGather", "QuantizedWire"]
