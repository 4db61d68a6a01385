"""A unit's all-gather input as block-wise codes, and its output decoded back.

Each rank's chunk on the wire is ``[codes | scales | exact]``: the parameters
to quantize, read from the flat gather input back to back, or from the shards
in their own dtype where the compute dtype is narrower (rounded to it: the
codes of the cast values, with no cast copy-in before), cast to fp32 on the
way and quantized in one pass (see [Note: Quantized all-gather] in
quantize.py), then the bytes of the parameters kept exact (norms, biases,
embeddings by default). Decoding multiplies the codes by their scales and
scatters the values, like ``Layout.copy_out``, straight into the unsharded
parameters: one split-copy for the coded ones, one for the exact ones. Large
units on the CPU run the same arithmetic compiled into fused loops instead
(see [Note: Fused codec] in fused_codec.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .fused_codec import FusedCodec, fusable
from .layout import Layout
from .quantize import BlockQuantizer

_SCALE_ALIGN = 4  # bytes of an fp32 scale


class _Plan(NamedTuple):
    coded: list[int]  # parameters sent as codes, in layout order
    exact: list[int]  # parameters sent as they are
    coded_numel: int  # values of the coded parameters, back to back
    coded_padded: int  # the same in whole blocks
    coded_bytes: int  # their codes and scales on the wire
    exact_numel: int  # values of the exact parameters, back to back
    packed_numel: int  # one rank's chunk on the wire, in bytes


class QuantizedGather:
    """Encodes and decodes one unit's all-gather; ``exact[i]`` keeps parameter i's values as they are."""

    def __init__(self, quantizer: BlockQuantizer, exact: list[bool]) -> None:
        self.quantizer = quantizer
        self.exact = exact
        self._plans: dict[Layout, _Plan] = {}  # the gather layout, and the post-forward one
        self._fused: dict[Layout, FusedCodec | None] = {}

    def _plan(self, layout: Layout) -> _Plan:
        plan = self._plans.get(layout)
        if plan is None:
            if layout.dtype == torch.uint8:
                raise AssertionError("a quantized all-gather needs a unit of one dtype (checked when it is set)")
            coded = [i for i, keep in enumerate(self.exact) if not keep]
            exact = [i for i, keep in enumerate(self.exact) if keep]
            coded_numel = sum(layout.sizes[i] for i in coded)
            coded_padded = self.quantizer.num_blocks(coded_numel) * self.quantizer.block_size
            coded_bytes = self.quantizer.packed_numel(coded_numel) if coded else 0
            exact_bytes = sum(layout.sizes[i] for i in exact) * layout.dtype.itemsize
            # Every rank's chunk starts 4-aligned, where the next rank's scales are read as fp32.
            packed_numel = -(-(coded_bytes + exact_bytes) // _SCALE_ALIGN) * _SCALE_ALIGN
            exact_numel = sum(layout.sizes[i] for i in exact)
            plan = _Plan(coded, exact, coded_numel, coded_padded, coded_bytes, exact_numel, packed_numel)
            self._plans[layout] = plan
        return plan

    def _fused_codec(self, layout: Layout, plan: _Plan, device: torch.device) -> FusedCodec | None:
        """The compiled codec of ``layout``, where it pays (see [Note: Fused codec])."""
        if not plan.coded or not fusable(device, plan.coded_numel):
            return None
        if layout not in self._fused:
            offsets, sizes = [layout.offsets[i] for i in plan.coded], [layout.sizes[i] for i in plan.coded]
            quantizer = self.quantizer
            self._fused[layout] = FusedCodec.shared(
                quantizer.code_dtype, quantizer.block_size, offsets, sizes, layout.dtype
            )
        return self._fused[layout]

    def packed_numel(self, layout: Layout) -> int:
        """Bytes each rank sends for one chunk of ``layout``."""
        return self._plan(layout).packed_numel

    @torch.no_grad()
    def encode(self, source: torch.Tensor, layout: Layout, packed: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's chunk on the wire, from ``source`` (1D, one chunk of ``layout``, or the shards
        in their own dtype at the same offsets: cast on the way, the codes those of the cast values),
        written into ``packed`` (uint8, ``packed_numel``: this rank's row of the all-gather output, so
        the collective has nothing to copy) or a new tensor."""
        plan = self._plan(layout)
        if packed is None:
            packed = torch.empty(plan.packed_numel, dtype=torch.uint8, device=source.device)
        if plan.coded and not self._encode_fused(source, layout, plan, packed):
            # The coded values side by side in fp32 (one pass: the cast rides the copy), zero-padded to whole blocks.
            coded = torch.empty(plan.coded_padded, dtype=torch.float32, device=source.device)
            torch.cat([self._region(source, layout, i) for i in plan.coded], out=coded[: plan.coded_numel])
            coded[plan.coded_numel :].zero_()
            self.quantizer.encode(coded, packed[: plan.coded_bytes])
        if plan.exact:
            exact = packed[plan.coded_bytes :].view(layout.dtype)[: plan.exact_numel]
            torch.cat([layout.region(source, i, source.dtype) for i in plan.exact], out=exact)
        return packed

    @staticmethod
    def _region(source: torch.Tensor, layout: Layout, index: int) -> torch.Tensor:
        """Parameter ``index``'s values in ``layout.dtype`` (rounded there where ``source`` is wider)."""
        region = layout.region(source, index, source.dtype)
        return region if region.dtype == layout.dtype else region.to(layout.dtype)

    def _encode_fused(self, source: torch.Tensor, layout: Layout, plan: _Plan, packed: torch.Tensor) -> bool:
        """The coded parameters of ``encode`` by the fused codec, straight into ``packed``;
        False where there is none."""
        fused = self._fused_codec(layout, plan, source.device)
        if fused is None:
            return False
        codes = packed[: plan.coded_padded].view(self.quantizer.code_dtype)
        scales = packed[plan.coded_padded : plan.coded_bytes].view(torch.float32)
        return fused.encode(source, codes, scales)

    @torch.no_grad()
    def decode(self, gathered: torch.Tensor, num_chunks: int, layout: Layout, outputs: list[torch.Tensor]) -> None:
        """Fills ``outputs`` (each parameter's padded unsharded storage, ``num_chunks`` chunks of its
        region) from the gathered chunks: the same scatter as ``Layout.copy_out``, from codes."""
        plan = self._plan(layout)
        chunks = gathered.view(num_chunks, -1)
        if plan.coded and not self._decode_fused(chunks, layout, plan, outputs):
            values = self.quantizer.decode(chunks[:, : plan.coded_bytes], plan.coded_numel)
            self._split(values, layout, plan.coded, outputs, num_chunks)
        if plan.exact:
            exact = chunks[:, plan.coded_bytes :].view(layout.dtype)[:, : plan.exact_numel]
            self._split(exact, layout, plan.exact, outputs, num_chunks)

    def _decode_fused(self, chunks: torch.Tensor, layout: Layout, plan: _Plan, outputs: list[torch.Tensor]) -> bool:
        """The coded parameters of ``decode`` by the fused codec; False where there is none."""
        fused = self._fused_codec(layout, plan, chunks.device)
        if fused is None:
            return False
        scales_start = plan.coded_padded
        scales_end = scales_start + (plan.coded_bytes - plan.coded_padded)
        codes = chunks[:, :scales_start].view(self.quantizer.code_dtype)
        scales = chunks[:, scales_start:scales_end].view(torch.float32)
        return fused.decode(codes, scales, [outputs[i] for i in plan.coded])

    @staticmethod
    def _split(
        side_by_side: torch.Tensor, layout: Layout, indices: list[int], outputs: list[torch.Tensor], num_chunks: int
    ) -> None:
        """Copies the columns of ``side_by_side`` (regions ``indices`` back to back) into their outputs,
        cast to ``layout.dtype`` on the way (one pass: no intermediate in the compute dtype)."""
        sizes = [layout.sizes[i] for i in indices]
        destinations = [outputs[i].view(num_chunks, size) for i, size in zip(indices, sizes)]
        if side_by_side.dtype == layout.dtype:
            torch.split_with_sizes_copy(side_by_side, sizes, dim=1, out=destinations)
        else:  # split_with_sizes_copy cannot cast
            torch._foreach_copy_(destinations, list(side_by_side.split(sizes, dim=1)))
