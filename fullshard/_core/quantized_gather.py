"""A unit's all-gather input as block-wise codes, and its output decoded back.

Each rank's chunk on the wire is ``[codes | scales | exact]``: the parameters
to quantize, read from the flat gather input back to back and quantized in one
pass (see [Note: Quantized all-gather] in quantize.py), then the bytes of the
parameters kept exact (norms, biases, embeddings by default). Decoding rebuilds
the plain gather layout, so the copy-out into the unsharded parameters is the
usual one (see [Note: Unit buffers] in layout.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .layout import Layout
from .quantize import BlockQuantizer


class _Plan(NamedTuple):
    coded: list[int]  # parameters sent as codes, in layout order
    exact: list[int]  # parameters sent as they are
    coded_numel: int  # values of the coded parameters, back to back
    coded_bytes: int  # their codes and scales on the wire
    packed_numel: int  # one rank's chunk on the wire, in bytes


class QuantizedGather:
    """Encodes and decodes one unit's all-gather; ``exact[i]`` keeps parameter i's values as they are."""

    def __init__(self, quantizer: BlockQuantizer, exact: list[bool]) -> None:
        self.quantizer = quantizer
        self.exact = exact
        self._plans: dict[Layout, _Plan] = {}  # the gather layout, and the post-forward one

    def _plan(self, layout: Layout) -> _Plan:
        plan = self._plans.get(layout)
        if plan is None:
            if layout.dtype == torch.uint8:
                raise AssertionError("a quantized all-gather needs a unit of one dtype (checked when it is set)")
            coded = [i for i, keep in enumerate(self.exact) if not keep]
            exact = [i for i, keep in enumerate(self.exact) if keep]
            coded_numel = sum(layout.sizes[i] for i in coded)
            coded_bytes = self.quantizer.packed_numel(coded_numel) if coded else 0
            exact_bytes = sum(layout.sizes[i] for i in exact) * layout.dtype.itemsize
            plan = self._plans[layout] = _Plan(coded, exact, coded_numel, coded_bytes, coded_bytes + exact_bytes)
        return plan

    def packed_numel(self, layout: Layout) -> int:
        """Bytes each rank sends for one chunk of ``layout``."""
        return self._plan(layout).packed_numel

    def _regions(self, flat: torch.Tensor, layout: Layout, indices: list[int]) -> torch.Tensor:
        """Columns ``indices`` of ``flat`` (rows of ``layout.total``), back to back."""
        if len(indices) == len(layout.sizes):  # one dtype: the regions tile the chunk
            return flat
        return torch.cat([flat[:, layout.offsets[i] : layout.offsets[i] + layout.sizes[i]] for i in indices], dim=1)

    @torch.no_grad()
    def encode(self, source: torch.Tensor, layout: Layout) -> torch.Tensor:
        """This rank's chunk on the wire, from ``source`` (1D, one chunk of ``layout``)."""
        plan = self._plan(layout)
        packed = torch.empty(plan.packed_numel, dtype=torch.uint8, device=source.device)
        rows = source.view(1, -1)
        if plan.coded:
            self.quantizer.encode(self._regions(rows, layout, plan.coded).view(-1), packed[: plan.coded_bytes])
        if plan.exact:
            packed[plan.coded_bytes :].view(layout.dtype).copy_(self._regions(rows, layout, plan.exact).view(-1))
        return packed

    @torch.no_grad()
    def decode(self, gathered: torch.Tensor, num_chunks: int, layout: Layout) -> torch.Tensor:
        """The all-gather output in the plain layout (``num_chunks`` chunks of ``layout``)."""
        plan = self._plan(layout)
        chunks = gathered.view(num_chunks, -1)
        plain = torch.empty(num_chunks, layout.total, dtype=layout.dtype, device=gathered.device)
        if plan.coded:
            values = plain if not plan.exact else plain.new_empty(num_chunks, plan.coded_numel)
            self.quantizer.decode(chunks[:, : plan.coded_bytes], plan.coded_numel, values)
            if values is not plain:
                self._scatter(values, plain, layout, plan.coded)
        if plan.exact:
            self._scatter(chunks[:, plan.coded_bytes :].view(layout.dtype), plain, layout, plan.exact)
        return plain.view(-1)

    @staticmethod
    def _scatter(packed: torch.Tensor, plain: torch.Tensor, layout: Layout, indices: list[int]) -> None:
        """Puts ``packed``'s columns (regions ``indices`` back to back) where ``layout`` places them."""
        start = 0
        for index in indices:
            offset, size = layout.offsets[index], layout.sizes[index]
            plain[:, offset : offset + size].copy_(packed[:, start : start + size])
            start += size
