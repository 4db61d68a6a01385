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
units on the CPU run the same arithmetic as a C kernel, or compiled into fused
loops where it cannot be built (see [Note: Codec kernel] in codec_kernel.py and
[Note: Fused codec] in fused_codec.py).

[Note: Quantized flat chunks]
Under FSDP1's flat layout (see [Note: Flat layout] in layout.py) rank ``r``'s
chunk holds a different run of elements of the same parameters: a parameter's
piece may be empty, start mid-row, or split a coded parameter from an exact one
anywhere in the chunk. Each rank's chunk is therefore encoded as above under its
own layout, the pieces it holds (``rank_layouts``, computed once per gather
layout from the pieces every rank holds): its coded pieces back to back in
blocks, their scales, its exact pieces. Every rank sends the longest of these
chunks (the others end in unused bytes), so the all-gather stays one collective
of equal chunks. Decoding reads each rank's chunk under that rank's layout and
writes its pieces straight into the unsharded parameters: the C kernel in one
call for all ranks (a table of every rank's pieces, built once per layout; see
[Note: Codec kernel] in codec_kernel.py), the compiled or eager codec one decode
per rank (the ranks' chunks differ in layout: no shared ``(W, -1)`` view).
Blocks group other elements than under per-parameter rows, so the codes differ
from a ``use_orig_params=True`` run's (other scales); their error bounds do not.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

import torch

from ... import comm
from ...comm import PLAIN_GATHER_WIRE, GatherWire, GroupInfo, SplitViews
from ...layout import Layout
from . import codec_kernel
from .fused_codec import FusedCodec, fusable, spans, worth_fusing
from .quantize import BlockQuantizer

_SCALE_ALIGN = 4  # bytes of an fp32 scale
_SEGMENT = 1 << 16  # the longest piece one thread of the C decode takes at a time


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

    def __init__(
        self, quantizer: BlockQuantizer, exact: list[bool], pieces: list[list[tuple[int, int]]] | None = None
    ) -> None:
        self.quantizer = quantizer
        self.exact = exact
        # Under a flat layout: per parameter, each shard rank's (start, stop) of its flattened elements.
        self.pieces = pieces
        self._plans: dict[Layout, _Plan] = {}  # the gather layout, and the post-forward one (or every rank's)
        self._fused: dict[Layout, FusedCodec | None] = {}
        self._fused_regions: dict[Layout, list[tuple[int, int, int]]] = {}  # see _cut_regions
        self._rank_layouts: dict[Layout, tuple[Layout, ...]] = {}
        self._kernel_encodes: dict[Layout, torch.Tensor] = {}  # 2D: see codec_kernel.encode_segments
        self._kernel_decodes: dict[tuple[Layout, int], torch.Tensor] = {}  # 2D: see _decode_segments
        self._most_coded: dict[tuple[Layout, int], int] = {}  # (gather layout, chunks): see _decode_kernel

    def _plan(self, layout: Layout) -> _Plan:
        plan = self._plans.get(layout)
        if plan is None:
            if layout.dtype == torch.uint8:
                raise AssertionError("a quantized all-gather needs a unit of one dtype (checked when it is set)")
            # Only regions with values: a flat layout's rank may hold no piece of a parameter.
            coded = [i for i, keep in enumerate(self.exact) if not keep and layout.sizes[i]]
            exact = [i for i, keep in enumerate(self.exact) if keep and layout.sizes[i]]
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
            regions = self._fused_regions[layout] = self._cut_regions(layout, plan)
            offsets, sizes = [layout.offsets[i] + start for i, start, _ in regions], [n for _, _, n in regions]
            quantizer = self.quantizer
            self._fused[layout] = FusedCodec.shared(
                quantizer.code_dtype, quantizer.block_size, offsets, sizes, layout.dtype
            )
        return self._fused[layout]

    def _cut_regions(self, layout: Layout, plan: _Plan) -> list[tuple[int, int, int]]:
        """The coded regions the fused codec takes as its "parameters": (parameter, start in its region,
        length). Whole regions, except under a flat layout, whose ranks' pieces start anywhere in a
        block: cut at the fused codec's spans, so that each is written by one vectorised loop (the
        codec joins a parameter's several spans with a ``cat``, which compiles to an indexed loop
        over the whole piece, 2 to 3 times slower); the same arithmetic, the same bits."""
        if not layout.flat:
            return [(i, 0, layout.sizes[i]) for i in plan.coded]
        cuts = spans([layout.sizes[i] for i in plan.coded], self.quantizer.block_size)
        return [(plan.coded[cut.param], cut.offset, cut.length) for cut in cuts]

    def rank_layouts(self, layout: Layout) -> tuple[Layout, ...]:
        """Each shard rank's pieces under the flat ``layout`` (this rank's is ``layout`` itself);
        see [Note: Quantized flat chunks]."""
        layouts = self._rank_layouts.get(layout)
        if layouts is None:
            if self.pieces is None or not layout.flat:
                raise AssertionError("a flat gather layout's codec needs every rank's pieces")
            num_ranks = len(self.pieces[0])
            layouts = tuple(
                Layout.build(
                    [ranges[rank][1] - ranges[rank][0] for ranges in self.pieces],
                    [layout.dtype] * len(self.pieces),
                    flat_chunk=layout.total,
                )
                for rank in range(num_ranks)
            )
            self._rank_layouts[layout] = layouts
        return layouts

    def packed_numel(self, layout: Layout) -> int:
        """Bytes each rank sends for one chunk of ``layout`` (the longest rank's under a flat one)."""
        if layout.flat:
            return max(self._plan(rank_layout).packed_numel for rank_layout in self.rank_layouts(layout))
        return self._plan(layout).packed_numel

    @torch.no_grad()
    def encode(self, source: torch.Tensor, layout: Layout, packed: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's chunk on the wire, from ``source`` (1D, one chunk of ``layout``, or the shards
        in their own dtype at the same offsets: cast on the way, the codes those of the cast values),
        written into ``packed`` (uint8, ``packed_numel``: this rank's row of the all-gather output, so
        the collective has nothing to copy) or a new tensor."""
        plan = self._plan(layout)
        if packed is None:
            packed = torch.empty(self.packed_numel(layout), dtype=torch.uint8, device=source.device)
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

    def _kernel(self, num_values: int, device: torch.device, dtypes: list[torch.dtype]) -> ctypes.CDLL | None:
        """The C codec (see [Note: Codec kernel]) where it takes ``num_values`` coded values per rank
        converted between ``dtypes`` (the compute dtype, then the source's or the outputs')."""
        if not worth_fusing(device, num_values) or not codec_kernel.supports(self.quantizer.code_dtype, *dtypes):
            return None
        return codec_kernel.library()

    def _encode_fused(self, source: torch.Tensor, layout: Layout, plan: _Plan, packed: torch.Tensor) -> bool:
        """The coded parameters of ``encode`` by the C kernel or the compiled codec, straight into
        ``packed``; False where there is neither."""
        codes = packed[: plan.coded_padded].view(self.quantizer.code_dtype)
        scales = packed[plan.coded_padded : plan.coded_bytes].view(torch.float32)
        lib = self._kernel(plan.coded_numel, source.device, [layout.dtype, source.dtype])
        if lib is not None and source.is_contiguous():
            segments = self._kernel_encodes.get(layout)
            if segments is None:
                offsets, sizes = [layout.offsets[i] for i in plan.coded], [layout.sizes[i] for i in plan.coded]
                segments = self._kernel_encodes[layout] = codec_kernel.encode_segments(offsets, sizes)
            codec_kernel.encode(lib, source, segments, codes, scales, self.quantizer.block_size, layout.dtype)
            return True
        fused = self._fused_codec(layout, plan, source.device)
        if fused is None:
            return False
        return fused.encode(source, codes, scales)

    @torch.no_grad()
    def decode(self, gathered: torch.Tensor, num_chunks: int, layout: Layout, outputs: list[torch.Tensor]) -> None:
        """Fills ``outputs`` (each parameter's padded unsharded storage, ``num_chunks`` chunks of its
        region) from the gathered chunks: the same scatter as ``Layout.copy_out``, from codes.
        Under a flat layout ``outputs[i]`` is parameter i, whose pieces every rank's chunk
        fills (see [Note: Quantized flat chunks])."""
        chunks = gathered.view(num_chunks, -1)
        if self._decode_kernel(chunks, layout, outputs):
            return
        if not layout.flat:
            self._decode_chunks(chunks, layout, outputs)
            return
        if self.pieces is None or len(self.pieces[0]) != num_chunks:
            raise AssertionError(f"a flat gather of {num_chunks} chunks needs each rank's pieces")
        for rank, rank_layout in enumerate(self.rank_layouts(layout)):
            pieces = [output[ranges[rank][0] : ranges[rank][1]] for output, ranges in zip(outputs, self.pieces)]
            self._decode_chunks(chunks[rank : rank + 1], rank_layout, pieces)

    def _decode_kernel(self, chunks: torch.Tensor, layout: Layout, outputs: list[torch.Tensor]) -> bool:
        """``decode`` by the C kernel, every rank's chunk, coded and exact pieces, in one call;
        False where it does not take this gather (the outputs then still to be written)."""
        key = (layout, chunks.size(0))
        most_coded = self._most_coded.get(key)
        if most_coded is None:  # the most coded values in one chunk: whether the kernel takes them
            chunk_layouts = self._chunk_layouts(layout, chunks.size(0))
            most_coded = self._most_coded[key] = max(self._plan(each).coded_numel for each in chunk_layouts)
        if not most_coded or not all(o.dtype == layout.dtype and o.is_contiguous() for o in outputs):
            return False
        lib = self._kernel(most_coded, chunks.device, [layout.dtype, layout.dtype])
        if lib is None:
            return False
        segments = self._kernel_decodes.get(key)
        if segments is None:
            segments = self._kernel_decodes[key] = self._decode_segments(layout, chunks.size(0))
        codec_kernel.decode(lib, chunks, segments, outputs, self.quantizer.code_dtype, self.quantizer.block_size)
        return True

    def _chunk_layouts(self, layout: Layout, num_chunks: int) -> tuple[Layout, ...]:
        """The layout of each gathered chunk: every rank's own under a flat layout, else ``layout``."""
        return self.rank_layouts(layout) if layout.flat else (layout,) * num_chunks

    def _decode_segments(self, layout: Layout, num_chunks: int) -> torch.Tensor:
        """The C decode's table (see ``codec_kernel.decode``): each chunk's coded then exact pieces,
        cut at most ``_SEGMENT`` long so that threads share a large parameter."""
        rows = []
        for chunk, chunk_layout in enumerate(self._chunk_layouts(layout, num_chunks)):
            plan = self._plan(chunk_layout)
            position, exact_at = 0, plan.coded_bytes
            for index in plan.coded + plan.exact:
                size = chunk_layout.sizes[index]
                if layout.flat:  # rank `chunk`'s piece of parameter `index`
                    offset = self.pieces[index][chunk][0] if self.pieces is not None else 0
                else:  # row `chunk` of the (num_chunks, size) region
                    offset = chunk * size
                if self.exact[index]:
                    scales, at = codec_kernel.EXACT, exact_at
                    exact_at += size * layout.dtype.itemsize
                else:
                    scales, at = plan.coded_padded, position
                    position += size
                for cut in range(0, size, _SEGMENT):
                    length = min(_SEGMENT, size - cut)
                    step = cut * (layout.dtype.itemsize if self.exact[index] else 1)
                    rows.append((chunk, at + step, scales, index, offset + cut, length))
        return torch.tensor(rows, dtype=torch.int64).reshape(-1, 6)

    def _decode_chunks(self, chunks: torch.Tensor, layout: Layout, outputs: list[torch.Tensor]) -> None:
        """``decode`` of chunks that share ``layout`` (one row each)."""
        num_chunks, plan = chunks.size(0), self._plan(layout)
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
        if layout.flat:  # one row: each output is a region of its parameter's piece (see _cut_regions)
            outputs = [outputs[i][start : start + n] for i, start, n in self._fused_regions[layout]]
        else:
            outputs = [outputs[i] for i in plan.coded]
        return fused.decode(codes, scales, outputs)

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


class QuantizedWire:
    """A unit's all-gather as block-wise codes on ``carrier``'s collective (see [Note: Wires] in
    comm.py): the quantized codec as a gather wire."""

    joins_buckets = False
    as_is = False
    in_place = False  # the codes, not the chunk, go into the output's row (see ``encode``)

    def __init__(self, codec: QuantizedGather, carrier: GatherWire = PLAIN_GATHER_WIRE) -> None:
        self.codec = codec
        self._carrier = carrier.carrier

    @property
    def user(self) -> Any:
        return self._carrier.user

    @property
    def carrier(self) -> GatherWire:
        return self._carrier

    def carried_by(self, carrier: GatherWire) -> GatherWire:
        return QuantizedWire(self.codec, carrier)

    def wire_numel(self, layout: Layout, numel: int) -> int:
        return self.codec.packed_numel(layout)

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def allocate(self, group_size: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._carrier.allocate(group_size, numel, dtype, device)

    def encode(
        self, source: torch.Tensor, layout: Layout, output: torch.Tensor | None, group: GroupInfo
    ) -> torch.Tensor:
        """The codes, written straight into this rank's row of ``output`` when the carrier takes its
        input in place (the collective's copy of its own input is then skipped, as the same memory)."""
        row = output.view(group.size, -1)[group.rank] if output is not None and self._carrier.in_place else None
        return self.codec.encode(source, layout, row)

    def collective(
        self, output: torch.Tensor, input: torch.Tensor, group: GroupInfo, async_op: bool
    ) -> comm.Waitable | None:
        return self._carrier.collective(output, input, group, async_op)

    def decode(
        self, output: torch.Tensor, num_chunks: int, layout: Layout, padded: list[torch.Tensor], views: SplitViews
    ) -> None:
        self.codec.decode(output, num_chunks, layout, padded)
