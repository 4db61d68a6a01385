"""The fused (compiled) codec of the quantized all-gather gives the eager codec's bits,
and steps aside where it cannot run. See [Note: Fused codec] in fullshard/_core/gather/codec/fused_codec.py.
"""

import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from fullshard import AllGatherQuantization, MixedPrecisionPolicy, fully_shard, set_all_gather_quantization
from fullshard._core.gather.codec import codec_kernel, fused_codec
from fullshard._core.gather.codec.fused_codec import Span, spans
from fullshard._core.layout import Layout
from fullshard._core.gather.codec.quantize import BlockQuantizer
from fullshard._core.gather.codec.quantized_gather import QuantizedGather
from fullshard.models import ModelArgs, Transformer
from fullshard.testing import distributed, train_steps


@pytest.fixture
def fresh_fused_codecs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An empty registry of compiled layouts, with dynamo's compile counts emptied alongside: the
    registry's ``MAX_FUSED_LAYOUTS`` keeps a process under dynamo's recompile limit only while the
    two count the same compiles, which a test that empties the registry alone breaks (suites
    compiling many layouts in one process then hit the limit). The C kernel, which would take
    the compiled codec's units, is turned off: these tests are about the compiled codec
    (``tests/test_codec_kernel.py`` checks the kernel)."""
    monkeypatch.setattr(fused_codec._Status, "codecs", {})
    monkeypatch.setattr(codec_kernel._State, "disabled", True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()  # the registry the monkeypatch restores recompiles from zero


BLOCK = 32
# Uneven chunks: blocks straddle parameters, one parameter (5) sits inside a block shared
# by three, exact parameters lie between coded ones, the last block is partial.
SIZES = [5, 300, 7, 5, 129, 64, 1000, 3]
EXACT = [True, False, True, False, False, False, False, True]
NUM_CHUNKS = 3


def test_spans_cut_where_blocks_and_parameters_meet() -> None:
    assert spans([300, 5, 129], 32) == [
        Span(0, 0, 0, 288),  # whole blocks
        Span(0, 288, 288, 12),  # the block 288..320, shared by three parameters
        Span(1, 0, 300, 5),
        Span(2, 0, 305, 15),
        Span(2, 15, 320, 96),
        Span(2, 111, 416, 18),  # the last block, partial
    ]
    assert spans([64, 0, 32], 32) == [Span(0, 0, 0, 64), Span(2, 0, 64, 32)]


def _sources(param_dtype: torch.dtype, layout: Layout) -> list[torch.Tensor]:
    """Each rank's all-gather input: magnitudes that differ by parameter, and an all-zero block."""
    generator = torch.Generator().manual_seed(0)
    sources = []
    for _ in range(NUM_CHUNKS):
        source = torch.randn(layout.total, generator=generator)
        for index, (offset, size) in enumerate(zip(layout.offsets, layout.sizes)):
            source[offset : offset + size] *= 10.0 ** (index - 4)
        source[layout.offsets[6] + 14 : layout.offsets[6] + 14 + BLOCK] = 0  # coded values 512..544: one block
        sources.append(source.to(param_dtype))
    return sources


def _run(codec: QuantizedGather, layout: Layout, sources: list[torch.Tensor]) -> tuple[list, list]:
    """Each rank's chunk on the wire (the bytes that carry data) and the decoded parameters."""
    plan = codec._plan(layout)
    used = plan.coded_bytes + plan.exact_numel * layout.dtype.itemsize
    packed = [codec.encode(source, layout) for source in sources]
    outputs = [torch.full((size * NUM_CHUNKS,), float("nan"), dtype=layout.dtype) for size in layout.sizes]
    codec.decode(torch.cat(packed), NUM_CHUNKS, layout, outputs)
    return [chunk[:used] for chunk in packed], outputs


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("code_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "float8"])
@pytest.mark.usefixtures("fresh_fused_codecs")
def test_fused_codec_gives_the_eager_codecs_bits(
    code_dtype: torch.dtype, param_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = Layout.build(SIZES, [param_dtype] * len(SIZES))
    sources = _sources(param_dtype, layout)
    monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 1 << 40)
    eager_wire, eager_params = _run(QuantizedGather(BlockQuantizer(code_dtype, BLOCK), EXACT), layout, sources)
    monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 0)
    monkeypatch.setattr(fused_codec._Status, "codecs", {})
    fused = QuantizedGather(BlockQuantizer(code_dtype, BLOCK), EXACT)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "quantized all-gather")  # a failed compile warns and falls back: not here
        fused_wire, fused_params = _run(fused, layout, sources)
    assert fused._fused[layout] is not None  # the fused codec ran
    for eager, mine in zip(eager_wire, fused_wire):
        assert torch.equal(eager, mine)
    for eager, mine in zip(eager_params, fused_params):
        assert torch.equal(eager.view(torch.uint8), mine.view(torch.uint8))  # bits: NaN would show too


@pytest.mark.parametrize("code_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "float8"])
@pytest.mark.usefixtures("fresh_fused_codecs")
def test_fp32_shards_encode_as_their_bf16_cast_eager_and_fused(
    code_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under bf16 compute the codec reads the fp32 shards (no cast copy-in): the codes, scales and
    exact bytes are those of the shards cast to bf16 first, bit for bit, by either codec."""
    layout = Layout.build(SIZES, [torch.bfloat16] * len(SIZES))
    shards = _sources(torch.float32, layout)  # the same offsets in fp32 elements
    monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 1 << 40)
    expected = _run(QuantizedGather(BlockQuantizer(code_dtype, BLOCK), EXACT), layout, [s.bfloat16() for s in shards])
    for min_fused in (1 << 40, 0):
        monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", min_fused)
        monkeypatch.setattr(fused_codec._Status, "codecs", {})
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "quantized all-gather")
            wire, params = _run(QuantizedGather(BlockQuantizer(code_dtype, BLOCK), EXACT), layout, shards)
        assert all(torch.equal(a, b) for a, b in zip(expected[0], wire))
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(expected[1], params))


def _edge_values() -> torch.Tensor:
    """Blocks of BLOCK values that hit float8's edges once scaled: the absmax on 448 (scale 1),
    values rounding up to it, ties between codes, subnormals and their ties, +-0, a NaN block
    and an infinite one (scale inf: its finite values code to 0, itself to NaN)."""
    top = torch.tensor([448.0, -448.0, 447.9, 440.0, 432.0, 2.0**-6, 2.0**-7, 2.0**-9, 3 * 2.0**-10])
    top = torch.cat([top, torch.tensor([5 * 2.0**-10, 2.0**-10, 2.0**-11, 0.0, -0.0, -(2.0**-9), 17.0, 18.0, 19.0])])
    top = torch.cat([top, torch.linspace(-3.0, 3.0, BLOCK - top.numel())])
    special = torch.linspace(-1.0, 1.0, BLOCK)
    nan_block, inf_block = special.clone(), special.clone()
    nan_block[3], inf_block[5] = float("nan"), float("-inf")
    return torch.cat([top, top.flip(0) * 1e-30, nan_block, inf_block, torch.zeros(BLOCK)])


def _every_code_round_trip(
    layout: Layout, source: torch.Tensor, coded_values: int, block_scales: torch.Tensor, param_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Encodes ``source`` (float8), then decodes its wire with the second parameter's codes replaced by
    all 256 bytes (its blocks' scales by ``block_scales``); returns the codes as floats, the scales
    and the decoded parameters."""
    codec = QuantizedGather(BlockQuantizer(torch.float8_e4m3fn, BLOCK), [False, False])
    plan = codec._plan(layout)
    wire = codec.encode(source, layout)
    gathered = wire.clone()
    gathered[coded_values : coded_values + 256] = torch.arange(256, dtype=torch.uint8)
    gathered[plan.coded_padded : plan.coded_bytes].view(torch.float32)[coded_values // BLOCK :] = block_scales
    outputs = [torch.empty(size, dtype=param_dtype) for size in layout.sizes]
    codec.decode(gathered, 1, layout, outputs)
    scales = wire[plan.coded_padded : plan.coded_bytes].view(torch.float32)
    return wire[: plan.coded_padded].view(torch.float8_e4m3fn).float(), scales, outputs


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, signed zeros included, except that any NaN matches any NaN (the codecs agree on
    where NaN is, not on its sign and payload bits)."""
    bits = [t.float().nan_to_num(0.0).view(torch.int32) for t in (a, b)]
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(*bits)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.usefixtures("fresh_fused_codecs")
def test_float8_fused_codec_on_every_code_and_at_the_edges(
    param_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Values at the edges of float8's range encode alike, eager and fused (a NaN makes its whole
    block NaN codes and scale in both), and every one of the 256 codes decodes alike."""
    values = _edge_values()
    layout = Layout.build([values.numel(), 256], [param_dtype] * 2)
    source = torch.cat([values, torch.zeros(256)]).to(param_dtype)
    block_scales = torch.tensor([1.0, 0.5, 3.0, 2.0**-20]).repeat_interleave(2)  # the 256 codes' blocks
    results = {}
    for path, min_fused in (("eager", 1 << 40), ("fused", 0)):
        monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", min_fused)
        monkeypatch.setattr(fused_codec._Status, "codecs", {})
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "quantized all-gather")
            results[path] = _every_code_round_trip(layout, source, values.numel(), block_scales, param_dtype)
    (eager_codes, eager_scales, eager_out), (fused_codes, fused_scales, fused_out) = results.values()
    assert _same_values(eager_codes, fused_codes) and _same_values(eager_scales, fused_scales)
    assert eager_codes[2 * BLOCK : 3 * BLOCK].isnan().all() and eager_scales[2].isnan()  # the NaN block
    assert (eager_codes[3 * BLOCK : 4 * BLOCK].isnan().sum(), eager_scales[3]) == (1, float("inf"))  # the inf one
    assert all(_same_values(a, b) for a, b in zip(eager_out, fused_out))
    expected = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().view(8, BLOCK)
    expected = (expected * block_scales.unsqueeze(1)).flatten().to(param_dtype)
    assert _same_values(fused_out[1], expected)


@pytest.mark.usefixtures("fresh_fused_codecs")
def test_a_failed_compile_warns_once_and_the_eager_codec_takes_over(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_compile(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("no C++ compiler")

        return compiled

    layout = Layout.build(SIZES, [torch.bfloat16] * len(SIZES))
    sources = _sources(torch.bfloat16, layout)
    expected = _run(QuantizedGather(BlockQuantizer(torch.int8, BLOCK), EXACT), layout, sources)
    monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 0)
    monkeypatch.setattr(fused_codec._Status, "codecs", {})
    monkeypatch.setattr(fused_codec._Status, "broken", False)
    monkeypatch.setattr(torch, "compile", broken_compile)
    with pytest.warns(
        UserWarning, match=r"compiling the fused codec failed \(RuntimeError: no C\+\+ compiler\)"
    ) as caught:
        wire, params = _run(QuantizedGather(BlockQuantizer(torch.int8, BLOCK), EXACT), layout, sources)
        _run(QuantizedGather(BlockQuantizer(torch.int8, BLOCK), EXACT), layout, sources)
    assert len(caught) == 1
    assert all(torch.equal(a, b) for a, b in zip(expected[0], wire))
    assert all(torch.equal(a, b) for a, b in zip(expected[1], params))


def test_no_fused_codec_while_dynamo_traces_or_off_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_codec._Status, "broken", False)
    assert fused_codec.fusable(torch.device("cpu"), fused_codec.MIN_FUSED_VALUES)
    assert not fused_codec.fusable(torch.device("cpu"), fused_codec.MIN_FUSED_VALUES - 1)
    assert not fused_codec.fusable(torch.device("meta"), fused_codec.MIN_FUSED_VALUES)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not fused_codec.fusable(torch.device("cpu"), fused_codec.MIN_FUSED_VALUES)


def test_units_of_one_layout_share_a_codec_and_at_most_max_fused_layouts_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fused_codec._Status, "codecs", {})
    monkeypatch.setattr(fused_codec._Status, "full", False)
    first = fused_codec.FusedCodec.shared(torch.int8, BLOCK, [0], [64])
    assert fused_codec.FusedCodec.shared(torch.int8, BLOCK, [0], [64]) is first
    assert fused_codec.FusedCodec.shared(torch.float8_e4m3fn, BLOCK, [0], [64]) is not first
    assert fused_codec.FusedCodec.shared(torch.int8, BLOCK, [0], [64], torch.bfloat16) is not first
    made = [
        fused_codec.FusedCodec.shared(torch.int8, BLOCK, [0], [size])
        for size in range(1, fused_codec.MAX_FUSED_LAYOUTS + 1)
    ]
    assert [codec is not None for codec in made] == [True] * (fused_codec.MAX_FUSED_LAYOUTS - 3) + [False] * 3
    assert fused_codec.FusedCodec.shared(torch.int8, BLOCK, [0], [64]) is first


def _train(compiled: bool) -> tuple[list[float], list[torch.Tensor]]:
    """Three bf16 steps of a GPT whose blocks gather their weights as float8 codes."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=64, n_heads=4))
    for layer in model.layers:
        fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        if compiled:
            layer.compile(backend="aot_eager")
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    set_all_gather_quantization(model, AllGatherQuantization(dtype=torch.float8_e4m3fn, block_size=32))
    generator = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    batches = [torch.randint(32, (2, 9), generator=generator) for _ in range(3)]
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train_steps(
        model, optim, batches, lambda m, t: F.cross_entropy(m(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten())
    )
    return losses, [p.to_local().detach().clone() for p in model.parameters()]


@distributed(world_size=2)
def test_training_with_the_fused_codec_equals_the_eager_codec_compiled_blocks_too():
    """The forward and backward gathers of every unit, fused, under ``unit.compile()`` too
    (the hooks run between the compiled graphs, so the codec compiles on its own)."""
    saved = fused_codec.MIN_FUSED_VALUES, fused_codec._Status.codecs, codec_kernel._State.disabled
    codec_kernel._State.disabled = True  # the compiled codec's units (tests/test_codec_kernel.py: the kernel's)
    try:
        fused_codec.MIN_FUSED_VALUES = 1 << 40
        eager = _train(compiled=False)
        fused_codec.MIN_FUSED_VALUES, fused_codec._Status.codecs = 0, {}
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "quantized all-gather")
            for compiled in (False, True):
                losses, params = _train(compiled)
                assert losses == eager[0]
                assert all(torch.equal(a, b) for a, b in zip(eager[1], params))
        assert (
            len(fused_codec._Status.codecs) == 1 and not fused_codec._Status.broken
        )  # the blocks' (the root's are exact)
    finally:
        fused_codec.MIN_FUSED_VALUES, fused_codec._Status.codecs, codec_kernel._State.disabled = saved
