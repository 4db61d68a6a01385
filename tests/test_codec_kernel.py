"""The C codec kernel of the quantized all-gather gives the eager codec's bits, decodes every
rank's chunk in one call, and steps aside cleanly where it cannot be built. See [Note: Codec
kernel] in fullshard/_core/gather/codec/codec_kernel.py.
"""

import warnings
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch
from test_quantize_fused import (
    BLOCK,
    EXACT,
    SIZES,
    _edge_values,
    _every_code_round_trip,
    _run,
    _same_values,
    _sources,
    _train,
)

from fullshard._core.gather.codec import codec_kernel, fused_codec
from fullshard._core.layout import Layout, flat_pieces
from fullshard._core.gather.codec.quantize import BlockQuantizer
from fullshard._core.gather.codec.quantized_gather import QuantizedGather
from fullshard.testing import distributed

CODES = [torch.int8, torch.float8_e4m3fn]
CODE_IDS = ["int8", "float8"]


def count_kernel_calls(calls: Counter) -> Callable[[], None]:
    """Counts the C kernel's ``encode`` and ``decode`` calls in ``calls`` (the entry points the codec
    calls); returns the undo."""
    real = codec_kernel.encode, codec_kernel.decode

    def counted(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    codec_kernel.encode, codec_kernel.decode = counted("encode", real[0]), counted("decode", real[1])

    def undo() -> None:
        codec_kernel.encode, codec_kernel.decode = real

    return undo


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter]:
    """Every CPU unit takes the C kernel (it is built here if it is not cached); the compiled codec
    is marked broken, so that a unit the kernel refused would show as the eager codec's path. The
    test fails unless the kernel ran (a cache filled is not proof: see ``count_kernel_calls``)."""
    monkeypatch.setattr(codec_kernel._State, "disabled", False)
    monkeypatch.setattr(fused_codec._Status, "broken", True)
    assert codec_kernel.library() is not None, "this machine has gcc: the kernel must build"
    calls: Counter = Counter()
    undo = count_kernel_calls(calls)
    try:
        yield calls
    finally:
        undo()
    assert calls["encode"] + calls["decode"] > 0, "the C kernel never ran"


def _paths(monkeypatch: pytest.MonkeyPatch, run, *args):
    """``run(*args)`` by the eager codec, then by the kernel (with the kernel's use checked by the caller)."""
    monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 1 << 40)
    eager = run(*args)
    monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "quantized all-gather")
        return eager, run(*args)


@pytest.mark.parametrize(
    ("param_dtype", "source_dtype"),  # shards are never narrower than the compute dtype
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)],
    ids=["bf16", "bf16-from-fp32", "fp32"],
)
@pytest.mark.parametrize("code_dtype", CODES, ids=CODE_IDS)
@pytest.mark.usefixtures("kernel")
def test_kernel_gives_the_eager_codecs_bits(
    code_dtype: torch.dtype, param_dtype: torch.dtype, source_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uneven parameters (blocks straddling three of them, exact ones between, a partial last block),
    magnitudes from 1e-4 to 1e3 and an all-zero block; an fp32 source under bf16 compute is coded
    as its bf16 cast (see [Note: Fused codec])."""
    layout = Layout.build(SIZES, [param_dtype] * len(SIZES))
    sources = _sources(source_dtype, layout)
    codecs = [QuantizedGather(BlockQuantizer(code_dtype, BLOCK), EXACT) for _ in range(2)]
    expected_sources = [s.to(param_dtype) for s in sources]  # the eager codec's own input
    monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 1 << 40)
    eager_wire, eager_params = _run(codecs[0], layout, expected_sources)
    monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 0)
    wire, params = _run(codecs[1], layout, sources)
    assert layout in codecs[1]._kernel_encodes and (layout, 3) in codecs[1]._kernel_decodes  # the kernel ran
    assert all(torch.equal(a, b) for a, b in zip(eager_wire, wire))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(eager_params, params))


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.usefixtures("kernel")
def test_kernel_on_every_float8_code_and_at_the_edges(
    param_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 256 codes decode as torch's float8 cast times the scale (subnormal results included), and
    +-0, subnormals and their ties, saturation at 448, tiny, NaN and infinite blocks encode as the
    eager codec does (a NaN's sign and payload aside)."""
    values = _edge_values()
    layout = Layout.build([values.numel(), 256], [param_dtype] * 2)
    source = torch.cat([values, torch.zeros(256)]).to(param_dtype)
    block_scales = torch.tensor([1.0, 0.5, 3.0, 2.0**-20, 2.0**-130, 2.0**100, 7.1e-3, 1.0])

    def run():
        return _every_code_round_trip(layout, source, values.numel(), block_scales, param_dtype)

    (eager_codes, eager_scales, eager_out), (codes, scales, out) = _paths(monkeypatch, run)
    assert _same_values(eager_codes, codes) and _same_values(eager_scales, scales)
    assert all(_same_values(a, b) for a, b in zip(eager_out, out))
    expected = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().view(8, BLOCK)
    assert _same_values(out[1], (expected * block_scales.unsqueeze(1)).flatten().to(param_dtype))


@pytest.mark.usefixtures("kernel")
def test_kernel_rounds_every_bf16_value_as_torch_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every finite bf16 magnitude up to 448 (and a million random fp32 ones, rounded to bf16 on the
    way) coded with scale 1 (each block holds 448): float8's rounding, ties to even, subnormals and
    saturation, against torch's cast, bit for bit."""
    bf16 = torch.arange(1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf16 = bf16[bf16 <= 448]
    generator = torch.Generator().manual_seed(0)
    fp32 = torch.rand(1 << 20, generator=generator) ** 8 * 448 * torch.randn(1 << 20, generator=generator).sign()
    for values, dtype in ((torch.cat([bf16, -bf16]), torch.float32), (fp32, torch.bfloat16)):
        rows = -(-values.numel() // (BLOCK - 1))
        blocks = torch.full((rows, BLOCK), 448.0)
        blocks[:, 1:] = torch.cat([values, torch.zeros(rows * (BLOCK - 1) - values.numel())]).view(rows, -1)
        layout = Layout.build([blocks.numel()], [dtype])
        codec = QuantizedGather(BlockQuantizer(torch.float8_e4m3fn, BLOCK), [False])
        monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 0)
        wire = codec.encode(blocks.view(-1), layout)
        assert layout in codec._kernel_encodes
        expected = blocks.view(-1).to(dtype).float().to(torch.float8_e4m3fn)
        assert torch.equal(wire[: blocks.numel()], expected.view(torch.uint8))


@pytest.mark.parametrize("code_dtype", CODES, ids=CODE_IDS)
@pytest.mark.usefixtures("kernel")
def test_one_decode_call_for_every_ranks_flat_piece(code_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FSDP1's flat layout the ranks' chunks differ in layout (see [Note: Quantized flat
    chunks]); the kernel decodes all of them, coded and exact pieces, in one call, to the eager
    codec's bits, every element written."""
    sizes, world, dtype = [5, 300, 7, 5, 129, 64, 1000, 3], 4, torch.bfloat16
    chunk, pieces = flat_pieces(sizes, world)
    layouts = [
        Layout.build([stop - start for start, stop in (p[r] for p in pieces)], [dtype] * 8, flat_chunk=chunk)
        for r in range(world)
    ]
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(chunk, generator=generator) * 10.0 ** (r - 1) for r in range(world)]

    def run():
        codec = QuantizedGather(BlockQuantizer(code_dtype, BLOCK), EXACT, pieces)
        packed = [codec.encode(source.to(dtype), layout) for layout, source in zip(layouts, sources)]
        outputs = [torch.full((size,), float("nan"), dtype=dtype) for size in sizes]
        calls = []
        monkeypatch.setattr(codec, "_decode_chunks", lambda *args: calls.append(args))  # the per-rank path
        codec.decode(torch.cat(packed), world, layouts[0], outputs)
        return packed, outputs, calls

    (eager_wire, eager_params, eager_calls), (wire, params, calls) = _paths(monkeypatch, run)
    assert len(eager_calls) == world and not calls  # one kernel call instead of a decode per rank
    eager_params = [torch.full_like(p, float("nan")) for p in params]
    codec = QuantizedGather(BlockQuantizer(code_dtype, BLOCK), EXACT, pieces)
    monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 1 << 40)
    codec.decode(torch.cat(eager_wire), world, layouts[0], eager_params)
    plans = [codec._plan(layout) for layout in layouts]
    used = [plan.coded_bytes + plan.exact_numel * dtype.itemsize for plan in plans]  # the rest: unused bytes
    assert all(torch.equal(a[:n], b[:n]) for a, b, n in zip(eager_wire, wire, used))
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(eager_params, params))
    assert not any(p.isnan().any() for p in params)


@pytest.mark.usefixtures("kernel")
def test_threads_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit large enough for several threads (blocks and segments shared out) codes and decodes
    as on one thread."""
    sizes = [70_001, 3, 129_000, 65_536]
    layout = Layout.build(sizes, [torch.bfloat16] * 4)
    source = torch.randn(layout.total, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 0)
    results = []
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 3):
            torch.set_num_threads(num_threads)
            codec = QuantizedGather(BlockQuantizer(torch.float8_e4m3fn, 128), [False, True, False, False])
            results.append(_run(codec, layout, [source, source * 3, -source]))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(results[0][1], results[1][1]))


def test_a_failed_build_warns_once_and_the_codec_takes_over(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No compiler (or a failing one): one warning naming the cause, then the same bits by the codec
    that remains (here the eager one: the compiled codec is marked broken too)."""
    layout = Layout.build(SIZES, [torch.bfloat16] * len(SIZES))
    sources = _sources(torch.bfloat16, layout)
    expected = _run(QuantizedGather(BlockQuantizer(torch.float8_e4m3fn, BLOCK), EXACT), layout, sources)
    fresh_state = type("_State", (), {"library": None, "tried": False, "disabled": False})
    monkeypatch.setattr(codec_kernel, "_State", fresh_state)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(fused_codec, "MIN_FUSED_VALUES", 0)
    monkeypatch.setattr(fused_codec._Status, "broken", True)
    with pytest.warns(UserWarning, match=r"^quantized all-gather: building the CPU codec kernel failed \(") as caught:
        wire, params = _run(QuantizedGather(BlockQuantizer(torch.float8_e4m3fn, BLOCK), EXACT), layout, sources)
        _run(QuantizedGather(BlockQuantizer(torch.float8_e4m3fn, BLOCK), EXACT), layout, sources)
    assert len(caught) == 1 and "no-such-compiler" in str(caught[0].message)
    assert all(torch.equal(a, b) for a, b in zip(expected[0], wire))
    assert all(torch.equal(a, b) for a, b in zip(expected[1], params))


def test_the_library_is_built_once_and_cached(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A fresh cache builds (in seconds: no torch header) and a second build finds the file."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    built = codec_kernel._build()
    assert built.parent.parent == tmp_path and built.exists()
    stamp = built.stat().st_mtime_ns
    assert codec_kernel._build() == built and built.stat().st_mtime_ns == stamp
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no temporary left behind


@distributed(world_size=2)
def test_training_with_the_kernel_equals_the_eager_codec():
    """Every unit's forward and backward gathers by the kernel (float8, bf16 compute): the same
    losses and parameters as the eager codec."""
    saved = fused_codec.MIN_FUSED_VALUES, fused_codec._Status.broken, codec_kernel._State.disabled
    try:
        fused_codec.MIN_FUSED_VALUES = 1 << 40
        eager = _train(compiled=False)
        fused_codec.MIN_FUSED_VALUES, fused_codec._Status.broken, codec_kernel._State.disabled = 0, True, False
        calls: Counter = Counter()
        undo = count_kernel_calls(calls)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("error", "quantized all-gather")
                losses, params = _train(compiled=False)
        finally:
            undo()
        assert codec_kernel.library() is not None
        assert calls["encode"] > 0 and calls["decode"] > 0, calls
        assert losses == eager[0]
        assert all(torch.equal(a, b) for a, b in zip(eager[1], params))
    finally:
        fused_codec.MIN_FUSED_VALUES, fused_codec._Status.broken, codec_kernel._State.disabled = saved
