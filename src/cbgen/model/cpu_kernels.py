"""CPU kernels written in C, compiled on first use and called through ctypes.

``csrc/cpu_paged.c`` (paged decode attention, KV store), ``csrc/cpu_fused.c`` (residual add +
RMSNorm, rotary embedding, SiLU-and-multiply for :mod:`cbgen.model.fused_decode`) and
``csrc/cpu_gemm.c`` (bf16 projections on AMX, where the CPU has it) and ``csrc/cpu_decoder.c`` (a
whole bf16 decode step built from those) are compiled with the system C compiler (``$CC``, else ``cc``) into
``~/.cache/cbgen/kernels`` (``$CBGEN_KERNEL_DIR`` overrides), keyed by a hash of the source, the
flags and this CPU's feature flags, because ``-march=native`` code must not run on another CPU.
No compiler, or a failed build, leaves :func:`available` false and the torch reference in use.

The two paged kernels are also registered as torch custom ops, so ``torch.compile`` treats them as
opaque calls; the fused path is eager only and calls every kernel directly (a custom op costs tens of
microseconds of dispatch, a ctypes call a few).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from cbgen.model import paged_ops
from cbgen.utils import advise_huge_pages

log = logging.getLogger("cbgen")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("cpu_paged.c", "cpu_fused.c", "cpu_gemm.c", "cpu_decoder.c")]
_HEADERS = [_CSRC / "cbgen_numerics.h"]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
_amx: bool | None = None
_layout: DecoderLayout | None = None


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _cache_dir() -> Path:
    root = os.environ.get("CBGEN_KERNEL_DIR")
    return Path(root) if root else Path.home() / ".cache" / "cbgen" / "kernels"


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found (set CC)")
    source = b"".join(path.read_bytes() for path in [*_SOURCES, *_HEADERS])
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS]).encode() + _cpu_signature().encode())
    target = _cache_dir() / f"cpu_paged-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build under a temporary name and rename: concurrent processes never see half a library.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            proc = subprocess.run(
                [compiler, *_FLAGS, f"-I{_CSRC}", *map(str, _SOURCES), "-o", str(out), "-lm"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
            os.replace(out, target)
        log.info("cbgen: built CPU paged-attention kernels into %s", target)
    lib = ctypes.CDLL(str(target))
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.cbgen_paged_decode.argtypes = [
        ptr,
        i64,
        ptr,
        ptr,
        ptr,
        i64,
        ptr,
        ptr,
        i64,
        i32,
        i32,
        i32,
        i32,
        f32,
        i64,
        f32,
        i32,
        i32,
    ]
    lib.cbgen_paged_decode.restype = i32
    lib.cbgen_store_kv.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i32]
    lib.cbgen_store_kv.restype = i32
    lib.cbgen_add_rmsnorm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, i32]
    lib.cbgen_rope.argtypes = [ptr, ptr, ptr, ptr, i64, i32, i32, i32, i64, i64, i32]
    lib.cbgen_silu_mul.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, i32]
    lib.cbgen_greedy_rows.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i32]
    lib.cbgen_amx_linear.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
    lib.cbgen_amx_init.argtypes = []
    lib.cbgen_decoder_step.argtypes = [ptr, ptr, i32, ptr, f32, *[ptr] * 10, i64, ptr, ptr, i64, i64]
    lib.cbgen_decoder_step.argtypes += [i32, i32, i32, i64, i32]
    lib.cbgen_decoder_layout.argtypes = [ctypes.POINTER(i64), ctypes.POINTER(i64)]
    lib.cbgen_decoder_layout.restype = ctypes.c_char_p
    for fn in (
        lib.cbgen_add_rmsnorm,
        lib.cbgen_rope,
        lib.cbgen_silu_mul,
        lib.cbgen_greedy_rows,
        lib.cbgen_amx_linear,
        lib.cbgen_amx_init,
        lib.cbgen_decoder_step,
    ):
        fn.restype = i32
    return lib


def available() -> bool:
    """True when the kernels are built (building them on the first call) and loadable here."""
    global _lib, _error, _layout
    with _lock:
        if _lib is None and _error is None:
            try:
                lib = _build()
                _layout = _read_layout(lib)
                _lib = lib
            except Exception as exc:  # any failure means "use the torch path", reported once
                _error = str(exc)
                log.warning("cbgen: CPU paged-attention kernels unavailable (%s); using the torch path", exc)
        return _lib is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is false (None when it is true or was never asked)."""
    return _error


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernels handle a cache of ``dtype`` (float16 falls back to torch)."""
    return dtype in _DTYPES


@torch.library.custom_op("cbgen::cpu_paged_decode", mutates_args=())
def _decode_op(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    portable: bool,
) -> torch.Tensor:
    return decode_direct(query, k_cache, v_cache, block_table, seq_lens, scale, window, softcap, portable)


def decode_direct(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    portable: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode kernel without the custom-op layer: ``query [B, H, D]`` of the cache's dtype (heads
    contiguous, any row stride), int32 ``block_table``/``seq_lens``; ``window``/``softcap`` 0 = off.
    ``portable`` forces the plain C loops instead of the AVX-512 ones (for tests).  ``out``: a
    contiguous ``[B, H, D]`` tensor to write into (default: a new one)."""
    num_rows, heads, dim = query.shape
    if out is None:
        out = torch.empty((num_rows, heads, dim), dtype=query.dtype)
    elif not out.is_contiguous() or out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError("out must be a contiguous tensor of the query's shape and dtype")
    rc = _lib.cbgen_paged_decode(
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_rows,
        heads,
        k_cache.shape[2],
        dim,
        k_cache.shape[1],
        scale,
        window,
        softcap,
        _DTYPES[query.dtype],
        1 if portable else 0,
    )
    if rc:
        raise RuntimeError(f"cbgen_paged_decode failed with code {rc}")
    return out


@_decode_op.register_fake
def _(query, k_cache, v_cache, block_table, seq_lens, scale, window, softcap, portable):
    return torch.empty_like(query)


@torch.library.custom_op("cbgen::cpu_store_kv", mutates_args=("k_cache", "v_cache"))
def _store_op(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    store_direct(key, value, k_cache, v_cache, slots)


def store_direct(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """The KV store without the custom-op layer: ``key``/``value`` ``[T, Hkv * D]`` of the cache's
    dtype (rows contiguous, any row stride), int64 ``slots``."""
    row = k_cache.shape[-2] * k_cache.shape[-1]
    _lib.cbgen_store_kv(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        slots.numel(),
        row,
        k_cache.element_size(),
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seq_len: int | None = None,
    portable: bool = False,
) -> torch.Tensor:
    """Same contract as :func:`cbgen.model.paged_ops.paged_decode_attention`, reading KV in place
    (``portable``: see :func:`decode_direct`)."""
    if query.dtype != k_cache.dtype or not supports(k_cache.dtype):
        return paged_ops.paged_decode_attention(
            query, k_cache, v_cache, block_table, seq_lens, scale, sliding_window, softcap, max_seq_len
        )
    return _decode_op(
        query.contiguous(),
        k_cache,
        v_cache,
        block_table.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        float(scale),
        int(sliding_window or 0),
        float(softcap or 0.0),
        bool(portable),
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as :func:`cbgen.model.paged_ops.store_kv` (a slot of -1 writes nowhere)."""
    _store_op(
        key.to(k_cache.dtype).contiguous(),
        value.to(v_cache.dtype).contiguous(),
        k_cache,
        v_cache,
        slot_mapping.to(torch.int64).contiguous(),
    )


# ---------------------------------------------------------------------------------------- fused ops
# Row-major 2-D views (any row stride, unit column stride) of a float32/bfloat16 dtype; the caller
# (fused_decode) guarantees both, so these only move pointers.


def add_rmsnorm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> torch.Tensor:
    """``x += delta`` (skipped when ``delta`` is None), then ``out = weight * rmsnorm(x)``, row-wise."""
    rows, n = x.shape
    _lib.cbgen_add_rmsnorm(
        x.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        n,
        x.stride(0),
        0 if delta is None else delta.stride(0),
        out.stride(0),
        eps,
        _DTYPES[x.dtype],
    )
    return out


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    """Rotate-half rotary embedding in place on ``q [T, H*D]`` and ``k [T, Hk*D]`` (``cos``/``sin``
    contiguous ``[T, D]``)."""
    tokens = q.shape[0]
    _lib.cbgen_rope(
        q.data_ptr(),
        k.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        tokens,
        q.shape[1] // head_dim,
        k.shape[1] // head_dim,
        head_dim,
        q.stride(0),
        k.stride(0),
        _DTYPES[q.dtype],
    )


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = silu(gate) * up`` row-wise."""
    rows, n = gate.shape
    _lib.cbgen_silu_mul(
        gate.data_ptr(),
        up.data_ptr(),
        out.data_ptr(),
        rows,
        n,
        gate.stride(0),
        up.stride(0),
        out.stride(0),
        _DTYPES[gate.dtype],
    )
    return out


def greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row of float32 or bfloat16 ``logits [B, V]`` (unit column stride): the first index of
    its maximum (NaN counts as the maximum), the maximum (float32), and its log-sum-exp in float64
    (NaN / +-inf when the maximum is not finite)."""
    rows, vocab = logits.shape
    argmax = torch.empty(rows, dtype=torch.int64)
    maxv = torch.empty(rows, dtype=torch.float32)
    lse = torch.empty(rows, dtype=torch.float64)
    rc = _lib.cbgen_greedy_rows(
        logits.data_ptr(),
        rows,
        vocab,
        logits.stride(0),
        argmax.data_ptr(),
        maxv.data_ptr(),
        lse.data_ptr(),
        _DTYPES[logits.dtype],
    )
    if rc:
        raise MemoryError("cbgen_greedy_rows could not allocate its row buffer")
    return argmax, maxv, lse


# ------------------------------------------------------------------------------------------- AMX GEMM


def amx_available() -> bool:
    """Whether the bf16 AMX projections of ``csrc/cpu_gemm.c`` run here: the kernels are built for a
    CPU with AMX-BF16 and the OS granted this process the tile state."""
    global _amx
    if _amx is None:
        _amx = available() and os.environ.get("CBGEN_AMX", "1") != "0" and _lib.cbgen_amx_init() == 1
    return _amx


def amx_supports(weight: torch.Tensor) -> bool:
    """Whether :func:`amx_pack` takes ``weight`` (bf16 ``[N, K]`` with N and K multiples of 32)."""
    return (
        weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and not weight.shape[0] % 32
        and not weight.shape[1] % 32
    )


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` rearranged into the tile layout :func:`amx_linear` streams (a copy, on huge
    pages where granted; see ``csrc/cpu_gemm.c``)."""
    n, k = weight.shape
    tiles = weight.detach().view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return advise_huge_pages(torch.empty(tiles.shape, dtype=weight.dtype)).copy_(tiles)


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from ``packed = amx_pack(weight)``; ``x [M, K]`` bf16 with unit
    column stride, ``bias`` bf16 or None."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = packed.shape[0] * 32
    out = torch.empty((rows, n), dtype=x.dtype)
    rc = _lib.cbgen_amx_linear(
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        rows,
        n,
        k,
    )
    if rc:
        raise RuntimeError(
            f"cbgen_amx_linear failed with code {rc} for x {tuple(x.shape)}, weight [{n}, {k}]"
        )
    return out


@dataclass(frozen=True)
class DecoderLayout:
    """The layer records of :func:`decoder_step`: ``words`` int64 and ``floats`` float32 entries a
    layer, whose first entries are the named fields in order.

    ``csrc/cpu_decoder.c`` defines the layout (one field list that makes its enums) and the library
    reports it when it loads (:func:`decoder_layout`): the C source stays the one place it is written
    down, and the build needs no generated header.  Python names the fields it fills, and
    :meth:`records` refuses any other set of names, so a field added, dropped or moved in C fails at
    the first record built instead of being read from the wrong slot."""

    words: int
    floats: int
    word_fields: tuple[str, ...]
    float_fields: tuple[str, ...]

    def records(
        self, words: list[dict[str, int]], floats: list[dict[str, float]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``words [L, self.words]`` and ``floats [L, self.floats]`` from each layer's field values by
        name (every field exactly once; unused entries zero)."""
        return (
            _records(words, self.word_fields, self.words, torch.int64),
            _records(floats, self.float_fields, self.floats, torch.float32),
        )


def _records(rows: list[dict], fields: tuple[str, ...], width: int, dtype: torch.dtype) -> torch.Tensor:
    table = []
    for row in rows:
        if row.keys() != set(fields):
            raise ValueError(f"decoder record fields {sorted(row)} are not the library's {list(fields)}")
        table.append([row[name] for name in fields] + [0] * (width - len(fields)))
    return torch.tensor(table, dtype=dtype).reshape(len(rows), width)


def _read_layout(lib: ctypes.CDLL) -> DecoderLayout:
    words, floats = ctypes.c_int64(), ctypes.c_int64()
    text = lib.cbgen_decoder_layout(ctypes.byref(words), ctypes.byref(floats)).decode()
    word_part, float_part = text.split(";")
    layout = DecoderLayout(words.value, floats.value, tuple(word_part.split()), tuple(float_part.split()))
    if len(layout.word_fields) > layout.words or len(layout.float_fields) > layout.floats:
        raise RuntimeError(f"cbgen_decoder_layout reports more fields than record entries: {layout}")
    return layout


def decoder_layout() -> DecoderLayout:
    """The layer-record layout of :func:`decoder_step` (the kernels must be :func:`available`)."""
    if _layout is None:
        raise RuntimeError("the CPU kernels are not loaded")
    return _layout


def decoder_step(
    words: torch.Tensor,
    floats: torch.Tensor,
    first_norm: tuple[torch.Tensor, float],
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    block_size: int,
) -> torch.Tensor:
    """Runs every decoder layer of a bf16 decode step in C (``csrc/cpu_decoder.c``) over the
    residual stream ``hidden [T, E]`` (updated in place) and returns the final norm's output
    ``[T, E]``.  ``words`` / ``floats`` describe the layers (:meth:`DecoderLayout.records`)."""
    tokens, width = hidden.shape
    qd, kd = heads * head_dim, kv_heads * head_dim
    x = torch.empty_like(hidden)
    qkv = hidden.new_empty((tokens, qd + 2 * kd))
    attn = hidden.new_empty((tokens, qd))
    gate_up = hidden.new_empty((tokens, 2 * intermediate))
    act = hidden.new_empty((tokens, intermediate))
    delta = torch.empty_like(hidden)
    rc = _lib.cbgen_decoder_step(
        words.data_ptr(),
        floats.data_ptr(),
        words.shape[0],
        first_norm[0].data_ptr(),
        first_norm[1],
        hidden.data_ptr(),
        x.data_ptr(),
        qkv.data_ptr(),
        attn.data_ptr(),
        gate_up.data_ptr(),
        act.data_ptr(),
        delta.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        table.data_ptr(),
        table.stride(0),
        seq_lens.data_ptr(),
        slots.data_ptr(),
        tokens,
        width,
        heads,
        kv_heads,
        head_dim,
        intermediate,
        block_size,
    )
    if rc:
        layer, stage = divmod(rc - 1, 16)
        raise RuntimeError(f"cbgen_decoder_step failed in layer {layer}, stage {stage}")
    return x
