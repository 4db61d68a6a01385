"""Block-wise quantization for the all-gather: error bounds per block, the packed
layout, and bad settings. See [Note: Quantized all-gather] in fullshard/_core/gather/codec/quantize.py.
"""

import pytest
import torch

from fullshard._core.gather.codec.quantize import CODE_MAX, BlockQuantizer

CODE_DTYPES = [torch.int8, torch.float8_e4m3fn]


def _encode(quantizer: BlockQuantizer, row: torch.Tensor, out: torch.Tensor) -> None:
    """Encodes ``row`` zero-padded to whole blocks, as a unit's coded values are."""
    padded = torch.zeros(quantizer.num_blocks(row.numel()) * quantizer.block_size)
    padded[: row.numel()] = row
    quantizer.encode(padded, out)


def _round_trip(quantizer: BlockQuantizer, values: torch.Tensor) -> torch.Tensor:
    """Encodes each row of ``values`` as one rank's shard and decodes them all at once."""
    num_chunks, numel = values.shape
    packed = torch.empty(num_chunks, quantizer.packed_numel(numel), dtype=torch.uint8)
    for chunk, row in zip(packed, values):
        _encode(quantizer, row, chunk)
    return quantizer.decode(packed, numel)


def _block_absmax(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each value's block absmax (blocks run along a row; the last one may be short)."""
    num_chunks, numel = values.shape
    padded = torch.zeros(num_chunks, -(-numel // block_size) * block_size)
    padded[:, :numel] = values.abs()
    absmax = padded.view(num_chunks, -1, block_size).amax(dim=2, keepdim=True)
    return absmax.expand(-1, -1, block_size).reshape(num_chunks, -1)[:, :numel]


@pytest.mark.parametrize("numel", [1, 63, 64, 1000])
def test_int8_error_at_most_half_a_step(numel: int) -> None:
    torch.manual_seed(0)
    block_size = 64
    # Blocks of very different magnitudes: each must keep its own scale.
    values = torch.randn(3, numel) * torch.logspace(-4, 4, 3).unsqueeze(1)
    decoded = _round_trip(BlockQuantizer(torch.int8, block_size), values)
    half_step = _block_absmax(values, block_size) / (2 * CODE_MAX[torch.int8])
    assert ((decoded - values).abs() <= half_step * (1 + 1e-5)).all()


@pytest.mark.parametrize("numel", [7, 128, 1000])
def test_float8_error_within_three_mantissa_bits(numel: int) -> None:
    torch.manual_seed(0)
    block_size = 32
    values = torch.randn(2, numel) * torch.tensor([[1e-3], [1e3]])
    decoded = _round_trip(BlockQuantizer(torch.float8_e4m3fn, block_size), values)
    scale = _block_absmax(values, block_size) / CODE_MAX[torch.float8_e4m3fn]
    # Half an ulp of three mantissa bits, or half the smallest subnormal step (2**-9) near zero.
    bound = torch.maximum(values.abs() * 2**-4, scale * 2**-10)
    assert ((decoded - values).abs() <= bound * (1 + 1e-5)).all()


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_block_extremes_exact_and_zero_blocks_zero(code_dtype: torch.dtype) -> None:
    values = torch.zeros(2, 96)
    values[0, :32] = torch.linspace(-5.0, 3.0, 32)
    decoded = _round_trip(BlockQuantizer(code_dtype, 32), values)
    assert decoded[0, 0].item() == -5.0  # the absmax maps onto the largest code exactly
    assert torch.equal(decoded[0, 32:], torch.zeros(64))
    assert torch.equal(decoded[1], torch.zeros(96))


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_decode_is_torchs_cast_times_the_scale(code_dtype: torch.dtype) -> None:
    """Every one of the 256 codes (float8 NaN included) decodes to torch's own cast of it
    times its block's scale, from chunks whose rows are strided."""
    quantizer = BlockQuantizer(code_dtype, 128)
    codes = torch.arange(256, dtype=torch.uint8).view(2, 128)
    scales = torch.tensor([[0.5], [3.0]])
    gathered = torch.zeros(2, 2 * quantizer.packed_numel(128), dtype=torch.uint8)  # padding after each row
    gathered[:, :128] = codes
    gathered[:, 128:132] = scales.view(torch.uint8)
    decoded = quantizer.decode(gathered[:, : quantizer.packed_numel(128)], 128)
    expected = codes.view(code_dtype).float() * scales
    assert torch.equal(decoded.isnan(), expected.isnan())
    assert torch.equal(decoded.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_packed_layout_codes_then_scales(code_dtype: torch.dtype) -> None:
    quantizer = BlockQuantizer(code_dtype, 16)
    values = torch.arange(40, dtype=torch.float32)
    packed = torch.empty(quantizer.packed_numel(40), dtype=torch.uint8)
    _encode(quantizer, values, packed)
    num_blocks = 3
    assert packed.numel() == num_blocks * 16 + num_blocks * 4
    scales = packed[num_blocks * 16 :].view(torch.float32)
    expected = torch.tensor([15.0, 31.0, 39.0]) / CODE_MAX[code_dtype]
    torch.testing.assert_close(scales, expected)
    assert torch.equal(packed[40 : num_blocks * 16], torch.zeros(8, dtype=torch.uint8))  # padding codes


def test_about_half_the_bytes_of_bf16() -> None:
    quantizer = BlockQuantizer(torch.int8, 128)
    numel = 1 << 20
    assert quantizer.packed_numel(numel) / (2 * numel) <= 0.52


def test_encode_takes_fp32_whole_blocks() -> None:
    quantizer = BlockQuantizer(torch.int8, 8)
    packed = torch.empty(quantizer.packed_numel(24), dtype=torch.uint8)
    for values in (torch.randn(24, dtype=torch.bfloat16), torch.randn(20)):
        with pytest.raises(AssertionError, match="encode expects fp32 values in whole blocks"):
            quantizer.encode(values, packed)


@pytest.mark.parametrize(
    ("code_dtype", "block_size", "match"),
    [
        (torch.bfloat16, 64, r"^quantized all-gather expects a code dtype in \(.*\) but got torch.bfloat16$"),
        (torch.int8, 0, r"^quantized all-gather expects a positive block size divisible by 4 .* but got 0$"),
        (torch.int8, 30, r"^quantized all-gather expects a positive block size divisible by 4 .* but got 30$"),
    ],
)
def test_bad_settings(code_dtype: torch.dtype, block_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BlockQuantizer(code_dtype, block_size)
