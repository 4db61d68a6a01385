"""Quantized all-gather on the FSDP1 wrapper's flat parameters (``use_orig_params=False``, issue 25):
each rank's piece of FSDP1's flat shard is coded as its own chunk (see [Note: Quantized flat chunks]
in fullshard/_core/gather/codec/quantized_gather.py). Checked against a reference built here from the unwrapped
model's values, not from the engine's layout: the gathered weights are every rank's dequantized
piece bit for bit, the bytes on the wire are the longest rank's chunk times the ranks, gradients
are exact with respect to the weights used, and training matches ``use_orig_params=True``.
"""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from test_quantize_fused import fresh_fused_codecs  # noqa: F401 (a fixture)
from test_quantized_all_gather import assert_computes_with_decoded_weights
from torch.distributed.device_mesh import init_device_mesh

from fullshard import (
    AllGatherQuantization,
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
    set_all_gather_quantization,
)
from fullshard._core import comm
from fullshard._core.gather.codec import fused_codec
from fullshard._core.layout import Layout, flat_pieces
from fullshard._core.gather.codec.quantize import BlockQuantizer
from fullshard._core.gather.codec.quantized_gather import QuantizedGather
from fullshard.api import keeps_exact_by_default
from fullshard.models import ModelArgs, Transformer
from fullshard.testing import distributed, train_steps
from fullshard.wrap import ModuleWrapPolicy

BLOCK = 8  # values per scale: several blocks per piece, some cut by a piece's end
NOTHING_EXACT = AllGatherQuantization(keep_exact=lambda module, name, param: False)


class Block(nn.Module):
    """A unit of 138 elements whose exact (norm, biases) and coded parameters alternate, so that the
    ranks' pieces mix both differently; ``tiny`` (coded) has fewer elements than 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.tiny = nn.Parameter(torch.randn(1, 3))
        self.norm = nn.LayerNorm(6)
        self.lin = nn.Linear(6, 9)
        self.proj = nn.Linear(9, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.lin(self.norm(x))) * self.tiny.sum())


class Net(nn.Module):
    """Root unit: an exact embedding and a coded head (143 elements, padded at 2 and 4 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(11, (2, 5), generator=torch.Generator().manual_seed(seed))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _wrap(module: nn.Module, use_orig_params: bool = False, **kwargs) -> FullyShardedDataParallel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the wrapper's notes on CPU training
        return FullyShardedDataParallel(
            module,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=torch.device("cpu"),
            use_orig_params=use_orig_params,
            **kwargs,
        )


def _units(net: Net) -> list[list[tuple[nn.Module, str]]]:
    """Each unit's parameters as (module, name), in the flat parameter's order (FSDP1's:
    ``named_parameters`` of the wrapped module, wrapped children left out)."""

    def owned(module: nn.Module, skip: str | None) -> list[tuple[nn.Module, str]]:
        found = []
        for fqn, _ in module.named_parameters():
            if skip is None or not fqn.startswith(skip):
                path, _, name = fqn.rpartition(".")
                found.append((module.get_submodule(path), name))
        return found

    return [owned(net, "blocks.")] + [owned(block, None) for block in net.blocks]


def _expected_gathered(values: list[torch.Tensor], exact: list[bool], world: int, code, dtype) -> list[torch.Tensor]:
    """The unit's parameters as each rank's piece of FSDP1's flat shard, cast to ``dtype``, its
    coded elements (back to back, in blocks) encoded and decoded, come back from the all-gather."""
    numels = [v.numel() for v in values]
    total = sum(numels)
    chunk = -(-total // world)
    flat = torch.zeros(chunk * world, dtype=dtype)
    flat[:total] = torch.cat([v.reshape(-1) for v in values])
    coded = torch.zeros(chunk * world, dtype=torch.bool)
    coded[:total] = torch.cat([torch.full((n,), not keep) for n, keep in zip(numels, exact)])
    quantizer = BlockQuantizer(code, BLOCK)
    for piece, mask in zip(flat.view(world, chunk), coded.view(world, chunk)):
        count = int(mask.sum())
        if count:
            padded = torch.zeros(quantizer.num_blocks(count) * BLOCK)
            padded[:count] = piece[mask].float()
            packed = torch.empty(1, quantizer.packed_numel(count), dtype=torch.uint8)
            quantizer.encode(padded, packed[0])
            piece[mask] = quantizer.decode(packed, count)[0].to(dtype)
    return [part.view_as(v) for part, v in zip(flat[:total].split(numels), values)]


def _watch(units: list[list[tuple[nn.Module, str]]]) -> dict[tuple[int, str], torch.Tensor]:
    """The value of every parameter each module's forward computes with, first forward only."""
    seen: dict[tuple[int, str], torch.Tensor] = {}
    for unit in units:
        for module, name in unit:

            def hook(mod: nn.Module, args: tuple, name: str = name) -> None:
                seen.setdefault((id(mod), name), getattr(mod, name).detach().clone())

            module.register_forward_pre_hook(hook)
    return seen


def check_gathered_weights_are_the_dequantized_pieces(code: torch.dtype, bf16: bool, hybrid: bool) -> None:
    world = 2 if hybrid else dist.get_world_size()  # the shard group's ranks
    dtype = torch.bfloat16 if bf16 else torch.float32
    net = Net()
    units = _units(net)
    initial = [[getattr(m, n).detach().clone() for m, n in unit] for unit in units]
    exact = [[keeps_exact_by_default(m, n, getattr(m, n)) for m, n in unit] for unit in units]
    assert [any(e) and not all(e) for e in exact] == [True] * 3  # every unit mixes both kinds
    seen = _watch(units)
    kwargs = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)} if bf16 else {}
    if hybrid:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        kwargs.update(device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    model = _wrap(net, **kwargs)
    set_all_gather_quantization(model, AllGatherQuantization(dtype=code, block_size=BLOCK))
    with comm.record_comms() as records:
        _loss(model, _tokens(dist.get_rank())).backward()
    gathers = [r for r in records if r.op == "all_gather"]
    assert gathers and {(r.dtype, r.group_size) for r in gathers} == {(torch.uint8, world)}
    for unit, values, keep in zip(units, initial, exact):
        expected = _expected_gathered(values, keep, world, code, dtype)
        for (module, name), want, value, kept in zip(unit, expected, values, keep):
            got = seen[(id(module), name)]
            assert got.dtype == dtype and torch.equal(got, want), f"{name} of {type(module).__name__}"
            assert kept == torch.equal(got, value.to(dtype)), f"{name}: coded unless kept exact"


@pytest.mark.parametrize(
    "world, code, bf16, hybrid",
    [
        (2, torch.int8, False, False),
        (2, torch.float8_e4m3fn, True, False),
        (4, torch.int8, True, False),
        (4, torch.float8_e4m3fn, False, False),
        (4, torch.int8, False, True),
    ],
    ids=["2-int8", "2-float8-bf16", "4-int8-bf16", "4-float8", "4-hybrid-int8"],
)
def test_gathered_weights_are_the_dequantized_pieces(world, code, bf16, hybrid):
    distributed(world_size=world)(check_gathered_weights_are_the_dequantized_pieces)(code, bf16, hybrid)


def _chunk_bytes(net: Net, unit: int, world: int, dtype_bytes: int) -> int:
    """The longest rank's chunk on the wire: codes and scales of its coded elements, then its exact ones."""
    params = _units(net)[unit]
    kinds = [keeps_exact_by_default(m, n, getattr(m, n)) for m, n in params]
    marks = [keep for (m, n), keep in zip(params, kinds) for _ in range(getattr(m, n).numel())]
    chunk = -(-len(marks) // world)
    quantizer = BlockQuantizer(torch.int8, BLOCK)
    longest = 0
    for rank in range(world):
        piece = marks[rank * chunk : (rank + 1) * chunk]
        coded, exact = piece.count(False), piece.count(True)
        nbytes = (quantizer.packed_numel(coded) if coded else 0) + exact * dtype_bytes
        longest = max(longest, -(-nbytes // 4) * 4)
    return longest


def check_bytes_on_the_wire() -> None:
    world = dist.get_world_size()
    model = _wrap(Net())
    set_all_gather_quantization(model, AllGatherQuantization(block_size=BLOCK))
    with comm.record_comms() as forward:
        loss = _loss(model, _tokens(0))
    with comm.record_comms() as backward:
        loss.backward()
    root, block = (world * _chunk_bytes(Net(), unit, world, 4) for unit in (0, 1))
    # The wrapper keeps the root gathered after forward (as FSDP1); the blocks gather again in backward.
    assert [(r.nbytes, r.dtype) for r in forward if r.op == "all_gather"] == [(root, torch.uint8)] + [
        (block, torch.uint8)
    ] * 2
    assert [(r.nbytes, r.dtype) for r in backward if r.op == "all_gather"] == [(block, torch.uint8)] * 2


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_on_the_wire(world):
    distributed(world_size=world)(check_bytes_on_the_wire)()


ARGS = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=64, n_heads=4)


def _transformer(quantization: AllGatherQuantization | None, use_orig_params: bool = False, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    policy = ModuleWrapPolicy({type(Transformer(ARGS).layers[0])})
    model = FullyShardedDataParallel(
        Transformer(ARGS), auto_wrap_policy=policy, use_orig_params=use_orig_params, **kwargs
    )
    set_all_gather_quantization(model, quantization)
    return model


def _gathered_bytes(model: nn.Module) -> int:
    with comm.record_comms() as records:
        _loss(model, _tokens(0).remainder(ARGS.vocab_size)).backward()
    return sum(r.nbytes for r in records if r.op == "all_gather")


def _train(model: nn.Module, steps: int = 4) -> list[float]:
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = [
        torch.randint(ARGS.vocab_size, (2, 8), generator=torch.Generator().manual_seed(10 * s + dist.get_rank()))
        for s in range(steps)
    ]
    return train_steps(model, optim, batches, _loss)


@distributed(world_size=2)
def test_half_the_bytes_of_bf16_and_trains_like_use_orig_params():
    """Every weight coded: at most 0.55x a bf16 gather's bytes. With the default rule, training stays
    within 1% of the exact gather and of ``use_orig_params=True``'s quantized run; not bit for bit,
    as the rows layout puts other elements into each block (other scales), and off turns it off."""
    bf16 = MixedPrecision(param_dtype=torch.bfloat16)
    plain = _gathered_bytes(_transformer(None, mixed_precision=bf16))
    assert _gathered_bytes(_transformer(NOTHING_EXACT, mixed_precision=bf16)) <= 0.55 * plain
    exact = torch.tensor(_train(_transformer(None)))
    flat = torch.tensor(_train(_transformer(AllGatherQuantization())))
    rows = torch.tensor(_train(_transformer(AllGatherQuantization(), use_orig_params=True)))
    assert not torch.equal(flat, exact)
    torch.testing.assert_close(flat, exact, rtol=1e-2, atol=0)
    torch.testing.assert_close(flat, rows, rtol=1e-2, atol=0)
    assert_computes_with_decoded_weights(
        _transformer(AllGatherQuantization()), _tokens(0).remainder(ARGS.vocab_size), built_second=True
    )
    model = _transformer(AllGatherQuantization())
    set_all_gather_quantization(model, None)
    assert torch.equal(torch.tensor(_train(model)), exact)


class Tower(nn.Module):
    """Units of one bias-free weight whose rows split evenly: its flat pieces are its row chunks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def check_equal_to_use_orig_params_where_the_layouts_agree() -> None:
    results = []
    for use_orig_params in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = FullyShardedDataParallel(
                Tower(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=use_orig_params
            )
        set_all_gather_quantization(model, AllGatherQuantization(block_size=BLOCK))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(dist.get_rank())
        batches = [torch.randn(4, 16, generator=gen) for _ in range(3)]
        losses = train_steps(model, optim, batches, lambda m, x: m(x).pow(2).mean())
        with FullyShardedDataParallel.summon_full_params(model):
            params = [layer.weight.detach().clone() for layer in model.module.layers]
        results.append((losses, params))
    (flat_losses, flat_params), (row_losses, row_params) = results
    assert flat_losses == row_losses
    assert all(torch.equal(a, b) for a, b in zip(flat_params, row_params))


@pytest.mark.parametrize("world", [2, 4])
def test_equal_to_use_orig_params_where_the_layouts_agree(world):
    distributed(world_size=world)(check_equal_to_use_orig_params_where_the_layouts_agree)()


@distributed(world_size=2)
def test_gradients_exact_with_respect_to_the_quantized_weights():
    """One process computing with the weights the ranks used gets the reduced gradients."""
    net = Net()
    reference = copy.deepcopy(net)
    units = _units(net)
    seen = _watch(units)
    model = _wrap(net)
    set_all_gather_quantization(model, AllGatherQuantization(block_size=BLOCK))
    batches = [_tokens(rank) for rank in range(dist.get_world_size())]
    _loss(model, batches[dist.get_rank()]).backward()
    ref_units = _units(reference)
    with torch.no_grad():
        for unit, ref_unit in zip(units, ref_units):
            for (module, name), (ref_module, ref_name) in zip(unit, ref_unit):
                getattr(ref_module, ref_name).copy_(seen[(id(module), name)])
    for batch in batches:
        (_loss(reference, batch) / len(batches)).backward()
    with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        for unit, ref_unit in zip(units, ref_units):
            for (module, name), (ref_module, ref_name) in zip(unit, ref_unit):
                torch.testing.assert_close(getattr(module, name).grad, getattr(ref_module, ref_name).grad)


@distributed(world_size=2)
def test_cpu_offload_sends_and_computes_the_same():
    def run(**kwargs) -> tuple[list[float], list[torch.Tensor]]:
        model = _wrap(Net(), **kwargs)
        set_all_gather_quantization(model, AllGatherQuantization(block_size=BLOCK))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = train_steps(model, optim, [_tokens(10 * s + dist.get_rank()) for s in range(3)], _loss)
        return losses, [p.detach().clone() for p in model.parameters()]

    losses, params = run()
    offloaded_losses, offloaded_params = run(cpu_offload=CPUOffload(offload_params=True))
    assert offloaded_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(offloaded_params, params))


@pytest.mark.usefixtures("fresh_fused_codecs")
def test_fused_codec_gives_the_eager_codecs_bits_on_flat_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled codec (large CPU units) under each rank's own layout: the same wire bytes and
    decoded parameters as the eager one, every element written (see [Note: Fused codec])."""
    sizes = [5, 300, 7, 5, 129, 64, 1000, 3]
    exact = [True, False, True, False, False, False, False, True]
    world, dtype = 2, torch.bfloat16
    chunk, pieces = flat_pieces(sizes, world)
    layouts = [
        Layout.build([stop - start for start, stop in (p[r] for p in pieces)], [dtype] * 8, flat_chunk=chunk)
        for r in range(world)
    ]
    generator = torch.Generator().manual_seed(0)
    sources = [(torch.randn(chunk, generator=generator) * 10.0 ** (r - 1)).to(dtype) for r in range(world)]

    def run(codec: QuantizedGather) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each rank's chunk on the wire (the bytes that carry data) and the decoded parameters."""
        packed = [codec.encode(source, layout) for layout, source in zip(layouts, sources)]
        plans = [codec._plan(layout) for layout in layouts]
        wire = [row[: p.coded_bytes + p.exact_numel * dtype.itemsize] for row, p in zip(packed, plans)]
        outputs = [torch.full((size,), float("nan"), dtype=dtype) for size in sizes]
        codec.decode(torch.cat(packed), world, layouts[0], outputs)
        return wire, outputs

    quantizer = BlockQuantizer(torch.int8, 32)
    monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 1 << 40)
    eager_wire, eager_params = run(QuantizedGather(quantizer, exact, pieces))
    monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 0)
    monkeypatch.setattr(fused_codec._Status, "codecs", {})
    fused = QuantizedGather(quantizer, exact, pieces)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "quantized all-gather")  # a failed compile warns and falls back: not here
        fused_wire, fused_params = run(fused)
    assert all(fused._fused[layout] is not None for layout in layouts)  # every rank's layout ran fused
    assert all(torch.equal(a, b) for a, b in zip(eager_wire, fused_wire))
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(eager_params, fused_params))
    assert not any(p.isnan().any() for p in fused_params)


@distributed(world_size=2)
def test_a_shard_group_of_one_gathers_nothing_and_computes_exact():
    """NO_SHARD: each rank holds whole parameters, so nothing is gathered or coded (bf16 compute too)."""

    def run(quantization: AllGatherQuantization | None) -> list[float]:
        model = _wrap(
            Net(), sharding_strategy=ShardingStrategy.NO_SHARD, mixed_precision=MixedPrecision(torch.bfloat16)
        )
        set_all_gather_quantization(model, quantization)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with comm.record_comms() as records:
            losses = train_steps(model, optim, [_tokens(10 * s + dist.get_rank()) for s in range(2)], _loss)
        assert not [r for r in records if r.op == "all_gather"]
        return losses

    assert run(AllGatherQuantization(block_size=BLOCK)) == run(None)
