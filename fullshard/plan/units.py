"""The reference Transformer's units, their padded shards, and what each collective moves.

``fully_shard(block)`` for every block, then ``fully_shard(model)``: the root
unit holds the token and position embeddings, the final norm and (tied to the
token embedding, so counted once) the output weight. Each parameter is split on
dim 0 into chunks of ``ceil(rows / shard size)`` rows, padded; a unit's chunks
sit back to back in one shard buffer (see [Note: Unit buffers] in
``fullshard/_core/layout.py``). Under the FSDP1 wrapper's ``use_orig_params=False``
(``PlanConfig.flat_params``) a unit's shard is instead FSDP1's flat piece: its
parameters flattened and concatenated, cut into ``ceil(numel / shard size)``
elements per rank, padded once at the end (see [Note: Flat layout] there).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

from .._core.gather.codec import BlockQuantizer
from .._core.layout import flat_pieces
from ..models.transformer import ModelArgs
from .config import EngineSetup


@dataclass(frozen=True)
class Unit:
    """One unit: its parameters as (rows, elements per row), sharded on dim 0 over ``shard_size`` ranks
    (``flat``: as one flat parameter's pieces instead); ``exact[i]``: parameter i is gathered as it is
    under a quantized all-gather (norms, biases, embeddings)."""

    name: str
    shapes: tuple[tuple[int, int], ...]
    shard_size: int
    exact: tuple[bool, ...]
    flat: bool = False

    def _chunk_numel(self, index: int) -> int:
        rows, row = self.shapes[index]
        return -(-rows // self.shard_size) * row

    def coded_shard_numel(self) -> int:
        """This rank's values of the parameters a quantized all-gather codes (a flat unit's: the
        most any rank's piece holds)."""
        if self.flat:
            return max(coded for coded, _ in self._flat_split())
        return sum(self._chunk_numel(i) for i, keep in enumerate(self.exact) if not keep)

    def packed_chunk_bytes(self, code: BlockQuantizer, compute_bytes: int) -> int:
        """One rank's chunk of a quantized all-gather: codes and scales, then the exact values (a
        flat unit's: the longest rank's, which every rank sends; see [Note: Quantized flat chunks]
        in ``fullshard/_core/gather/codec/quantized_gather.py``)."""
        if self.flat:
            return max(_packed_bytes(code, coded, exact * compute_bytes) for coded, exact in self._flat_split())
        coded = self.coded_shard_numel()
        return _packed_bytes(code, coded, (self.shard_numel - coded) * compute_bytes)

    def _flat_split(self) -> tuple[tuple[int, int], ...]:
        return _flat_split(self.shapes, self.exact, self.shard_size)

    @functools.cached_property  # read at every event of a playback
    def shard_numel(self) -> int:
        """This rank's shard buffer: every parameter's padded chunk, or the flat piece."""
        if self.flat:
            return -(-self.numel // self.shard_size)
        return sum(-(-rows // self.shard_size) * row for rows, row in self.shapes)

    @property
    def gathered_numel(self) -> int:
        """The all-gather output, the unsharded parameters, the reduce-scatter input (padded)."""
        return self.shard_size * self.shard_numel

    @property
    def unsharded_numel(self) -> int:
        """The unsharded parameters' storage: padded to whole chunks, except a flat unit's (exact sizes)."""
        return self.numel if self.flat else self.gathered_numel

    @functools.cached_property
    def numel(self) -> int:
        """Unpadded: what autograd's gradients of the unsharded parameters hold."""
        return sum(rows * row for rows, row in self.shapes)

    @property
    def largest_param_shard_numel(self) -> int:
        """The largest tensor an optimizer steps: a parameter's chunk, or the whole flat piece."""
        if self.flat:
            return self.shard_numel
        return max((-(-rows // self.shard_size) * row for rows, row in self.shapes), default=0)


@functools.cache  # the blocks of a model share theirs; thousands of ranks take a moment
def _flat_split(
    shapes: tuple[tuple[int, int], ...], exact: tuple[bool, ...], shard_size: int
) -> tuple[tuple[int, int], ...]:
    """Each rank's flat piece as (coded, exact) values."""
    _, pieces = flat_pieces([rows * row for rows, row in shapes], shard_size)
    split = []
    for rank in range(shard_size):
        held = [(ranges[rank][1] - ranges[rank][0], keep) for ranges, keep in zip(pieces, exact)]
        split.append((sum(n for n, keep in held if not keep), sum(n for n, keep in held if keep)))
    return tuple(split)


def _packed_bytes(code: BlockQuantizer, coded: int, exact_bytes: int) -> int:
    return -(-((code.packed_numel(coded) if coded else 0) + exact_bytes) // 4) * 4  # chunks start 4-aligned


def model_units(args: ModelArgs, shard_size: int, flat: bool = False) -> list[Unit]:
    """The root unit, then one unit per block, with ``Transformer``'s parameter shapes (``flat``: laid
    out as the FSDP1 wrapper's flat parameters)."""
    dim, hidden = args.dim, 4 * args.dim
    root = [(args.vocab_size, dim), (args.max_seq_len, dim), (dim, 1), (dim, 1)]
    root_exact = [True] * 4  # embeddings and the final norm
    if not args.weight_tying:
        root.append((args.vocab_size, dim))
        root_exact.append(False)
    norm = [(dim, 1), (dim, 1)]
    block = norm + [(dim, dim)] * 4 + norm + [(hidden, dim), (hidden, 1), (dim, hidden), (dim, 1)]
    block_exact = tuple(row == 1 for _, row in block)  # norms and biases
    return [Unit("root", tuple(root), shard_size, tuple(root_exact), flat)] + [
        Unit(f"layers.{i}", tuple(block), shard_size, block_exact, flat) for i in range(args.n_layers)
    ]


def gather_codes(config: EngineSetup) -> BlockQuantizer | None:
    """The codes of a quantized all-gather, or None."""
    if config.all_gather_dtype is None:
        return None
    return BlockQuantizer(config.all_gather_dtype, config.all_gather_block_size)


def units_per_bucket(config: EngineSetup, unit: Unit) -> int:
    """How many consecutive blocks like ``unit`` one prefetched all-gather takes (see [Note: Gather
    buckets] in ``fullshard/_core/gather/all_gather.py``): 1 where they gather alone."""
    if config.shard_size == 1 or config.cpu_offload or config.all_gather_dtype is not None:
        return 1
    nbytes = unit.gathered_numel * config.compute_dtype.itemsize
    return max(1, config.all_gather_bucket_bytes // nbytes) if nbytes else 1


def comm_per_step(config: EngineSetup, units: list[Unit]) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes, calls) per step by collective, counted as ``comm.record_comms()`` counts them.

    An all-gather counts its output and a reduce-scatter its input (the padded
    unit), an all-reduce its tensor (the shard). Groups of one issue nothing.
    """
    nbytes: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    compute = config.compute_dtype.itemsize
    reduce = config.gradient_reduce_dtype.itemsize
    # A block is gathered again in backward when resharded after forward; the root never is (it
    # keeps its parameters for backward, which needs them first).
    gathers = 2 if config.reshard_after_forward else 1
    codes = gather_codes(config)
    if config.shard_size > 1:  # the root alone, then the blocks prefetched in buckets
        blocks = len(units) - 1
        buckets = -(-blocks // units_per_bucket(config, units[1])) if blocks else 0
        calls["all_gather"] += 1 + gathers * buckets
    for index, unit in enumerate(units):
        if config.shard_size > 1:
            chunk = unit.shard_numel * compute if codes is None else unit.packed_chunk_bytes(codes, compute)
            nbytes["all_gather"] += (gathers if index else 1) * config.shard_size * chunk
            nbytes["reduce_scatter"] += unit.gathered_numel * reduce
            calls["reduce_scatter"] += 1
        if config.replicate_size > 1:
            nbytes["all_reduce"] += unit.shard_numel * reduce
            calls["all_reduce"] += 1
    return dict(nbytes), dict(calls)
