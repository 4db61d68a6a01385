"""Peak memory of one training step, replayed allocation by allocation.

[Note: Plan model]
``StepReplay`` walks one steady-state step of one rank (forward, loss,
backward, ``optimizer.step()``, ``zero_grad()``) and records every allocation
and free that really happens, in order, on a ``Tape``; the peak is the largest
live total, and what was alive then is the breakdown. It follows:
- the engine (``fullshard/_core``): the padded shard buffers; an all-gather's
  output (and a staged input when it casts or comes from host memory) alive
  from issue to the copy-out into the unsharded parameters; at most one unit
  prefetched, as the engine does by default (see [Note: Prefetch] in
  ``fullshard/_core/step/schedule.py``): in forward the next unit of the previous
  step's order, issued once the current unit's gather is done; in backward
  (``BACKWARD_PRE``) the unit before the current one, issued once its own is done;
  small units several at a time, as one bucket (``PlanConfig.all_gather_bucket_bytes``,
  see [Note: Gather buckets] in ``fullshard/_core/gather/all_gather.py``): one output for all of
  them, alive until the last has copied out (a flat unit's copy-out makes a
  contiguous copy of its columns first);
  autograd's gradients of a unit's unsharded parameters until its
  post-backward, which reshards, finishes older reductions, then copies the
  gradients (casting to the reduce dtype on the way) into one reduce-scatter
  input (the padded unit) that lives until the next unit's post-backward
  finishes that collective (the engine holds it until then, whatever the
  backend keeps: see [Note: Reduction pipeline]). With a shard group of one
  and no cast or offload the unsharded parameters are the shards.
- the model (``fullshard/models/transformer.py``): what autograd saves in each
  block and in the head, and the order in which backward creates and frees
  gradients, op by op as the CPU kernels do (the attention is the fused
  ``scaled_dot_product_attention``, which keeps no attention matrix).
- the optimizer: AdamW. torch's default on accelerators is the foreach kernel,
  whose square root makes one temporary the size of all states; on CPU it runs
  one parameter at a time (two temporaries of that parameter's size).

Under CPU offload the shards, gradients and optimizer states leave an
accelerator's memory; on a CPU device host memory is the device's, so they
stay in the replay (offloading there moves nothing).

The engine's side is ``EngineReplay``; ``StepReplay`` adds the reference
Transformer's ops, and ``fullshard.plan.playback.TracedReplay`` any model's, from
a step traced on fake tensors (see [Note: Traced step]).

The step is measured against the real engine (the profiler's allocator
events), through both front ends (``fully_shard`` and the FSDP1 wrapper), with
and without offload, at world sizes 1, 2 and 4 over gloo and on the demo's
model in ``tests/test_plan.py`` and at 8, 64 and 1024 over torch's fake
process group (HSDP too) in ``tests/test_fake_pg.py``, within 5% (at
1024 the padded unit buffers are most of the peak, so a unit more or less in
flight shows): in fp32 it matches to within a few hundred bytes; in bf16 it is
2.7% low, the temporaries of the CPU's bf16 matmuls in backward (oneDNN), where
that step peaks. Explicit prefetch lists, ``BACKWARD_POST`` and the wrapper's
``forward_prefetch=False`` move the peak by up to one unit. Not modelled:
allocator caching and fragmentation (the CUDA caching allocator rounds and
keeps blocks), the collective libraries' own buffers (NCCL, gloo), kernel
workspaces (cuBLAS, oneDNN), the CUDA context.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from .._core.gather.codec import MIN_FUSED_VALUES, BlockQuantizer
from .config import EngineSetup, PlanConfig
from .units import Unit, gather_codes, units_per_bucket

# What is alive, by category (the keys of Plan.peak_breakdown).
PARAMS, GRADS, OPTIM = "sharded params", "sharded grads", "optimizer states"
UNSHARDED, GATHER = "unsharded params", "all-gather buffers"
UNSHARDED_GRADS, REDUCE = "unsharded grads", "reduce buffers"
# Activations live at the peak: what forward saved and backward has not yet freed, plus the
# gradients of activations backward is computing (Plan.activations counts the saved ones alone).
ACTIVATIONS, OPTIM_TEMP = "activations and their grads", "optimizer temporaries"


class Tape:
    """Live bytes by category; remembers the largest total and what made it up."""

    def __init__(self) -> None:
        self.live: Counter[str] = Counter()
        self.phase = ""
        self.peak, self.peak_phase = 0, ""
        self.at_peak: dict[str, int] = {}

    def alloc(self, category: str, nbytes: int) -> None:
        self.live[category] += nbytes
        total = sum(self.live.values())
        if total > self.peak:
            self.peak, self.peak_phase, self.at_peak = total, self.phase, dict(self.live)

    def free(self, category: str, nbytes: int) -> None:
        self.live[category] -= nbytes


@dataclass
class Reduction:
    """A unit's gradients between post-backward and acceptance into ``.grad``."""

    rs_input: int  # bytes of the reduce-scatter input, freed once that collective is done
    output: int  # bytes of the reduced shard
    direct: bool  # the output becomes ``.grad`` as is (else: a cast or host copy, then freed)
    unit: str
    stages: list[str]  # collectives still to issue
    current: str | None = None  # the collective in flight


class EngineReplay:
    """The engine's side of one steady-state step of one rank: shards, gathers, reductions and the
    optimizer, onto a ``Tape``. A subclass plays the model (``forward``, ``backward``). See [Note: Plan model]."""

    def __init__(self, config: EngineSetup, units: list[Unit]) -> None:
        self.config, self.tape = config, Tape()
        self.root, self.blocks = units[0], units[1:]
        self.c = config.compute_dtype.itemsize
        self.orig = config.dtype.itemsize
        self.red = config.gradient_reduce_dtype.itemsize
        self.cast = config.compute_dtype != config.dtype
        # A shard group of one without cast or offload: the unsharded parameters are the shards.
        self.alias = config.shard_size == 1 and not self.cast and not config.cpu_offload
        # Where the shards, gradients and optimizer states live in this replay's memory: offloaded
        # from an accelerator they leave it; on a CPU device host memory is the device's own.
        self.states_on_device = not config.cpu_offload or config.device == "cpu"
        self.in_flight: dict[str, int] = {}  # unit -> bytes of its all-gather buffers
        # Blocks one prefetched all-gather takes, and each bucket's output bytes and units still
        # to copy out (see [Note: Gather buckets] in fullshard/_core/gather/all_gather.py).
        self.per_bucket = units_per_bucket(config, self.blocks[0]) if self.blocks else 1
        self.buckets: dict[str, tuple[int, set[str]]] = {}
        self.codes = gather_codes(config)  # a quantized all-gather's, or None
        self.unsharded: set[str] = set()
        self.reductions: list[Reduction] = []
        self.activations = 0

    def forward(self) -> None:
        raise NotImplementedError

    def backward(self) -> None:
        raise NotImplementedError

    def on_collective(self, op: str, names: tuple[str, ...], nbytes: int, unit: Unit | None = None) -> None:
        """A collective is issued for ``names`` (``unit``: the one unit it gathers alone). A step-time
        model listens here and at the hooks below; memory does not."""

    def on_wait(self, name: str) -> None:
        """The compute of ``name`` needs its gather done."""

    def on_copy_out(self, unit: Unit) -> None:
        """``unit``'s gathered parameters are copied (or decoded) into its unsharded ones."""

    def on_copy_in(self, unit: Unit) -> None:
        """``unit``'s gradients are copied into its reduction."""

    def run(self) -> None:
        t, units = self.tape, [self.root, *self.blocks]
        if self.states_on_device:
            t.alloc(PARAMS, sum(u.shard_numel for u in units) * self.orig)
            t.alloc(OPTIM, sum(u.shard_numel for u in units) * self.orig * self.config.optimizer_states)
        t.phase = "forward"
        self.forward()
        self.activations = t.live[ACTIVATIONS]
        t.phase = "backward"
        self.backward()
        t.phase = "optimizer step"
        self.optimizer_step(units)

    # -- the engine ------------------------------------------------------------------
    def gather(self, unit: Unit) -> None:
        """``unshard()``: issue the all-gather; its buffers live until the copy-out."""
        if unit.name in self.unsharded or unit.name in self.in_flight:
            return
        if self.alias:
            self.unsharded.add(unit.name)
            return
        # The all-gather input when it is not the shard buffer itself, unless a plain gather over
        # several ranks copies it into its own row of the output, or a codec over several ranks reads
        # the shards where they are (AllGather.input).
        staged = 0
        from_host = self.config.cpu_offload and self.config.device == "cuda"
        if self.config.shard_size == 1 or (self.codes is not None and from_host):
            if self.cast:
                staged = unit.shard_numel * self.c
            elif from_host:  # the shards, copied from the host
                staged = unit.shard_numel * self.orig
        self.tape.alloc(GATHER, staged)
        output = 0
        if self.config.shard_size > 1:
            chunk = unit.shard_numel * self.c
            if self.codes is not None:  # this rank's codes are written into its row of the output
                chunk = unit.packed_chunk_bytes(self.codes, self.c)
            output = self.config.shard_size * chunk
        self.in_flight[unit.name] = staged + output
        self.tape.alloc(GATHER, output)
        if self.config.shard_size > 1:
            self.on_collective("all_gather", (unit.name,), output, unit)
        if self.codes is not None and self.config.shard_size > 1:
            self._transient(self._encode_temporaries(unit, self.codes))

    def prefetch(self, blocks: list[Unit], start: int, step: int) -> None:
        """The schedule's implicit prefetch of ``blocks[start]``: with the blocks after it
        (``step``) that need a gather, up to ``per_bucket`` of them in one all-gather."""
        bucket: list[Unit] = []
        index = start
        while 0 <= index < len(blocks) and len(bucket) < self.per_bucket:
            unit = blocks[index]
            index += step
            if unit.name not in self.unsharded and unit.name not in self.in_flight:
                bucket.append(unit)
            elif not bucket:
                return  # the next unit needs no gather: nothing is prefetched
        if len(bucket) < 2:
            for unit in bucket:
                self.gather(unit)
            return
        nbytes = sum(self.config.shard_size * u.shard_numel for u in bucket) * self.c
        self.tape.alloc(GATHER, nbytes)  # one output; each unit's copy-in is its own columns of it
        names = {u.name for u in bucket}
        self.on_collective("all_gather", tuple(u.name for u in bucket), nbytes)
        for unit in bucket:
            self.in_flight[unit.name] = 0
            self.buckets[unit.name] = (nbytes, names)

    def wait(self, unit: Unit) -> None:
        """``wait_for_unshard()``: copy-out into the unsharded parameters, then drop the buffers
        (a bucket's once its last unit copied out)."""
        nbytes = self.in_flight.pop(unit.name, None)
        if nbytes is None:
            return
        self.on_wait(unit.name)
        self.on_copy_out(unit)
        self.tape.alloc(UNSHARDED, unit.unsharded_numel * self.c)
        if unit.name in self.buckets:
            nbytes, waiting = self.buckets.pop(unit.name)
            waiting.discard(unit.name)
            nbytes = 0 if waiting else nbytes
            if unit.flat:  # its columns of the bucket's output, copied contiguous for the split
                self._transient(unit.gathered_numel * self.c)
        if self.codes is not None and self.config.shard_size > 1:
            self._transient(self._decode_temporaries(unit, self.codes))
        self.tape.free(GATHER, nbytes)
        self.unsharded.add(unit.name)

    def _transient(self, nbytes: int) -> None:
        self.tape.alloc(GATHER, nbytes)
        self.tape.free(GATHER, nbytes)

    def _fused_codec(self, unit: Unit) -> bool:
        """Whether ``unit`` gets the compiled CPU codec (see [Note: Fused codec])."""
        return self.config.device == "cpu" and unit.coded_shard_numel() >= MIN_FUSED_VALUES

    def _encode_temporaries(self, unit: Unit, codes: BlockQuantizer) -> int:
        """Quantizing one chunk into the all-gather output (``QuantizedGather.encode``): the fused
        codec holds the blocks' maxima and their scales, the eager one the coded values side by
        side in fp32, whole blocks (scaled in place), and under a cast the values rounded to the
        compute dtype on the way."""
        num_blocks = codes.num_blocks(unit.coded_shard_numel())
        if self._fused_codec(unit):
            return 2 * num_blocks * 4
        rounded = unit.coded_shard_numel() * self.c if self.cast else 0
        return num_blocks * codes.block_size * 4 + rounded

    def _decode_temporaries(self, unit: Unit, codes: BlockQuantizer) -> int:
        """Decoding every chunk (``QuantizedGather.decode``): nothing for the fused codec (it
        writes the parameters directly); for the eager one the fp32 values of the coded
        parameters (cast into the parameters by the split-copy; a flat unit's one rank's chunk at
        a time), and on the CPU a chunk's int32 indices into float8's table of values."""
        if self._fused_codec(unit):
            return 0
        world = 1 if unit.flat else self.config.shard_size
        padded = codes.num_blocks(unit.coded_shard_numel()) * codes.block_size
        table_lookup = codes.code_dtype != torch.int8 and self.config.device == "cpu"
        return world * padded * 4 + (padded * 4 if table_lookup else 0)

    def reshard(self, unit: Unit) -> None:
        if unit.name in self.unsharded:
            self.unsharded.remove(unit.name)
            if not self.alias:
                self.tape.free(UNSHARDED, unit.unsharded_numel * self.c)

    def pre_backward(self, unit: Unit, prefetch: int) -> None:
        """Gathers ``unit``, then prefetches ``blocks[prefetch]`` and the blocks before it (-1: none)."""
        self.gather(unit)
        self.wait(unit)
        if prefetch >= 0:
            self.prefetch(self.blocks, prefetch, -1)

    def post_backward(self, unit: Unit, grad_bytes: int | None = None) -> None:
        """Reshard, advance older reductions, copy the gradients into this unit's reduction, freeing
        autograd's (``grad_bytes``; default: every parameter's, in the compute dtype)."""
        t, config = self.tape, self.config
        self.reshard(unit)
        self.reductions = [r for r in self.reductions if not self._advance(r)]
        direct = self.red == self.orig and self.states_on_device
        reduction = Reduction(
            rs_input=unit.gathered_numel * self.red if config.shard_size > 1 else 0,
            output=unit.shard_numel * self.red,
            direct=direct,
            unit=unit.name,
            stages=["reduce_scatter"] * (config.shard_size > 1) + ["all_reduce"] * (config.replicate_size > 1),
        )
        t.alloc(GRADS if direct else REDUCE, reduction.output)
        t.alloc(REDUCE, reduction.rs_input)  # the copy-in casts and pads on the way: no temporaries
        if reduction.stages:
            self.on_copy_in(unit)
        t.free(UNSHARDED_GRADS, unit.numel * self.c if grad_bytes is None else grad_bytes)
        if not self._advance(reduction):
            self.reductions.append(reduction)

    def _advance(self, reduction: Reduction) -> bool:
        """Finish the collective in flight, start the next; True once accepted into ``.grad``."""
        if reduction.current == "reduce_scatter":
            self.tape.free(REDUCE, reduction.rs_input)
        if reduction.stages:
            reduction.current = reduction.stages.pop(0)
            nbytes = reduction.rs_input if reduction.current == "reduce_scatter" else reduction.output
            self.on_collective(reduction.current, (reduction.unit,), nbytes)
            return False
        if not reduction.direct:
            if self.states_on_device:
                self.tape.alloc(GRADS, reduction.output // self.red * self.orig)
            self.tape.free(REDUCE, reduction.output)
        return True

    # -- the optimizer -----------------------------------------------------------------
    def optimizer_step(self, units: list[Unit]) -> None:
        t = self.tape
        if self.states_on_device:  # offloaded from an accelerator, the optimizer steps in host memory
            if self.config.device == "cpu":
                temporary = 2 * max(u.largest_param_shard_numel for u in units) * self.orig
            else:
                temporary = sum(u.shard_numel for u in units) * self.orig
            t.alloc(OPTIM_TEMP, temporary)
            t.free(OPTIM_TEMP, temporary)
        t.free(GRADS, t.live[GRADS])  # zero_grad(set_to_none=True)


class StepReplay(EngineReplay):
    """The reference ``Transformer``'s step, op by op as the CPU kernels run it. See [Note: Plan model]."""

    def __init__(self, config: PlanConfig, units: list[Unit]) -> None:
        super().__init__(config, units)
        self.model_config = config
        args = config.model
        tokens = config.batch_size * config.tokens_per_sequence
        self.td = tokens * args.dim * self.c  # one (batch, seq, dim) activation
        self.tf = 4 * self.td  # one MLP hidden activation
        self.stat = tokens * self.c  # a LayerNorm mean or rstd
        self.lse = tokens * args.n_heads * 4  # the attention's log-sum-exp (fp32)
        self.pos = config.tokens_per_sequence * args.dim * self.c
        self.logits = tokens * args.vocab_size * self.c
        self.logits32 = tokens * args.vocab_size * 4  # the loss works in fp32
        self.embedding_grad = args.vocab_size * args.dim * self.c

    # -- the model -------------------------------------------------------------------
    def forward(self) -> None:
        t, root, blocks = self.tape, self.root, self.blocks
        self.gather(root)
        self.wait(root)
        if blocks:
            self.prefetch(blocks, 0, 1)  # implicit forward prefetch: the order of the previous step
        t.alloc(ACTIVATIONS, self.td + self.pos + self.td)  # token and position embeddings, their sum
        t.free(ACTIVATIONS, self.td + self.pos)
        for i, block in enumerate(blocks):
            self.wait(block)
            if i + 1 < len(blocks):
                self.prefetch(blocks, i + 1, 1)
            self._block_forward()
            if self.config.reshard_after_forward:
                self.reshard(block)
        t.alloc(ACTIVATIONS, self.td + 2 * self.stat)  # final norm
        t.alloc(ACTIVATIONS, self.logits)
        # The root keeps its parameters after forward under every strategy: backward needs them
        # first (see RootContext.adopt), so it is gathered once a step.
        # Transformer.loss: fp32 logits, log_softmax (saved); the logits die with the call.
        if self.c != 4:
            t.alloc(ACTIVATIONS, self.logits32)
        t.alloc(ACTIVATIONS, self.logits32)
        t.free(ACTIVATIONS, self.logits + (self.logits32 if self.c != 4 else 0))

    def _block_forward(self) -> None:
        t, td = self.tape, self.td
        t.alloc(ACTIVATIONS, td + 2 * self.stat)  # attention_norm output (saved by wq, wk, wv)
        t.alloc(ACTIVATIONS, 3 * td)  # q, k, v (saved by attention)
        t.alloc(ACTIVATIONS, td + self.lse)  # attention output (saved by attention and wo)
        t.alloc(ACTIVATIONS, 2 * td)  # wo output, residual sum h (saved by ffn_norm)
        t.free(ACTIVATIONS, td)
        t.alloc(ACTIVATIONS, td + 2 * self.stat)  # ffn_norm output (saved by w1)
        t.alloc(ACTIVATIONS, 2 * self.tf)  # w1 output (saved by GELU), GELU output (saved by w2)
        t.alloc(ACTIVATIONS, 2 * td)  # w2 output, block output
        t.free(ACTIVATIONS, td)

    def backward(self) -> None:
        t, td, args = self.tape, self.td, self.model_config.model
        t.alloc(ACTIVATIONS, 2 * self.logits32)  # gradients of nll_loss and log_softmax
        t.free(ACTIVATIONS, 2 * self.logits32)  # nll's gradient, the saved log_softmax
        if self.c != 4:
            t.alloc(ACTIVATIONS, self.logits)  # cast back to the compute dtype
            t.free(ACTIVATIONS, self.logits32)
        self.pre_backward(self.root, len(self.blocks) - 1)
        # Output projection: its weight gradient waits for the tied embedding's until the end.
        t.alloc(UNSHARDED_GRADS, self.embedding_grad)
        t.alloc(ACTIVATIONS, td)
        t.free(ACTIVATIONS, self.logits + td)
        t.alloc(ACTIVATIONS, td)  # final norm
        t.alloc(UNSHARDED_GRADS, 2 * args.dim * self.c)
        t.free(ACTIVATIONS, 2 * td + 2 * self.stat)
        for i in reversed(range(len(self.blocks))):
            self.pre_backward(self.blocks[i], i - 1)
            self._block_backward()
            self.post_backward(self.blocks[i])
        t.alloc(ACTIVATIONS, self.pos)  # position embedding: the batch sum, then its weight gradient
        t.alloc(UNSHARDED_GRADS, args.max_seq_len * args.dim * self.c)
        t.free(ACTIVATIONS, self.pos)
        t.alloc(UNSHARDED_GRADS, self.embedding_grad)  # token embedding
        t.free(ACTIVATIONS, td)
        if args.weight_tying:  # summed out of place with the output projection's
            t.alloc(UNSHARDED_GRADS, self.embedding_grad)
            t.free(UNSHARDED_GRADS, 2 * self.embedding_grad)
        self.post_backward(self.root)
        for reduction in self.reductions:  # the end-of-backward callback
            while not self._advance(reduction):
                pass
        self.reductions = []

    def _block_backward(self) -> None:
        """Op by op: each makes its gradients, then frees what it saved and the gradient it consumed."""
        t, td, tf, dim, c = self.tape, self.td, self.tf, self.model_config.model.dim, self.c
        square = dim * dim * c  # one (dim, dim) weight's gradient
        # w2: grad of the GELU output, weight and bias grads; the GELU output is freed.
        t.alloc(ACTIVATIONS, tf)
        t.alloc(UNSHARDED_GRADS, 4 * square + dim * c)
        t.free(ACTIVATIONS, tf)
        # GELU: grad of the w1 output; the grad above and the w1 output are freed.
        t.alloc(ACTIVATIONS, tf)
        t.free(ACTIVATIONS, 2 * tf)
        # w1: grad of the ffn_norm output, weight and bias grads; the GELU grad and norm output are freed.
        t.alloc(ACTIVATIONS, td)
        t.alloc(UNSHARDED_GRADS, 4 * square + 4 * dim * c)
        t.free(ACTIVATIONS, tf + td)
        # ffn_norm: grad of h, summed in place into the residual's; h, its stats and two grads are freed.
        t.alloc(ACTIVATIONS, td)
        t.alloc(UNSHARDED_GRADS, 2 * dim * c)
        t.free(ACTIVATIONS, 3 * td + 2 * self.stat)
        # wo: its weight grad and the grad of the attention output.
        t.alloc(UNSHARDED_GRADS, square)
        t.alloc(ACTIVATIONS, td)
        # attention: grads of q, k, v; q, k, v, the output, its grad and the log-sum-exp are freed.
        t.alloc(ACTIVATIONS, 3 * td)
        t.free(ACTIVATIONS, 5 * td + self.lse)
        # wv, wk, wq: a weight grad and an input grad each (freeing the grad of v, k, q); the first two
        # input grads are summed out of place, the third joins the sum in place.
        for projection in ("v", "k", "q"):
            t.alloc(UNSHARDED_GRADS, square)
            t.alloc(ACTIVATIONS, td)
            t.free(ACTIVATIONS, td)
            if projection == "k":
                t.alloc(ACTIVATIONS, td)
                t.free(ACTIVATIONS, 2 * td)
        t.free(ACTIVATIONS, 2 * td)  # the attention_norm output, the third input grad
        # attention_norm: grad of the block input, summed in place into the residual's; the norm's
        # input grad, the block input, its stats and one grad are freed.
        t.alloc(ACTIVATIONS, td)
        t.alloc(UNSHARDED_GRADS, 2 * dim * c)
        t.free(ACTIVATIONS, 3 * td + 2 * self.stat)
