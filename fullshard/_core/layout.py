"""Where each parameter's shard sits inside a unit's flat buffers.

[Note: Unit buffers]
Every parameter is split on dim 0 into ``W`` chunks of ``ceil(rows / W)`` rows
(the last chunks padded, possibly all padding). A unit keeps this rank's chunks
of all its parameters back to back in ONE flat buffer:

    shard buffer (this rank):     [ p0 chunk | p1 chunk | ... ]
    all-gather output (W ranks):  [ rank 0: p0 p1 ... | rank 1: p0 p1 ... | ... ]

So the shard buffer is the all-gather input as is (no copy-in), and the output,
viewed as ``(W, -1)``, holds parameter i in the column block of its chunk. The
copy-out is ONE ``torch.split_with_sizes_copy`` of that ``(W, -1)`` view into
the padded unsharded parameters, each viewed as ``(W, chunk)`` (one fused
kernel on CUDA, as FSDP2's). It falls back to a copy per parameter where the
blocks do not tile the buffer: alignment gaps of a mixed-dtype layout, or a
parameter sharded on another dim (below). Zero copies, parameters that are
views of the gathered buffer, would need a parameter's W chunks adjacent in
it, the opposite of what the all-gather produces: only a shard group of one
has that (the unsharded parameters then alias the shard buffer).
Under mixed precision the cast into the all-gather input is one ``copy_`` of
the whole shard buffer when the storage and gather layouts line up (one
dtype each, so the same offsets in elements; ``lines_up``), written straight
into this rank's row of the all-gather output (``AllGather.input``).
Gradients take the reverse path: ``torch._chunk_cat`` lays the unsharded
gradients out as ``(W, -1)`` blocks, and the reduce-scatter output has the same
layout as the shard buffer.

A parameter sharded on another dim ``d`` (``shard_placement_fn``) splits the
same way along ``d``: its chunk holds this rank's slices along ``d``, contiguous
in the parameter's own element order (so the local shard is a plain view), with
the padding at the chunk's end. Copy-out then writes each rank's block into
its slices of the unsharded parameter (one strided copy per rank), and the
gradient copy-in reads them back; the unsharded parameter stays contiguous.

[Note: Flat layout]
The FSDP1 wrapper's ``use_orig_params=False`` units lay out as FSDP1's flat
parameter instead: the unit's parameters flattened and concatenated (no
padding between them), padded at the end to a multiple of ``W``; rank ``r``
holds the contiguous elements ``[r * c, (r + 1) * c)``, ``c = ceil(total / W)``.
A parameter's piece on a rank is then a 1D range of its elements, possibly
empty, possibly starting mid-row (``flat_pieces``); the shard buffer is this
rank's pieces back to back plus the end padding (``Layout.flat``), and the
all-gather output IS the concatenation: copy-out is one split of its front.
A quantized all-gather codes each rank's pieces under that rank's own layout
(see [Note: Quantized flat chunks] in quantized_gather.py).

A ``Layout`` records offsets in elements of its dtype. Parameters of different
dtypes in one unit share a ``uint8`` layout counted in bytes, each offset
aligned for its dtype. A parameter with a gather extension (a tensor
subclass, see [Note: Gather extensions]) has an empty region in the shard
buffer; the extension's all-gather inputs follow the plain regions in a bytes
layout built at each unshard.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    dtype: torch.dtype  # the flat buffer's dtype (uint8 when dtypes are mixed)
    offsets: tuple[int, ...]  # per parameter, in elements of `dtype`
    sizes: tuple[int, ...]  # per parameter, in elements of `dtype`
    total: int
    # FSDP1's flat layout (see [Note: Flat layout]): the regions are this rank's pieces, ``total`` the
    # chunk with its end padding, and W such chunks make the concatenation of the parameters.
    flat: bool = False

    @staticmethod
    def build(
        numels: list[int], dtypes: list[torch.dtype], in_bytes: bool = False, flat_chunk: int | None = None
    ) -> Layout:
        """Packs chunks of ``numels[i]`` elements of ``dtypes[i]``; in bytes when
        the dtypes of non-empty chunks differ or ``in_bytes`` asks for it (an
        all-gather that carries extension outputs, see extension.py).
        ``flat_chunk``: the pieces of [Note: Flat layout] (one dtype), padded to that many elements."""
        kinds = {dtype for numel, dtype in zip(numels, dtypes) if numel} or set(dtypes[:1])
        if flat_chunk is not None and (len(kinds) > 1 or in_bytes):
            raise AssertionError(f"a flat layout holds one dtype, not {kinds}")
        if len(kinds) <= 1 and not in_bytes:
            dtype = kinds.pop() if kinds else torch.float32
            offsets, total = [], 0
            for numel in numels:
                offsets.append(total)
                total += numel
            if flat_chunk is not None:
                return Layout(dtype, tuple(offsets), tuple(numels), flat_chunk, flat=True)
            return Layout(dtype, tuple(offsets), tuple(numels), total)
        offsets, sizes, total = [], [], 0
        for numel, dtype in zip(numels, dtypes):
            align = dtype.itemsize
            total = (total + align - 1) // align * align
            offsets.append(total)
            sizes.append(numel * dtype.itemsize)
            total += numel * dtype.itemsize
        return Layout(torch.uint8, tuple(offsets), tuple(sizes), total)

    def scaled(self, factor: int) -> Layout:
        """The layout of ``factor`` consecutive chunks of every parameter."""
        if self.flat:
            raise AssertionError("a flat layout's pieces differ by rank: it does not scale")
        return Layout(
            self.dtype,
            tuple(o * factor for o in self.offsets),
            tuple(s * factor for s in self.sizes),
            self.total * factor,
        )

    def region(self, flat: torch.Tensor, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Parameter ``index``'s region of ``flat`` (1D, this layout), as ``dtype``."""
        start, size = self.offsets[index], self.sizes[index]
        region = flat[start : start + size]
        return region if region.dtype == dtype else region.view(dtype)

    def copy_out(
        self,
        gathered: torch.Tensor,
        num_chunks: int,
        outputs: list[torch.Tensor],
        split_views: list[list[torch.Tensor] | None] | None = None,
    ) -> None:
        """Scatters an all-gather output into per-parameter padded flat tensors.

        ``gathered`` is ``num_chunks`` blocks of this layout; ``outputs[i]`` is
        parameter i's padded unsharded data (``num_chunks * sizes[i]`` units).
        ``split_views[i]``, for a parameter sharded on a dim other than 0, holds
        each rank's slices inside ``outputs[i]`` (see ``ShardParam.split_views``).
        """
        if self.flat:  # the gathered chunks are the concatenation (see [Note: Flat layout])
            numels = [out.numel() for out in outputs]
            torch.split_with_sizes_copy(gathered.reshape(-1)[: sum(numels)], numels, out=outputs)
            return
        blocks = gathered.view(num_chunks, -1)
        if split_views is None and self.tiles:
            torch.split_with_sizes_copy(blocks, list(self.sizes), dim=1, out=self.chunk_views(outputs, num_chunks))
            return
        for index, (start, size, out) in enumerate(zip(self.offsets, self.sizes, outputs)):
            block = blocks[:, start : start + size]
            views = split_views[index] if split_views is not None else None
            if views is None:
                dst = out if out.dtype == self.dtype else out.view(self.dtype)
                dst.view(num_chunks, size).copy_(block)
                continue
            block = block if block.dtype == out.dtype else block.view(out.dtype)
            for rank, view in enumerate(views):
                view.copy_(block[rank, : view.numel()].view(view.shape))

    def chunk_views(self, outputs: list[torch.Tensor], num_chunks: int) -> list[torch.Tensor]:
        """``outputs`` (each parameter's padded flat data) viewed as ``(num_chunks, size)``
        blocks of this layout's dtype: where ``copy_out`` writes when the regions tile."""
        return [
            (out if out.dtype == self.dtype else out.view(self.dtype)).view(num_chunks, size)
            for out, size in zip(outputs, self.sizes)
        ]

    @functools.cached_property
    def tiles(self) -> bool:
        """Whether the regions cover the buffer back to back (no alignment gaps)."""
        if self.flat:  # its blocks are not per-parameter columns
            return False
        ends = itertools.accumulate(self.sizes, initial=0)
        return all(offset == end for offset, end in zip(self.offsets, ends)) and sum(self.sizes) == self.total

    def lines_up(self, other: Layout) -> bool:
        """Whether a buffer in ``other`` casts into one in this layout with one
        ``copy_`` (both one dtype, the same regions)."""
        return torch.uint8 not in (self.dtype, other.dtype) and (self.offsets, self.sizes, self.total) == (
            other.offsets,
            other.sizes,
            other.total,
        )


def flat_pieces(numels: list[int], world: int) -> tuple[int, list[list[tuple[int, int]]]]:
    """FSDP1's flat split of parameters of ``numels`` elements over ``world`` ranks
    (see [Note: Flat layout]): the chunk ``c`` and, per parameter, each rank's
    ``(start, stop)`` range of its flattened elements (empty where it holds none)."""
    total = sum(numels)
    chunk = -(-total // world)
    pieces, offset = [], 0
    for numel in numels:
        ranges = []
        for rank in range(world):
            start = min(max(rank * chunk - offset, 0), numel)
            ranges.append((start, min(max((rank + 1) * chunk - offset, start), numel)))
        pieces.append(ranges)
        offset += numel
    return chunk, pieces


@dataclass(frozen=True)
class ShardLayout:
    """How a unit's parameters are cut into each rank's shard, chosen before the per-parameter
    objects exist (see [Note: Unit buffers] and [Note: Flat layout]): every parameter's rows on its
    shard dim (``ROW_SHARDS``), or FSDP1's flat parameter (``flat_shards``). The shard buffer, the
    reduction, the codec and full-parameter I/O ask it, where they tested a mode before; what a
    step asks are plain fields, fixed when the unit is made."""

    # Whether the unit's shards are FSDP1's flat parameter: one gradient over every parameter, reduced
    # whole in every step (no partial result), ``flat_chunk`` elements on every rank.
    flat: bool = False
    flat_chunk: int = 0
    # Per parameter, each shard rank's (start, stop) of its flattened elements: a shard that may start
    # mid-row (None: whole rows; a flat layout over one rank holds the parameters whole, back to back).
    pieces: tuple[tuple[tuple[int, int], ...], ...] | None = None

    def buffer_layout(self, numels: list[int], dtypes: list[torch.dtype]) -> Layout:
        """Where each parameter's shard (``numels[i]`` elements of ``dtypes[i]``) sits in a buffer."""
        return Layout.build(numels, dtypes, flat_chunk=self.flat_chunk if self.flat else None)

    def pieces_of(self, index: int) -> tuple[tuple[int, int], ...] | None:
        """Parameter ``index``'s piece on every shard rank, or None when it shards whole rows."""
        return None if self.pieces is None else self.pieces[index]


ROW_SHARDS = ShardLayout()


def flat_shards(numels: list[int], world: int) -> ShardLayout:
    """FSDP1's flat parameter over ``world`` ranks for parameters of ``numels`` elements (see
    [Note: Flat layout]); over one rank the parameters stay whole (their rows)."""
    if world == 1:
        return ShardLayout(flat=True, flat_chunk=sum(numels))
    chunk, pieces = flat_pieces(numels, world)
    return ShardLayout(flat=True, flat_chunk=chunk, pieces=tuple(tuple(ranges) for ranges in pieces))
