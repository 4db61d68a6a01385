"""Block-wise absmax quantization of weights for the all-gather (ZeRO++ style).

[Note: Quantized all-gather]
A unit's weights cross the wire twice a step (forward and backward gathers). Sent
as 1-byte codes, each block of ``block_size`` values with its own fp32 scale, they
cost about half the bytes of bf16 (``(1 + 4 / block_size) / 2``). Each rank packs
its shard as ``[codes | scales]`` in one uint8 tensor (its row of the all-gather
output), so one all-gather moves both and every rank's chunk has the same size; the gathered chunks are widened
to fp32 and scaled in place, and the copy into the parameters casts them to the
compute dtype (no intermediate in it). Master weights, gradients and
optimizer states never see the codes: only the copy the forward computes with.

The scale of a block maps its largest magnitude onto the code's largest value
(127 for int8, 448 for float8_e4m3fn), so an int8 value is off by at most half a
step (``absmax / 254``), and a float8 value by at most 2**-4 of itself (three
mantissa bits), or one subnormal step near zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# The largest magnitude each code dtype holds: a block's absmax maps onto it.
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_SCALE_BYTES = 4  # one fp32 scale per block


@dataclass(frozen=True)
class BlockQuantizer:
    """Encodes 1D shards as block-wise codes and decodes gathered ones."""

    code_dtype: torch.dtype  # torch.int8 or torch.float8_e4m3fn
    block_size: int

    def __post_init__(self) -> None:
        if self.code_dtype not in CODE_MAX:
            names = ", ".join(str(d) for d in CODE_MAX)
            raise ValueError(f"quantized all-gather expects a code dtype in ({names}) but got {self.code_dtype}")
        if self.block_size <= 0 or self.block_size % _SCALE_BYTES:
            raise ValueError(
                f"quantized all-gather expects a positive block size divisible by {_SCALE_BYTES} (the scales"
                f" that follow the codes stay aligned) but got {self.block_size}"
            )

    def num_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def packed_numel(self, numel: int) -> int:
        """Bytes one rank sends for a shard of ``numel`` values: codes, then scales."""
        num_blocks = self.num_blocks(numel)
        return num_blocks * self.block_size + num_blocks * _SCALE_BYTES

    @torch.no_grad()
    def encode(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Writes ``values`` (1D fp32, a multiple of ``block_size`` long: callers pad with zeros)
        into ``out`` (uint8, ``packed_numel``). ``values`` is scratch: it is scaled in place."""
        num_blocks = self.num_blocks(values.numel())
        if values.dtype != torch.float32 or values.numel() != num_blocks * self.block_size:
            raise AssertionError(f"encode expects fp32 values in whole blocks, got {values.dtype} x {values.numel()}")
        blocks = values.view(num_blocks, self.block_size)
        code_max = CODE_MAX[self.code_dtype]
        # Two vectorised reductions beat one over abs() (a temporary) and aminmax (not vectorised on the CPU).
        absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())
        scales = out[values.numel() : values.numel() + num_blocks * _SCALE_BYTES].view(torch.float32)  # in place
        torch.div(absmax, code_max, out=scales).masked_fill_(absmax == 0, 1.0)  # a zero block decodes to zeros
        blocks.mul_(scales.reciprocal().unsqueeze(1))  # within +-code_max, to rounding
        if self.code_dtype == torch.int8:
            blocks.round_()
        else:
            blocks.clamp_(-code_max, code_max)  # float8_e4m3fn has no infinity: past 448 is NaN
        out[: values.numel()].view(self.code_dtype).view(num_blocks, self.block_size).copy_(blocks)

    @torch.no_grad()
    def decode(self, chunks: torch.Tensor, numel: int) -> torch.Tensor:
        """The values of gathered chunks (``chunks``: uint8, one row per rank, codes first;
        rows may be strided), ``numel`` each: fp32, one row per chunk."""
        num_chunks, num_blocks = chunks.size(0), self.num_blocks(numel)
        padded = num_blocks * self.block_size
        codes = chunks[:, :padded]
        scales = chunks[:, padded : padded + num_blocks * _SCALE_BYTES].view(torch.float32).unsqueeze(2)
        values = torch.empty(num_chunks, num_blocks, self.block_size, dtype=torch.float32, device=chunks.device)
        _codes_to_fp32(codes, self.code_dtype, values.view(num_chunks, padded))
        # Scaled in place: on the CPU a mixed-dtype multiply would first cast the codes into a temporary.
        values.mul_(scales)
        return values.view(num_chunks, padded)[:, :numel]


def _codes_to_fp32(codes: torch.Tensor, code_dtype: torch.dtype, out: torch.Tensor) -> None:
    """``out`` (fp32) = ``codes`` (uint8 bytes of ``code_dtype``, one row per chunk), exactly.

    torch converts float8 to wider floats one scalar at a time on the CPU; a lookup in
    the table of all 256 codes' values is exact and 3 to 6 times faster. Its int32
    indices (index_select's int64 path is slower still) are converted one row at a
    time, so they add a chunk's worth of memory, not the unit's."""
    if code_dtype == torch.int8 or codes.device.type != "cpu":
        out.copy_(codes.view(code_dtype))
        return
    table = _code_values(code_dtype)
    index = torch.empty(codes.size(1), dtype=torch.int32, device=codes.device)
    for row, values in zip(codes, out):
        torch.index_select(table, 0, index.copy_(row), out=values)


@functools.cache
def _code_values(code_dtype: torch.dtype) -> torch.Tensor:
    """The fp32 value of each of the 256 bytes read as ``code_dtype`` (on the CPU)."""
    return torch.arange(256, dtype=torch.uint8).view(code_dtype).float()
