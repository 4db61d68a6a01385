"""The quantized all-gather's CPU codec as a small C library, built on first use.

[Note: Codec kernel]
Inductor's loops (see [Note: Fused codec] in fused_codec.py) convert float8 with
torch's vector routine, masked steps for saturation, subnormals and NaN: on
loopback that cost more than the halved bytes saved. ``codec_kernel.c`` does the
same arithmetic as C loops: portable ones that gcc vectorizes (float8 decoded by
rebiasing the exponent in the bits, subnormals as mantissa x 2**-9, so flushed
denormals do not matter; encoded with torch's round-to-nearest-even and
saturation; bf16 by the same rounding as torch's cast), and AVX-512 versions of
float8's two conversions (a 128-entry table in registers for the decode), chosen
when the library loads. Codes, scales and decoded values are the eager
codec's bit for bit (a NaN's sign and payload aside; ``tests/test_codec_kernel.py``).

It includes no torch header, so it compiles in about a second (gcc, one file, an
x86-64-v4, v3 and baseline clone of each loop chosen when it loads); the library
is cached in torch's extension directory (``TORCH_EXTENSIONS_DIR``) under the hash
of its source, flags and compiler, built into a temporary name and renamed (ranks
building at once do not collide), and called through ctypes, which releases the GIL.
One call decodes every rank's chunk, flat units included: a table of segments
(row, position, scales, output, offset, length) built once per layout names where
each piece goes, and exact pieces are copied by the same call.

Where there is no compiler, the build fails or ``FULLSHARD_CODEC_KERNEL=0`` is set,
the compiled loops (or the eager codec) take over, with one warning for a failure.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
import torch.utils.cpp_extension

_SOURCE = Path(__file__).with_name("codec_kernel.c")
_FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-fopenmp")
_CODES = {torch.int8: 0, torch.float8_e4m3fn: 1}
_VALUES = (torch.float32, torch.bfloat16)  # compute and source dtypes the loops convert
_PARALLEL_VALUES = 1 << 16  # below this a call stays on the calling thread
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
EXACT = -1  # a decode segment's scales offset that means "copy the bytes as they are"


class _State:
    """Process-wide: the loaded library, or why there is none."""

    library: ctypes.CDLL | None = None
    tried = False
    disabled = os.environ.get("FULLSHARD_CODEC_KERNEL", "1") == "0"


def library() -> ctypes.CDLL | None:
    """The codec library, built and loaded on the first call; None where it cannot be (warned once)."""
    if _State.disabled:
        return None
    if not _State.tried:
        _State.tried = True
        try:
            _State.library = _load(_build())
        except Exception as error:  # noqa: BLE001 (a compiler, a file system, a loader: many kinds)
            reason = str(error).strip().split("\n")[0]
            warnings.warn(
                f"quantized all-gather: building the CPU codec kernel failed ({type(error).__name__}: {reason}); "
                "using the compiled or eager codec instead (the same results, slower)",
                stacklevel=3,
            )
    return _State.library


def _build() -> Path:
    """The library's path, compiled there first unless a build of the same source is cached."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc on PATH, or CC)")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), compiler.encode()])).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or torch.utils.cpp_extension.get_default_build_root()
    target = Path(root) / "fullshard_codec" / f"codec_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            command = [compiler, *_FLAGS, str(_SOURCE), "-o", str(built)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
            os.replace(built, target)
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.fullshard_encode.argtypes = [_PTR, _INT, _INT, _PTR, _I64, _I64, _I64, _INT, _PTR, _PTR, _PTR, _INT]
    lib.fullshard_encode.restype = None
    lib.fullshard_decode.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _INT, _I64, _INT, _INT]
    lib.fullshard_decode.restype = None
    return lib


def supports(code_dtype: torch.dtype, value_dtype: torch.dtype, source_dtype: torch.dtype) -> bool:
    """Whether the loops convert these dtypes (others take the compiled or eager codec)."""
    return code_dtype in _CODES and value_dtype in _VALUES and source_dtype in _VALUES


def _threads(num_values: int) -> int:
    return torch.get_num_threads() if num_values >= _PARALLEL_VALUES else 1


def encode_segments(offsets: list[int], sizes: list[int]) -> torch.Tensor:
    """The encode's table: a row (offset in the source, position among the coded values, length)
    per non-empty region, the regions laid back to back in the given order."""
    rows, position = [], 0
    for offset, size in zip(offsets, sizes):
        if size:
            rows.append((offset, position, size))
            position += size
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


def encode(
    lib: ctypes.CDLL,
    source: torch.Tensor,
    segments: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    value_dtype: torch.dtype,
) -> None:
    """Codes of the source's regions (``segments``, see ``encode_segments``) rounded to
    ``value_dtype`` into ``codes`` (the code dtype, whole blocks) and ``scales`` (fp32)."""
    num_values = int(segments[-1, 1] + segments[-1, 2]) if segments.numel() else 0
    num_threads = _threads(num_values)
    scratch = torch.empty(num_threads * block_size, dtype=torch.int32)  # a block of values per thread
    lib.fullshard_encode(
        source.data_ptr(),
        int(source.dtype == torch.bfloat16),
        int(value_dtype == torch.bfloat16 and source.dtype == torch.float32),
        segments.data_ptr(),
        segments.size(0),
        num_values,
        block_size,
        _CODES[codes.dtype],
        codes.data_ptr(),
        scales.data_ptr(),
        scratch.data_ptr(),
        num_threads,
    )


def decode(
    lib: ctypes.CDLL,
    chunks: torch.Tensor,
    segments: torch.Tensor,
    outputs: list[torch.Tensor],
    code_dtype: torch.dtype,
    block_size: int,
) -> None:
    """Fills ``outputs`` (contiguous, one dtype in fp32 or bf16) from ``chunks`` (uint8, one row per
    rank) by ``segments``: rows (chunk, byte position, byte offset of the chunk's scales or EXACT,
    output, element offset in it, length)."""
    pointers = (_I64 * len(outputs))(*(output.data_ptr() for output in outputs))
    lib.fullshard_decode(
        chunks.data_ptr(),
        chunks.stride(0),
        segments.data_ptr(),
        segments.size(0),
        pointers,
        int(outputs[0].dtype == torch.bfloat16),
        block_size,
        _CODES[code_dtype],
        _threads(chunks.numel()),
    )
