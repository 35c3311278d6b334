"""``sparsa::bitmask_linear``: Y = X W^T + b with W in the Bitmask layout (per-row bitmask + packed values).

Six native strategies, each reading the compressed weight once per call:

- ``"stream"`` for a few tokens (LLM decoding, ``csrc/bitmask_linear.cpp``; up to the token crossover
  ``bitmask.stream_bf16`` / ``bitmask.stream_f32``, :func:`stream_max_tokens`): every row's packed values
  are expanded in registers, 8 columns at a time with AVX2 or 16 with AVX-512 (one masked expand per pair
  of mask bytes, where the CPU has AVX-512F), and multiplied with the tokens; bfloat16 takes 32 columns a
  step with one word expand and VDPBF16PS where the CPU has AVX512-BF16 and VBMI2. The weight is streamed
  from memory once, so the time follows its bytes. :data:`STREAM_PATH` picks the row loop.
- ``"expand"`` for many tokens (prefill): blocks of rows are expanded to dense rows that stay in cache,
  and a BLAS GEMM multiplies each block, so the GEMM runs at dense speed on the compressed weight's
  memory traffic. A bf16 GEMM, and a float32 one above the token crossover ``bitmask.row_blocks_f32``
  (:func:`row_blocks_max_tokens`), takes the whole expanded weight instead. bfloat16 weights are expanded
  to float32 when this CPU has no bf16 matrix hardware (AVX-512 BF16 or AMX), where PyTorch's bf16 GEMM
  is far slower than float32.
- ``"panel"`` for many bfloat16 tokens where the CPU has AVX512-BF16 and VBMI2
  (``csrc/bitmask_panel_bf16.cpp``): sparse compute. Tokens are packed into bf16 panels of 32 (one panel
  of 16 for a call of at most 16 tokens, batched decoding); each row's
  kept columns are listed from its mask bits as it is reached, and pairs of kept columns multiply their
  two adjacent packed values in one VDPBF16PS per 16 tokens. Only kept weights are multiplied, so its time
  falls with the density, where the expansion only adds to a dense GEMM. An X holding NaN or Inf runs
  ``"expand"`` instead (only the dense product spreads it to every output, as ``F.linear`` does).
  float32 weights and tokens take the same strategy with AVX2 FMAs (``csrc/bitmask_panel_f32.cpp``): fp32
  panels of 32 tokens (the last one 8, 16 or 32 wide), each kept weight broadcast against its column's
  tokens. A token's result does not depend on the panel width.
- ``"amx"`` for many bfloat16 tokens where the CPU has AMX-BF16 (:mod:`sparsa.kernels.bitmask_amx`,
  ``csrc/bitmask_amx_bf16.cpp``): dense work on the compressed weight. The weight's rows are expanded from
  the components, 32 outputs at a time, into dense tiles that stay in cache, and multiplied with X (packed
  once per call) at AMX's rate. It replaces ``"expand"`` as the dense side on such CPUs: no dense or
  reordered copy of the weight is written, and no per-call weight reorder is made as a BLAS GEMM's.
  Elsewhere (and for float32 tokens) ``"amx"`` runs ``"expand"``.
- ``"fused"`` for float32 tokens up to the token crossover ``bitmask.fused_f32`` (:func:`fused_max_tokens`)
  where the CPU has AVX-512 (``csrc/bitmask_fused_f32.cpp``): the float32 counterpart of ``"amx"``, a dense
  GEMM whose weight operand is expanded from the components into L1-sized blocks inside the kernel, with
  X packed once per call into 32-token panels and 12 rows x 32 tokens of sums in registers. Expanding the
  weight for a BLAS GEMM writes and rereads the dense weight on every call; this reads only the compressed
  bytes. Above the crossover the BLAS GEMM's higher rate wins and ``"expand"`` runs. Elsewhere (and for
  bfloat16) ``"fused"`` runs ``"expand"``.
- ``"nm24"`` for many bfloat16 tokens on a weight whose pattern is 2:4 (two of every four columns kept),
  where the CPU has AVX512-BF16 (:mod:`sparsa.kernels.nm24`, ``csrc/nm24_panel_bf16.cpp``): X packed once
  into the six column-pair vectors of every group, one ``VDPBF16PS`` per kept pair and 16 tokens, each
  vector reused by a block of rows. The automatic choice takes it above the token crossover
  ``nm24.panel_bf16`` once the pattern is found to be 2:4 (once per ``bits`` tensor; the kernel reads each
  group's pair from the bits). Elsewhere, and for an X holding NaN or Inf, ``"nm24"`` runs ``"panel"``.

:func:`choose_strategy` picks one by token count, dtype and density: the stream strategy up to its token
crossover, then the panel strategy up to the density
crossover measured on this CPU (``bitmask.batch_panel_bf16`` / ``bitmask.batch_panel_f32`` up to
:data:`BATCH_MAX_TOKENS` tokens, ``bitmask.panel_bf16`` / ``bitmask.panel_f32`` above, in
:mod:`sparsa.crossovers`; ``sparsa cost --refit``), then the dense side (:func:`dense_strategy`):
``"amx"`` for bfloat16 where it runs, ``"fused"`` for float32 where it runs up to its token crossover,
else ``"expand"``. When the kernels cannot be built, or
``SPARSA_NO_NATIVE=1``, the op runs :func:`bitmask_linear_reference` (rebuild the dense weight, one matmul).

Semantics: the result is the dense product with the logical weight (zeros included), so a NaN or Inf in
``x`` reaches every output row, kept column or not, as in ``F.linear``. float32 operands compute in float32;
bfloat16 operands accumulate in float32 and each output is rounded once (nearest even). The output has
``x``'s dtype.

Example::

    >>> import torch
    >>> from sparsa.layouts import Bitmask
    >>> from sparsa.kernels.bitmask import bitmask_linear
    >>> w = Bitmask.from_dense(torch.randn(20, 30), sparsity=0.5)
    >>> x = torch.randn(2, 30)
    >>> y = bitmask_linear(x, w.bits, w.row_ptr, w.values, None, 20)
    >>> torch.allclose(y, x @ w.to_dense().T, atol=1e-4)
    True
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

import torch
from torch import Tensor

from .. import cpu
from ..crossovers import CROSSOVERS, crossover, nominal_density, token_crossover
from ..layouts.bitmask import unpack_bits
from . import loader
from . import nm24 as _nm24
from . import bitmask_amx as _amx_tiles
from .epilogue import activate, activation_backward, activation_code
from .operands import REDUCED_DTYPES, bitmask_rows_call, compute_dtype, native_kind
from .opdef import kernel_op

__all__ = [
    "STREAM_PATH",
    "STREAM_PATHS",
    "has_avx512",
    "has_dpbf16",
    "has_panel_bf16",
    "PANEL_CROSSOVERS",
    "BATCH_PANEL_CROSSOVERS",
    "BATCH_MAX_TOKENS",
    "STREAM_CROSSOVERS",
    "ROW_BLOCKS_CROSSOVER",
    "BATCH_STREAM_CROSSOVER",
    "panel_max_density",
    "stream_max_tokens",
    "row_blocks_max_tokens",
    "has_panel_f32",
    "has_nm24_panel",
    "has_amx",
    "amx_status",
    "has_fused_f32",
    "fused_max_tokens",
    "dense_strategy",
    "FUSED_CROSSOVER",
    "bitmask_linear",
    "bitmask_linear_kernel",
    "bitmask_linear_impl",
    "bitmask_linear_reference",
    "bitmask_dense_weight",
    "choose_strategy",
    "auto_strategy",
    "many_token_strategy",
    "native_library",
    "STRATEGIES",
]

_SOURCES = [
    "bitmask_linear.cpp",
    "bitmask_panel_bf16.cpp",
    "bitmask_panel_f32.cpp",
    "bitmask_fused_f32.cpp",
    "nm24_panel_bf16.cpp",
    "bitmask_amx_bf16.cpp",
]
STRATEGIES = ("stream", "expand", "panel", "nm24", "amx", "fused")
#: the token crossovers (sparsa.crossovers) holding the most tokens each dtype's stream strategy takes;
#: above, the panel or expand strategy runs (both reuse each weight across tokens, the stream kernel
#: re-expands it for every 4 tokens)
STREAM_CROSSOVERS = {torch.bfloat16: "bitmask.stream_bf16", torch.float32: "bitmask.stream_f32"}
#: the token crossover holding the most tokens a bf16 weight too dense for the panel kernel streams in
#: batched decoding (above the stream strategy's own tokens): expanding a weight past the cache for the
#: dense GEMM costs more than the stream loop's dense compute
BATCH_STREAM_CROSSOVER = "bitmask.batch_stream_bf16"
#: the token crossover holding the most tokens a float32 expansion multiplies block by block; above, the
#: whole expanded weight and one ``F.linear`` (its row-block GEMMs, ``W_block @ X^T`` then a transpose of
#: the output, lose to it at many tokens)
ROW_BLOCKS_CROSSOVER = "bitmask.row_blocks_f32"
#: the token crossover holding the most float32 tokens the fused kernel takes as the dense side; above,
#: the expansion for a BLAS GEMM (whose higher rate on many tokens outweighs writing the dense weight)
FUSED_CROSSOVER = "bitmask.fused_f32"
#: the crossovers (sparsa.crossovers, measured per CPU by ``sparsa cost --refit``) holding the densest
#: weight (kept fraction) each dtype's panel strategy takes; above it, expand (the dense GEMM) wins
PANEL_CROSSOVERS = {torch.bfloat16: "bitmask.panel_bf16", torch.float32: "bitmask.panel_f32"}
#: most tokens of a batched-decoding call: up to here the panel kernels run one narrow panel and the dense
#: GEMM is short, so the panel's crossover is its own (measured at 16 tokens)
BATCH_MAX_TOKENS = 32
#: the crossovers holding the densest weight each dtype's panel strategy takes from above the stream
#: strategy's tokens to BATCH_MAX_TOKENS tokens
BATCH_PANEL_CROSSOVERS = {torch.bfloat16: "bitmask.batch_panel_bf16", torch.float32: "bitmask.batch_panel_f32"}
#: bytes of dense rows expanded per GEMM block (fits the last-level cache of the CPUs we target)
_BLOCK_BYTES = 2 << 20
#: with bf16 GEMM hardware, a weight whose dense bf16 copy is at most this many bytes is expanded whole
#: (into a per-thread buffer kept between calls) and multiplied with one ``F.linear``, the dense model's
#: GEMM; the row-block GEMMs (each ``W_block @ X^T``) run slower in bf16 (docs/benchmarks.md)
_WHOLE_BYTES = 64 << 20
#: the stream strategy's row loops: ``"auto"`` (for bfloat16 the dot-product loop where the CPU has
#: AVX512-BF16 and VBMI2, else AVX-512 where it has it, else AVX2; ``SPARSA_ISA`` can lower it),
#: ``"avx2"`` (8 columns a step), ``"avx512"`` (16), ``"pair16"`` (the AVX-512 loop on two AVX2 halves:
#: the same offsets and tails, so tests check that loop's logic on any AVX2 CPU), ``"dpbf16"`` (bfloat16
#: only: 32 columns a step, one word expand and one VDPBF16PS per token, X kept in bfloat16)
STREAM_PATHS = {"auto": 0, "avx2": 1, "avx512": 2, "pair16": 3, "dpbf16": 4}
#: the row loop the stream strategy runs (one of :data:`STREAM_PATHS`)
STREAM_PATH = "auto"


def native_library() -> Optional[ctypes.CDLL]:
    """The native kernel library (typed by ``abi.SIGNATURES["bitmask_linear"]``), or None when the
    fallback must run."""
    return loader.load("bitmask_linear", _SOURCES)


def bitmask_dense_weight(
    bits: Tensor, row_ptr: Tensor, values: Tensor, in_features: int, dtype: Optional[torch.dtype] = None
) -> Tensor:
    """The logical ``(R, in_features)`` weight (pure PyTorch)."""
    mask = unpack_bits(bits, in_features)
    w = torch.zeros(mask.shape, dtype=dtype or values.dtype, device=values.device)
    w[mask] = values.to(w.dtype)
    return w


def bitmask_linear_reference(
    x: Tensor, bits: Tensor, row_ptr: Tensor, values: Tensor, bias: Optional[Tensor], out_features: int
) -> Tensor:
    """Pure-PyTorch semantics of the kernels; bfloat16/float16 inputs compute in float32 and round once."""
    ct = torch.float32 if x.dtype in REDUCED_DTYPES else x.dtype
    w = bitmask_dense_weight(bits, row_ptr, values, x.shape[-1], ct)
    y = torch.nn.functional.linear(x.to(ct), w, None if bias is None else bias.to(ct))
    return y.to(x.dtype)


def has_avx512() -> bool:
    """Whether the stream strategy's AVX-512 row loop runs here (CPU, build and ``SPARSA_ISA``)."""
    lib = native_library()
    return lib is not None and bool(lib.sparsa_bitmask_has_avx512())


def has_dpbf16() -> bool:
    """Whether the stream strategy's bfloat16 dot-product loop runs here (AVX512-BF16 + VBMI2, build and
    ``SPARSA_ISA``)."""
    lib = native_library()
    return lib is not None and bool(lib.sparsa_bitmask_has_dpbf16())


def _stream_path() -> int:
    code = STREAM_PATHS.get(STREAM_PATH)
    if code is None:
        raise ValueError(f"bitmask.STREAM_PATH must be one of {sorted(STREAM_PATHS)}, got {STREAM_PATH!r}")
    return code


def _bf16_gemm_hardware() -> bool:
    # cpu_flags, not cpu_info: cpu_info asks torch for its build config (~0.2 ms), on every prefill linear
    flags = cpu.cpu_flags()
    return bool(flags.get("avx512_bf16") or flags.get("amx_bf16"))


def has_panel_bf16() -> bool:
    """Whether the bfloat16 panel strategy runs here (AVX512-BF16 + VBMI2, build and ``SPARSA_ISA``)."""
    lib = native_library()
    return lib is not None and bool(lib.sparsa_bitmask_has_panel_bf16())


def has_panel_f32() -> bool:
    """Whether the float32 panel strategy runs here (an AVX2 build)."""
    lib = native_library()
    return lib is not None and bool(lib.sparsa_bitmask_has_panel_f32())


def has_amx() -> bool:
    """Whether the ``"amx"`` strategy's tiles run here (AMX-BF16 and VBMI2, build, ``SPARSA_ISA`` and the
    kernel's self-check)."""
    lib = native_library()
    return lib is not None and bool(lib.sparsa_bitmask_has_amx())


def has_fused_f32() -> bool:
    """Whether the ``"fused"`` strategy's kernel runs here (AVX-512, build and ``SPARSA_ISA``)."""
    lib = native_library()
    return lib is not None and bool(lib.sparsa_bitmask_has_fused_f32())


def fused_max_tokens() -> int:
    """The most float32 tokens the ``"fused"`` strategy takes as the dense side on this CPU (the token
    crossover :data:`FUSED_CROSSOVER`); above, ``"expand"``."""
    return token_crossover(FUSED_CROSSOVER)


def amx_status() -> str:
    """Why the ``"amx"`` strategy does or does not run here, in words."""
    lib = native_library()
    if lib is None:
        return "the native kernels are not built here"
    return _amx_tiles.AMX_STATUS.get(int(lib.sparsa_bitmask_amx_status()), "unknown status")


def has_nm24_panel() -> bool:
    """Whether the ``"nm24"`` strategy's 2:4 kernel runs here (AVX512-BF16, build and ``SPARSA_ISA``)."""
    lib = native_library()
    return lib is not None and bool(lib.sparsa_nm24_has_panel_bf16())


def panel_max_density(dtype: torch.dtype, tokens: Optional[int] = None) -> float:
    """The densest weight (kept fraction) of ``dtype`` the panel strategy takes on this CPU for a call of
    ``tokens`` tokens (None: a prefill): its crossover in :mod:`sparsa.crossovers`
    (:data:`BATCH_PANEL_CROSSOVERS` up to :data:`BATCH_MAX_TOKENS` tokens, else :data:`PANEL_CROSSOVERS`;
    measured here by ``sparsa cost --refit``, else the figure measured on this CPU class, else a default);
    0.0 for a dtype without a panel kernel."""
    table = BATCH_PANEL_CROSSOVERS if tokens is not None and tokens <= BATCH_MAX_TOKENS else PANEL_CROSSOVERS
    name = table.get(dtype)
    return 0.0 if name is None else crossover(name)


def stream_max_tokens(dtype: torch.dtype) -> int:
    """The most tokens of ``dtype`` the stream strategy takes on this CPU: its token crossover in
    :mod:`sparsa.crossovers` (:data:`STREAM_CROSSOVERS`; measured here by ``sparsa cost --refit``, else on
    this CPU class, else a default). Fewer tokens than the crossover's grid starts at always stream."""
    name = STREAM_CROSSOVERS.get(dtype)
    if name is None:
        raise ValueError(f"stream_max_tokens: dtype must be one of {list(STREAM_CROSSOVERS)}, got {dtype}")
    return max(token_crossover(name), int(CROSSOVERS[name].grid[0]) - 1)


def row_blocks_max_tokens() -> int:
    """The most tokens a float32 expansion multiplies in row blocks on this CPU (the token crossover
    :data:`ROW_BLOCKS_CROSSOVER`); above, the whole expanded weight and one ``F.linear``."""
    return token_crossover(ROW_BLOCKS_CROSSOVER)


def choose_strategy(tokens: int, dtype: torch.dtype = torch.float32, density: float = 1.0) -> str:
    """``"stream"`` for up to :func:`stream_max_tokens` tokens; above that ``"panel"`` for a weight of at
    most :func:`panel_max_density` kept (at this many tokens) where that dtype's panel kernel runs
    (:func:`has_panel_bf16`, :func:`has_panel_f32`); else :func:`many_token_strategy`'s choice (the dense
    side, :func:`dense_strategy`: ``"amx"``, ``"fused"`` or ``"expand"``)."""
    name = STREAM_CROSSOVERS.get(dtype)
    if name is None:
        raise ValueError(f"choose_strategy: dtype must be one of {list(STREAM_CROSSOVERS)}, got {dtype}")
    # below the crossover's grid no refit decides: the stream loop, without a table read on each decode call
    if tokens < CROSSOVERS[name].grid[0] or tokens <= stream_max_tokens(dtype):
        return "stream"
    return many_token_strategy(tokens, dtype, density)


def many_token_strategy(tokens: int, dtype: torch.dtype = torch.float32, density: float = 1.0) -> str:
    """What :func:`choose_strategy` picks above the stream strategy's tokens: ``"panel"``; for a bf16
    weight too dense for it, up to :data:`BATCH_STREAM_CROSSOVER` tokens, ``"stream"``; else
    :func:`dense_strategy`."""
    has_panel = {torch.bfloat16: has_panel_bf16, torch.float32: has_panel_f32}.get(dtype)
    if has_panel is not None and density <= panel_max_density(dtype, tokens) and has_panel():
        return "panel"
    if dtype == torch.bfloat16 and tokens <= token_crossover(BATCH_STREAM_CROSSOVER):
        return "stream"
    return dense_strategy(tokens, dtype)


def dense_strategy(tokens: int, dtype: torch.dtype = torch.float32) -> str:
    """The strategy that does dense work on the compressed weight for ``tokens`` tokens of ``dtype`` here:
    ``"amx"`` for bfloat16 where the tiles run, ``"fused"`` for float32 up to :func:`fused_max_tokens`
    where its kernel runs, else ``"expand"``."""
    if dtype == torch.bfloat16:
        return "amx" if has_amx() else "expand"
    if dtype == torch.float32 and tokens <= fused_max_tokens() and has_fused_f32():
        return "fused"
    return "expand"


def _stream(
    lib: ctypes.CDLL,
    kind: str,
    x: Tensor,
    bits: Tensor,
    row_ptr: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    R: int,
) -> Tensor:
    """The stream strategy on a contiguous ``x`` of any rank (``[..., K]``, at least one token); the
    result has ``x``'s leading dimensions (a reshape per call would cost a decode call a microsecond)."""
    K = x.shape[-1]
    T = x.numel() // K
    y = torch.empty(*x.shape[:-1], R, dtype=x.dtype)
    b = None if bias is None else bias.contiguous()  # held until the call returns: the kernel reads its memory
    bp = None if b is None else b.data_ptr()
    if kind == "bf16":
        rc = lib.sparsa_bitmask_linear_bf16(
            x.data_ptr(),
            T,
            K,
            bits.data_ptr(),
            row_ptr.data_ptr(),
            values.data_ptr(),
            R,
            bp,
            b is not None and b.dtype == torch.bfloat16,
            y.data_ptr(),
            torch.get_num_threads(),
            _stream_path(),
        )
    else:
        rc = lib.sparsa_bitmask_linear_f32(
            x.data_ptr(),
            T,
            K,
            bits.data_ptr(),
            row_ptr.data_ptr(),
            values.data_ptr(),
            R,
            bp,
            y.data_ptr(),
            torch.get_num_threads(),
            _stream_path(),
        )
    if rc == -4:
        raise RuntimeError(
            f"bitmask stream kernel: row loop STREAM_PATH={STREAM_PATH!r} takes bfloat16 operands only, got "
            f"{x.dtype}; use 'auto' or a float32 loop"
        )
    if rc:
        raise RuntimeError(
            f"bitmask stream kernel: row loop STREAM_PATH={STREAM_PATH!r} is not available on this CPU or build "
            f"(code {rc}); use 'auto'"
        )
    return y


_SCRATCH = threading.local()


def _scratch(n: int, dtype: torch.dtype) -> Tensor:
    """``n`` elements of a per-thread buffer kept between calls (at most ``_WHOLE_BYTES``): a fresh tensor
    of tens of MiB per layer would be new pages from the OS on every call, whose page faults can cost as
    much as the GEMM."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < n:
        buf = torch.empty(n, dtype=dtype)
        _SCRATCH.buf = buf
    return buf[:n]


def _expand(
    lib: ctypes.CDLL,
    kind: str,
    x2: Tensor,
    bits: Tensor,
    row_ptr: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    R: int,
    whole: Optional[bool] = None,
) -> Tensor:
    """The expand strategy; ``whole``: expand the whole weight for one ``F.linear`` (True), or multiply row
    blocks (False); None: the whole weight for a bf16 GEMM or above :func:`row_blocks_max_tokens`
    (either way only if its dense copy fits ``_WHOLE_BYTES``)."""
    T, K = x2.shape
    gemm_dtype = torch.bfloat16 if kind == "bf16" and _bf16_gemm_hardware() else torch.float32
    xg = x2 if x2.dtype == gemm_dtype else x2.to(gemm_dtype)
    item = 2 if gemm_dtype == torch.bfloat16 else 4
    nt = torch.get_num_threads()
    if whole is None:
        whole = gemm_dtype == torch.bfloat16 or T > row_blocks_max_tokens()
    if whole and R * K * item <= _WHOLE_BYTES:
        dense = _scratch(R * K, gemm_dtype).view(R, K)
        lib.sparsa_bitmask_expand(
            bits.data_ptr(),
            row_ptr.data_ptr(),
            values.data_ptr(),
            int(kind == "bf16"),
            R,
            K,
            0,
            R,
            dense.data_ptr(),
            int(gemm_dtype == torch.bfloat16),
            nt,
        )
        return torch.nn.functional.linear(xg, dense, None if bias is None else bias.to(gemm_dtype)).to(x2.dtype)
    rows = max(8, min(R, _BLOCK_BYTES // max(1, K * item)))
    buf = torch.empty(rows, K, dtype=gemm_dtype)
    yt = torch.empty(R, T, dtype=gemm_dtype)
    for r0 in range(0, R, rows):
        r1 = min(R, r0 + rows)
        blk = buf[: r1 - r0]
        lib.sparsa_bitmask_expand(
            bits.data_ptr(),
            row_ptr.data_ptr(),
            values.data_ptr(),
            int(kind == "bf16"),
            R,
            K,
            r0,
            r1,
            blk.data_ptr(),
            int(gemm_dtype == torch.bfloat16),
            nt,
        )
        torch.mm(blk, xg.t(), out=yt[r0:r1])
    y = yt.t()
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x2.dtype).contiguous()


def _panel(
    lib: ctypes.CDLL,
    kind: str,
    x2: Tensor,
    bits: Tensor,
    row_ptr: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    R: int,
    activation: str = "none",
) -> Tensor:
    """The panel strategy, with ``activation`` in the kernel's epilogue (after the fallback to expand)."""
    if kind not in ("bf16", "f32"):
        return activate(_expand(lib, kind, x2, bits, row_ptr, values, bias, R), activation)
    entry = lib.sparsa_bitmask_panel_bf16 if kind == "bf16" else lib.sparsa_bitmask_panel_f32
    rc, y = bitmask_rows_call(entry, x2, bits, row_ptr, values, bias, R, activation_code(activation))
    if rc == 0:
        return y
    # 1: X holds NaN or Inf; -1: no panel kernel here (CPU, build, SPARSA_ISA) or K > 65535
    return activate(_expand(lib, kind, x2, bits, row_ptr, values, bias, R), activation)


def _amx(
    lib: ctypes.CDLL,
    kind: str,
    x2: Tensor,
    bits: Tensor,
    row_ptr: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    R: int,
    activation: str = "none",
) -> Tensor:
    """The AMX strategy, with ``activation`` in the tiles' epilogue (after the fallback to expand)."""
    act = activation_code(activation)
    y = _amx_tiles.run(lib, x2, bits, row_ptr, values, bias, R, act) if kind == "bf16" else None
    # None: float32 tokens or weights, or no AMX tiles here (CPU, build, SPARSA_ISA)
    return y if y is not None else activate(_expand(lib, kind, x2, bits, row_ptr, values, bias, R), activation)


def _fused(
    lib: ctypes.CDLL,
    kind: str,
    x2: Tensor,
    bits: Tensor,
    row_ptr: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    R: int,
    activation: str = "none",
) -> Tensor:
    """The fused strategy, with ``activation`` in the kernel's epilogue (after the fallback to expand)."""
    if kind == "f32":
        rc, y = bitmask_rows_call(
            lib.sparsa_bitmask_fused_f32, x2, bits, row_ptr, values, bias, R, activation_code(activation)
        )
        if rc == 0:
            return y
    # bfloat16 operands, or no fused kernel here (CPU, build, SPARSA_ISA)
    return activate(_expand(lib, kind, x2, bits, row_ptr, values, bias, R), activation)


def _nm24_strategy(
    lib: ctypes.CDLL,
    kind: str,
    x2: Tensor,
    bits: Tensor,
    row_ptr: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    R: int,
) -> Tensor:
    K = x2.shape[1]
    ok = kind == "bf16" and values.numel() * 2 == R * K and _nm24.is_2_4(bits, K)
    if ok and bool(lib.sparsa_nm24_has_panel_bf16()):
        y = _nm24.run_panel(lib, x2, bits, values, bias, R)
        if y is not None:
            return y
    # not a 2:4 pattern, no kernel here, or X holds NaN or Inf (the panel strategy hands that to expand)
    return _panel(lib, kind, x2, bits, row_ptr, values, bias, R)


#: fewer tokens always stream (stream_max_tokens is at least one below its crossover's grid): a decode call
#: of that many skips the 2:4 check
_ALWAYS_STREAM_BELOW = min(int(CROSSOVERS[n].grid[0]) for n in STREAM_CROSSOVERS.values())


def _takes_nm24(
    T: int, kind: Optional[str], x_dtype: torch.dtype, bits: Tensor, values: Tensor, R: int, K: int
) -> bool:
    """Whether the automatic choice runs ``"nm24"``: more tokens than the stream loop's own (decoding keeps
    it) and than the crossover ``nm24.panel_bf16``, bf16, a 2:4 pattern, the kernel here."""
    return (
        kind == "bf16"
        and _nm24.wants_panel(T, x_dtype)
        and T > stream_max_tokens(x_dtype)
        and values.numel() * 2 == R * K
        and has_nm24_panel()
        and _nm24.is_2_4(bits, K)
    )


def _auto(T: int, kind: str, x_dtype: torch.dtype, bits: Tensor, values: Tensor, R: int, K: int) -> str:
    """:func:`choose_strategy`, or ``"nm24"`` (:func:`_takes_nm24`)."""
    if _takes_nm24(T, kind, x_dtype, bits, values, R, K):
        return "nm24"
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    return choose_strategy(T, dtype, _density(values, R, K))


def _density(values: Tensor, R: int, K: int) -> float:
    """The kept fraction the strategy choice compares with the density crossovers
    (:func:`sparsa.crossovers.nominal_density`)."""
    return nominal_density(values.numel(), R * K)


def auto_strategy(
    tokens: int, dtype: torch.dtype, bits: Tensor, values: Tensor, out_features: int, in_features: int
) -> str:
    """The strategy the op's automatic choice runs for ``tokens`` tokens of ``dtype`` (bfloat16 or float32) on
    these components (on this CPU and build): :func:`choose_strategy`, or ``"nm24"`` for a 2:4 pattern."""
    if dtype not in STREAM_CROSSOVERS:
        raise ValueError(f"auto_strategy: dtype must be one of {list(STREAM_CROSSOVERS)}, got {dtype}")
    kind = "bf16" if dtype == torch.bfloat16 else "f32"
    return _auto(tokens, kind, dtype, bits, values, out_features, in_features)


def bitmask_linear_impl(
    x: Tensor,
    bits: Tensor,
    row_ptr: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    strategy: str = "auto",
    activation: str = "none",
) -> Tensor:
    """Eager implementation (what the custom op runs): a native strategy if possible, else the reference.
    ``activation``: ``"none"`` or ``"gelu"`` (erf form) on the result, in the epilogue of the panel and AMX
    kernels, after the others.
    ``strategy``: ``"auto"`` (:func:`choose_strategy`; ``"nm24"`` for a 2:4 pattern above its crossover),
    ``"stream"``, ``"expand"``, ``"panel"`` (a CPU or build without that dtype's panel kernel, or an X
    holding NaN or Inf, runs ``"expand"``), ``"nm24"`` (anything but a bf16 2:4 pattern on a CPU with its
    kernel, or an X holding NaN or Inf, runs ``"panel"``), ``"amx"`` (anything but bf16 on a CPU with AMX
    runs ``"expand"``) or ``"fused"`` (anything but float32 on a CPU with AVX-512 runs ``"expand"``)."""
    if strategy not in ("auto",) + STRATEGIES:
        raise ValueError(f"strategy must be 'auto' or one of {STRATEGIES}, got {strategy!r}")
    activation_code(activation, "bitmask_linear")
    kind = native_kind(x, values, bias)
    lib = None if kind is None else native_library()
    if lib is None:
        return activate(bitmask_linear_reference(x, bits, row_ptr, values, bias, out_features), activation).contiguous()
    K = x.shape[-1]
    if x.numel() == 0 or out_features == 0:  # no tokens, or K == 0: the sum over no columns is zero
        return activate(
            x.new_zeros(*x.shape[:-1], out_features) + (0 if bias is None else bias.to(x.dtype)), activation
        )
    T = x.numel() // K
    if strategy == "auto":  # below every crossover's grid the choice is the stream loop (no table reads)
        strategy = "stream" if T < _ALWAYS_STREAM_BELOW else _auto(T, kind, x.dtype, bits, values, out_features, K)
    if strategy == "stream":  # takes any rank: no reshape round trip on a decode call
        y = _stream(
            lib, kind, x.contiguous(), bits.contiguous(), row_ptr.contiguous(), values.contiguous(), bias, out_features
        )
        return activate(y, activation)
    flat = x.dim() != 2  # a 2-D input needs no reshape round trip
    x2 = (x.reshape(-1, K) if flat else x).contiguous()
    comps = (bits.contiguous(), row_ptr.contiguous(), values.contiguous(), bias, out_features)
    if strategy in ("panel", "amx", "fused"):  # the activation in the kernel's epilogue
        y = {"panel": _panel, "amx": _amx, "fused": _fused}[strategy](lib, kind, x2, *comps, activation)
    else:
        y = activate({"expand": _expand, "nm24": _nm24_strategy}[strategy](lib, kind, x2, *comps), activation)
    return y.reshape(*x.shape[:-1], out_features) if flat else y


@torch.library.custom_op("sparsa::bitmask_linear", mutates_args=())
def bitmask_linear(
    x: Tensor,
    bits: Tensor,
    row_ptr: Tensor,
    values: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    activation: str = "none",
) -> Tensor:
    """``y[..., R] = act(x[..., K] @ W.T + bias)`` for W given by Bitmask components."""
    return bitmask_linear_impl(x, bits, row_ptr, values, bias, out_features, activation=activation)


@bitmask_linear.register_fake
def _forward_fake(x, bits, row_ptr, values, bias, out_features, activation="none"):
    return x.new_empty(*x.shape[:-1], out_features)


_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_tracing_state = torch._C._get_tracing_state


def stream_decode(
    x: Tensor, bits: Tensor, row_ptr: Tensor, values: Tensor, bias: Optional[Tensor], out_features: int
) -> Optional[Tensor]:
    """What :data:`bitmask_linear_kernel` returns for an eager decode call (a stream-sized number of tokens,
    plain contiguous CPU tensors that the native stream kernel takes, no tracer, dispatch mode or autograd
    recording), computed by the stream kernel with only the checks such a call needs; None for any other
    call, which the caller sends to :data:`bitmask_linear_kernel`. The kernel op's generic checks and
    strategy choice cost a decode call about as much as the kernel (``benchmarks/dispatch_overhead.py``)."""
    if not (type(x) is Tensor and type(values) is Tensor and type(bits) is Tensor and type(row_ptr) is Tensor):
        return None
    if bias is not None and type(bias) is not Tensor:
        return None
    if _is_compiling() or _dispatch_modes() or _tracing_state() is not None:
        return None
    if torch.is_grad_enabled() and (
        x.requires_grad or values.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return None
    kind = native_kind(x, values, bias)
    if kind is None or not x.is_contiguous():
        return None
    K = x.shape[-1]
    T = x.numel() // K if K else 0
    if T == 0 or out_features == 0:
        return None
    # the density decides above the stream loop's own token limit (a sparse enough weight takes the panel),
    # and a 2:4 pattern there takes the 2:4 kernel
    if choose_strategy(T, x.dtype, _density(values, out_features, K)) != "stream":
        return None
    if T >= _ALWAYS_STREAM_BELOW and _takes_nm24(T, kind, x.dtype, bits, values, out_features, K):
        return None
    lib = native_library()
    if lib is None:
        return None
    return _stream(lib, kind, x, bits.contiguous(), row_ptr.contiguous(), values.contiguous(), bias, out_features)


# forward-only, low per-call cost (see kernels/opdef.py): the hot path of an autograd.Function that owns the backward
def _kernel_impl(x, bits, row_ptr, values, bias, out_features, activation="none"):
    return bitmask_linear_impl(x, bits, row_ptr, values, bias, out_features, activation=activation)


bitmask_linear_kernel = kernel_op(
    "bitmask_linear_kernel(Tensor x, Tensor bits, Tensor row_ptr, Tensor values, Tensor? bias, int out_features, "
    "str activation='none') -> Tensor",
    _kernel_impl,
    _forward_fake,
)


def linear_forward(
    x: Tensor, bits: Tensor, row_ptr: Tensor, values: Tensor, bias: Optional[Tensor], out_features: int
) -> Tensor:
    """The forward of the dispatcher's linear implementations on these components (Bitmask, N:M):
    :func:`stream_decode` where it takes the call, else :data:`bitmask_linear_kernel`. Like the kernel op,
    it trusts its arguments: the components of a valid layout, x and bias checked against the weight's
    shape (the implementations do both)."""
    y = stream_decode(x, bits, row_ptr, values, bias, out_features)
    return y if y is not None else bitmask_linear_kernel(x, bits, row_ptr, values, bias, out_features)


# ---------------------------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    x, bits, row_ptr, values, bias, out_features, activation = inputs
    ctx.save_for_backward(x, bits, row_ptr, values, bias)
    ctx.out_features, ctx.activation = out_features, activation
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, gy):
    x, bits, row_ptr, values, bias = ctx.saved_tensors
    K = x.shape[-1]
    ct = compute_dtype(gy.dtype, x.dtype, values.dtype)
    if ctx.activation != "none":  # the pre-activation is recomputed rather than kept from the forward
        pre = bitmask_linear(
            x.detach(), bits, row_ptr, values.detach(), None if bias is None else bias.detach(), ctx.out_features
        )
        gy = activation_backward(pre, gy, ctx.activation)
    g2 = gy.reshape(-1, ctx.out_features).to(ct)
    gx = gv = gb = None
    if ctx.needs_input_grad[0]:
        gx = (g2 @ bitmask_dense_weight(bits, row_ptr, values, K, ct)).reshape(x.shape).to(x.dtype)
    if ctx.needs_input_grad[3]:
        gv = (g2.t() @ x.reshape(-1, K).to(ct))[unpack_bits(bits, K)].to(values.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
        gb = g2.sum(0).to(ctx.bias_dtype)
    return gx, None, None, gv, gb, None, None


bitmask_linear.register_autograd(_backward, setup_context=_setup_context)
