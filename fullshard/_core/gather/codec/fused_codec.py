"""The quantized all-gather's codec compiled into fused CPU loops (inductor).

[Note: Fused codec]
Eager CPU ops sweep memory once per op: the eager encode makes six passes over a
rank's shard and the decode three over the whole unit, more than the halved bytes
save on a loopback wire (issue 25's measurements in benchmarks/RESULTS.md). Here
the same arithmetic is traced by ``torch.compile`` once per unit layout, so the
encode becomes a block reduction and a quantizing loop that read the shard
directly (fp32 shards under a bf16 compute dtype too, with no cast copy-in: each
value is rounded to bf16 in the loop, so the codes are those of the cast shards,
bit for bit) and write the codes into this rank's row of the
all-gather output (a view per span: inductor writes a whole input in place, but
turns writes into slices of one input into a masked scatter over all of it, and
cannot write views of another dtype, so the few scales are copied after), and
the decode one loop per parameter that widens, scales and narrows each code
straight into the unsharded storage.

The coded values run back to back across parameters, so a block may straddle
two. Each parameter's range is split into *spans* (``spans``): runs of whole
blocks, which the compiled code views as ``(blocks, block_size)`` so a block's
scale is one broadcast value (flat indexing with a division would keep the loop
scalar), and the pieces of a block shared with a neighbour, whose absmax
combines its pieces. The results are bit for bit the eager codec's: the same
fp32 operations in the same order (``tests/test_quantize_fused.py``).

Compiling costs seconds (cached on disk by inductor across processes), so only
units of at least ``MIN_FUSED_VALUES`` coded values per rank are fused, on the
CPU only (on an accelerator the eager ops are already one kernel each at memory
bandwidth), never while dynamo traces the caller (the user's compiled model:
the eager codec is traced into it), and at most ``MAX_FUSED_LAYOUTS`` layouts
per process, each shared by the units that have it (dynamo's recompile limit).
Where compiling fails (no C++ compiler, a dynamo error) the eager codec takes
over for the rest of the process, with one warning.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch

from .quantize import CODE_MAX

logger = logging.getLogger("fullshard")

MIN_FUSED_VALUES = 1 << 16  # coded values per rank below which compiling does not pay
MAX_FUSED_LAYOUTS = 6  # per process; dynamo recompiles a function at most 8 times
_Result = TypeVar("_Result")


class Span(NamedTuple):
    param: int  # index among the coded parameters
    offset: int  # in the parameter's chunk
    start: int  # in the coded values, back to back
    length: int  # whole blocks, or part of one block

    def whole_blocks(self, block_size: int) -> bool:
        return self.start % block_size == 0 and self.length % block_size == 0


def spans(sizes: list[int], block_size: int) -> list[Span]:
    """Parameters of ``sizes`` values laid back to back, cut where blocks and parameters meet."""
    result, start = [], 0
    for param, size in enumerate(sizes):
        offset = 0
        while offset < size:
            at = start + offset
            if at % block_size == 0 and size - offset >= block_size:
                length = (size - offset) // block_size * block_size
            else:
                length = min(size - offset, block_size - at % block_size)
            result.append(Span(param, offset, at, length))
            offset += length
        start += size
    return result


class _Status:
    """Process-wide: whether compiling works here, and the codec of each layout compiled so far."""

    broken = False
    codecs: dict[tuple[object, ...], FusedCodec] = {}  # (code dtype, block size, offsets, sizes, value dtype): shared
    full = False  # MAX_FUSED_LAYOUTS reached (logged once)


def worth_fusing(device: torch.device, num_values: int) -> bool:
    """Whether ``num_values`` coded values per rank on ``device`` are worth a fused codec (this
    one's compiled loops, or the C kernel's: see [Note: Codec kernel] in codec_kernel.py)."""
    return device.type == "cpu" and num_values >= MIN_FUSED_VALUES and not torch.compiler.is_compiling()


def fusable(device: torch.device, num_values: int) -> bool:
    """Whether a unit of ``num_values`` coded values per rank on ``device`` gets the fused codec."""
    return worth_fusing(device, num_values) and not _Status.broken


class FusedCodec:
    """The compiled encode and decode of one unit layout (see [Note: Fused codec])."""

    def __init__(
        self,
        code_dtype: torch.dtype,
        block_size: int,
        offsets: list[int],
        sizes: list[int],
        value_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.code_dtype = code_dtype
        self.block_size = block_size
        self.value_dtype = value_dtype  # the compute dtype: wider sources are rounded to it first
        self.offsets = offsets  # 1D: each coded parameter's region in the all-gather input
        self.spans = spans(sizes, block_size)
        self._code_max = torch.tensor(CODE_MAX[code_dtype], dtype=torch.float32)  # 0D (see _encode_eager)
        self._encode: Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor]], torch.Tensor] | None = None
        self._decode: Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor]], None] | None = None

    @classmethod
    def shared(
        cls,
        code_dtype: torch.dtype,
        block_size: int,
        offsets: list[int],
        sizes: list[int],
        value_dtype: torch.dtype = torch.float32,
    ) -> FusedCodec | None:
        """The codec of this layout, one per process for every unit that has it (the blocks of a
        model share theirs); None past ``MAX_FUSED_LAYOUTS`` layouts (logged once)."""
        key = (code_dtype, block_size, tuple(offsets), tuple(sizes), value_dtype)
        codec = _Status.codecs.get(key)
        if codec is None:
            if len(_Status.codecs) >= MAX_FUSED_LAYOUTS:
                if not _Status.full:
                    _Status.full = True
                    logger.info(
                        "quantized all-gather: %d unit layouts fused, the others use the eager codec", MAX_FUSED_LAYOUTS
                    )
                return None
            codec = _Status.codecs[key] = cls(code_dtype, block_size, offsets, sizes, value_dtype)
        return codec

    def encode(self, source: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> bool:
        """Writes the codes of the coded regions of ``source`` into ``codes`` (``code_dtype``, the
        coded values back to back in whole blocks, the padding zero) and their scales into
        ``scales`` (fp32, one per block), both views of the all-gather input. False where
        compiling failed (nothing then written)."""
        if self._encode is None:
            # Rounding a wider source to the compute dtype stays in the loop (inductor elides it otherwise).
            self._encode = torch.compile(
                self._encode_eager, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True}
            )
        # One view per span: the compiled code writes each straight into its place, as it
        # cannot do for slices of one tensor (a scatter per slice) nor views of other dtypes.
        targets = [codes[span.start : span.start + span.length] for span in self.spans]
        done, block_scales = _guarded(self._encode, source, self._code_max, targets)
        if done and block_scales is not None:
            scales.copy_(block_scales)  # 1/block_size of the codes' elements
            codes[self.spans[-1].start + self.spans[-1].length :].zero_()  # the padding, as zero values code
        return done

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, outputs: list[torch.Tensor]) -> bool:
        """Writes ``outputs[i]`` (coded parameter i's unsharded storage, one chunk per row of
        ``codes``) from ``codes`` (``code_dtype``) and ``scales`` (fp32, a row each); False where
        compiling failed (``outputs`` then still to be written)."""
        if self._decode is None:
            self._decode = torch.compile(self._decode_eager, fullgraph=True, dynamic=False)
        done, _ = _guarded(self._decode, codes, scales, outputs)
        return done

    def _to_codes(self, scaled: torch.Tensor) -> torch.Tensor:
        if self.code_dtype == torch.int8:
            return scaled.round().to(torch.int8)
        code_max = CODE_MAX[self.code_dtype]
        return scaled.clamp(-code_max, code_max).to(self.code_dtype)  # float8_e4m3fn has no infinity

    def _encode_eager(self, source: torch.Tensor, code_max: torch.Tensor, targets: list[torch.Tensor]) -> torch.Tensor:
        """What ``torch.compile`` traces: ``BlockQuantizer.encode``'s arithmetic, span by span,
        the codes written into ``targets`` (one per span), the scales returned. ``code_max`` is
        a tensor so that no compiler turns the division into a multiplication by its reciprocal
        (inductor of torch 2.8 does for a constant: scales 1 ulp off)."""
        block_size = self.block_size
        values = [
            source[self.offsets[s.param] + s.offset : self.offsets[s.param] + s.offset + s.length]
            .to(self.value_dtype)
            .float()
            for s in self.spans
        ]
        scales: list[torch.Tensor] = []
        first = 0
        while first < len(self.spans):
            span = self.spans[first]
            if span.whole_blocks(block_size):
                last, blocks = first, [values[first].view(-1, block_size)]
            else:  # the spans sharing this block
                last = first
                while (
                    last + 1 < len(self.spans) and self.spans[last + 1].start // block_size == span.start // block_size
                ):
                    last += 1
                blocks = [values[i].view(1, -1) for i in range(first, last + 1)]
            absmax = _absmax(blocks[0])
            for more in blocks[1:]:
                absmax = torch.maximum(absmax, _absmax(more))
            scale = torch.where(absmax == 0, 1.0, absmax / code_max)  # a zero block decodes to zeros
            inverse = scale.reciprocal().unsqueeze(1)
            for target, block in zip(targets[first : last + 1], blocks):
                target.copy_(self._to_codes(block * inverse).view(-1))
            scales.append(scale)
            first = last + 1
        return torch.cat(scales)

    def _decode_eager(self, codes: torch.Tensor, scales: torch.Tensor, outputs: list[torch.Tensor]) -> None:
        """What ``torch.compile`` traces: ``BlockQuantizer.decode`` and the split-copy, span by span."""
        num_chunks, block_size = codes.size(0), self.block_size
        pieces: list[list[torch.Tensor]] = [[] for _ in outputs]
        for span in self.spans:
            first_block, span_codes = span.start // block_size, codes[:, span.start : span.start + span.length]
            if span.whole_blocks(block_size):
                num_blocks = span.length // block_size
                blocks = span_codes.reshape(num_chunks, num_blocks, block_size).float()
                values = (blocks * scales[:, first_block : first_block + num_blocks].unsqueeze(2)).flatten(1)
            else:
                values = span_codes.float() * scales[:, first_block : first_block + 1]
            pieces[span.param].append(values)
        for output, parts in zip(outputs, pieces):
            if parts:
                output.view(num_chunks, -1).copy_(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))


def _absmax(blocks: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude: the eager encode's ``max(amax, -amin)`` to the bit (``abs``
    is exact; a zero block gives a zero of either sign, which the scale maps to 1 alike), in
    one compiled accumulator instead of two (half the time)."""
    return blocks.abs().amax(dim=1)


def _guarded(compiled: Callable[..., _Result], *args: object) -> tuple[bool, _Result | None]:
    """``(True, compiled(*args))``, or ``(False, None)`` where compiling fails: then (once) a
    warning, and the eager codec for the rest of the process (it gives the same bits, or
    raises the same error if the inputs are at fault)."""
    try:
        return True, compiled(*args)
    except Exception as error:  # noqa: BLE001 (inductor and dynamo raise many kinds)
        _Status.broken = True
        reason = str(error).strip().split("\n")[0]
        warnings.warn(
            f"quantized all-gather: compiling the fused codec failed ({type(error).__name__}: {reason}); "
            "using the eager codec from now on (the same results, slower on the CPU)",
            stacklevel=3,
        )
        return False, None
