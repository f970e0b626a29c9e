"""CPU kernels written in C, compiled on first use and called through ctypes.

``csrc/cpu_paged.c`` (paged decode attention, KV store), ``csrc/cpu_fused.c`` (residual add +
RMSNorm, rotary embedding, SiLU-and-multiply for :mod:`cbgen.model.cpu_fast.fused_forward`),
``csrc/cpu_gemm.c`` (bf16 projections on AMX, where the CPU has it), ``csrc/cpu_parity*.c`` (parity
mode's GEMM, attention and exact elementwise steps) and ``csrc/cpu_decoder.c`` (a whole bf16 decode
step built from those) are compiled with the system C compiler (``$CC``, else ``cc``) into
``~/.cache/cbgen/kernels`` (``$CBGEN_KERNEL_DIR`` overrides), keyed by a hash of the source, the
flags and this CPU's feature flags, because ``-march=native`` code must not run on another CPU.
No compiler, or a failed build, leaves :func:`available` false and the torch reference in use,
unless ``CBGEN_REQUIRE_KERNELS=1`` (``make test``): then :func:`available` raises with the build
error, so a run that claims to test the kernels cannot quietly test the fallback instead.

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from cbgen import envs
from cbgen.model.kernels.arg_checks import check_decode, check_rows, check_store

log = logging.getLogger("cbgen")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / name
    for name in (
        "cpu_paged.c",
        "cpu_fused.c",
        "cpu_gemm.c",
        "cpu_decoder.c",
        "cpu_gemv.c",
        "cpu_panel.c",
        "cpu_panel512.c",
        "cpu_parity.c",
        "cpu_parity_rows.c",
        "cpu_state.c",
    )
]
_HEADERS = [_CSRC / "cbgen_numerics.h", _CSRC / "cbgen_ranges.h", _CSRC / "cbgen_paged.h"]
# Which decode-attention loops cbgen_paged_decode runs (its ``impl`` argument), and a flag added to
# them: the vector loops' prefetches go into L2 rather than non-temporally into L1.
IMPL_FAST, IMPL_PORTABLE, IMPL_AVX2 = 0, 1, 2
IMPL_PREFETCH_L2 = 4
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c11"]
# CBGEN_SANITIZE=address: a separate build of the same sources (the flags are part of the cache key)
# whose out-of-bounds accesses abort with a report.  The Python process must preload the runtime:
# LD_PRELOAD=$(cc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 (see `make test-asan`).
# It is built at -O1, as ASan's authors advise: with instrumentation, -O3 took 62 s for cpu_paged.c
# alone on a Zen 4 core and over the old 120 s bound on a slower CI machine, -O1 11 s.  The
# sanitized run checks memory accesses: its tests compare against references with tolerances, or
# bits that no `omp simd` reduction (vectorised at -O3 only) reaches.
_SANITIZE_FLAGS = {"address": ["-O1", "-fsanitize=address", "-fno-omit-frame-pointer", "-g"]}
# A bound on one compiler process, far past any normal build (cpu_paged.c, the largest, takes ~30 s
# at -O3 on one Zen 4 core), so that only a hung compiler trips it.
_COMPILE_TIMEOUT_S = 900
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _cache_dir() -> Path:
    root = envs.get("CBGEN_KERNEL_DIR")
    return Path(root) if root else Path.home() / ".cache" / "cbgen" / "kernels"


# Every entry point's arguments, one letter each: p pointer, l int64, i int32, f float32.  All return
# an int32 status, except cbgen_decoder_layout (declared apart).
_SIGNATURES = {
    # q, q_stride, k, v, table, table_stride, table_width, seq_lens, out, B, H, Hkv, D, Dv, bs,
    # num_blocks, scale, window, softcap, dtype, impl
    "cbgen_paged_decode": "plpppllppliiiiilflfii",
    # key, its stride, value, its stride, k_cache, v_cache, slots, T, K row, V row, element size, slots
    "cbgen_store_kv": "plplppplllil",
    "cbgen_add_rmsnorm": "pppplllllfi",
    "cbgen_rope": "ppppliiilli",
    "cbgen_silu_mul": "pppllllli",
    "cbgen_greedy_rows": "plllpppi",
    "cbgen_amx_linear": "plpppllll",
    "cbgen_amx_init": "",
    "cbgen_decoder_step": "ppipfppppppppppllpplliiililiiip",
    "cbgen_decoder_stages": "",
    "cbgen_decode_loops": "",
    "cbgen_gemv": "plplpplllli",
    "cbgen_panel_pack": "plllipli",
    "cbgen_panel_gemm": "plplppllllii",
    "cbgen_p512_pack": "plllpl",
    "cbgen_dp_pack": "plllpl",
    # x, its stride, packed, its size, bias, out, its stride, M, N, K
    "cbgen_p512_gemm": "plplppllll",
    "cbgen_dp_gemm": "plplppllll",
    "cbgen_p512_built": "",
    # q, q row/head stride, k, v, kv block/slot/head stride, num_blocks, block_size, table, its
    # stride, width, rows, seq_start, row_seq, row_pos, out, out row stride, T, H, Hkv, D, scale,
    # window, softcap, dtype
    "cbgen_parity_attention": "pllpplllllplllpppplllllflfi",
    # logits, their row stride, rows, vocab, token ids, out, dtype
    "cbgen_parity_token_logprobs": "plllppi",
    # h, its stride, o, its stride, out, its stride, sq, rows, n, dtype
    "cbgen_parity_add_square": "plplplplli",
    # x, its stride, var, eps, weight, out, its stride, rows, n, dtype
    "cbgen_parity_norm_apply": "plpfppllli",
    # x, its row stride, heads, d, cos, sin, their row stride, out, its row stride, rows, dtype
    "cbgen_parity_rope": "plllpplplli",
    # a, its stride, b, its stride, out, its stride, rows, n, dtype
    "cbgen_parity_mul": "plplpllli",
    # gate_up, its stride, inter, out, its stride, rows, torch's vector exp, its width, dtype
    "cbgen_parity_silu_mul": "pllpllpii",
    # q, k, v, exp(decay), beta, states, num_slots, slots, out, B, H, Hk, T, dk, dv, split
    "cbgen_gdn_recurrent": "pppppplpplllllll",
    # x, its row stride, states, num_slots, slots, width, weight, bias (or NULL), out, B, C, K
    "cbgen_conv_update": "plplplppplll",
}
_CTYPES = {"p": ctypes.c_void_p, "l": ctypes.c_int64, "i": ctypes.c_int, "f": ctypes.c_float}


def _build() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_compile()))
    _declare(lib)
    return lib


def _compile() -> Path:
    """The shared library for these sources, flags, compiler and CPU: from the cache, else built."""
    compiler = envs.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found (set CC)")
    sanitize = envs.get("CBGEN_SANITIZE") or ""
    if sanitize and sanitize not in _SANITIZE_FLAGS:
        raise RuntimeError(f"CBGEN_SANITIZE={sanitize!r}: only 'address' is supported")
    flags = [*_FLAGS, *_SANITIZE_FLAGS.get(sanitize, [])]
    source = b"".join(path.read_bytes() for path in [*_SOURCES, *_HEADERS])
    key = hashlib.sha256(source + " ".join([compiler, *flags]).encode() + _cpu_signature().encode())
    target = _cache_dir() / f"cpu_paged-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build under a temporary name and rename: concurrent processes never see half a library.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            objects = _compile_objects(compiler, flags, Path(tmp))
            _run([compiler, *flags, "-shared", *map(str, objects), "-o", str(out), "-lm"], compiler)
            os.replace(out, target)
        log.info("cbgen: built CPU paged-attention kernels into %s", target)
    return target


def _compile_objects(compiler: str, flags: list[str], into: Path) -> list[Path]:
    """One object per source, compiled side by side on this machine's cores (the first build's wall
    time is the largest file's, not the sum)."""
    objects = [into / (path.stem + ".o") for path in _SOURCES]
    jobs = [
        [compiler, *flags, f"-I{_CSRC}", "-c", str(path), "-o", str(obj)]
        for path, obj in zip(_SOURCES, objects, strict=True)
    ]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda cmd: _run(cmd, compiler), jobs))
    return objects


def _run(cmd: list[str], compiler: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")


def _declare(lib: ctypes.CDLL) -> None:
    """Every entry point's argument and return types (ctypes would guess ints otherwise)."""
    for name, letters in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = [_CTYPES[c] for c in letters]
        fn.restype = ctypes.c_int
    lib.cbgen_decoder_layout.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    lib.cbgen_decoder_layout.restype = ctypes.c_char_p


def available() -> bool:
    """True when the kernels are built (building them on the first call) and loadable here.

    Raises :class:`KernelsRequiredError` instead of returning False when ``CBGEN_REQUIRE_KERNELS=1``."""
    global _lib, _error
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib = _build()
            except Exception as exc:  # any failure means "use the torch path", reported once
                _error = f"{type(exc).__name__}: {exc}"
                log.warning("cbgen: CPU paged-attention kernels unavailable (%s); using the torch path", exc)
        if _lib is None and envs.flag("CBGEN_REQUIRE_KERNELS"):
            raise KernelsRequiredError(f"CBGEN_REQUIRE_KERNELS=1, but the C kernels did not build: {_error}")
        return _lib is not None


class KernelsRequiredError(RuntimeError):
    """The C kernels did not build although ``CBGEN_REQUIRE_KERNELS=1`` requires them."""


def library() -> ctypes.CDLL:
    """The loaded kernel library (for the modules that wrap its other entry points)."""
    if not available():
        raise RuntimeError(f"the CPU kernels are not available: {_error}")
    return _lib


def unavailable_reason() -> str | None:
    """Why :func:`available` is false (None when it is true or was never asked)."""
    return _error


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernels handle a cache of ``dtype`` (float32, bfloat16; the plan gives others torch)."""
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
    impl: int,
) -> torch.Tensor:
    return decode_direct(query, k_cache, v_cache, block_table, seq_lens, scale, window, softcap, impl)


def decode_direct(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    impl: int = IMPL_FAST,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode kernel without the custom-op layer: ``query [B, H, D]`` of the cache's dtype (heads
    contiguous, any row stride), int32 ``block_table``/``seq_lens``; ``window``/``softcap`` 0 = off.
    ``impl``: :data:`IMPL_FAST` (the fastest loops this build has), :data:`IMPL_PORTABLE` (the plain C
    loops) or :data:`IMPL_AVX2` (the AVX2 loops even where AVX-512 ones exist), plus
    :data:`IMPL_PREFETCH_L2` for the vector loops to prefetch into L2; tests compare them.  ``out``: a
    contiguous ``[B, H, D]`` tensor to write into (default: a new one)."""
    check_decode(query, k_cache, v_cache, block_table, seq_lens, mixed=True)
    if query.dtype not in _DTYPES or query.dtype != k_cache.dtype or query.device.type != "cpu":
        raise ValueError(
            f"query and cache must be float32 or bfloat16 CPU tensors of one dtype, got {query.dtype}"
        )
    num_rows, heads, dim = query.shape
    v_dim = v_cache.shape[-1]
    if out is None:
        out = torch.empty((num_rows, heads, v_dim), dtype=query.dtype)
    elif not out.is_contiguous() or out.shape != (num_rows, heads, v_dim) or out.dtype != query.dtype:
        raise ValueError("out must be a contiguous [B, H, value head size] tensor of the query's dtype")
    rc = _lib.cbgen_paged_decode(
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.stride(0),
        block_table.shape[1],
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_rows,
        heads,
        k_cache.shape[2],
        dim,
        v_dim,
        k_cache.shape[1],
        k_cache.shape[0],
        scale,
        window,
        softcap,
        _DTYPES[query.dtype],
        int(impl),
    )
    if rc:
        raise _decode_error(rc)
    return out


def _decode_error(rc: int) -> Exception:
    if rc == 4:
        return ValueError(
            "cbgen_paged_decode: a block id or sequence length lies outside the cache or its table"
        )
    if rc == 3:
        return MemoryError("cbgen_paged_decode could not allocate its work buffers")
    return ValueError(f"cbgen_paged_decode rejected its sizes or loops (code {rc})")


@_decode_op.register_fake
def _(query, k_cache, v_cache, block_table, seq_lens, scale, window, softcap, impl):
    return query.new_empty((*query.shape[:-1], v_cache.shape[-1]))


@torch.library.custom_op("cbgen::cpu_store_kv", mutates_args=("k_cache", "v_cache"))
def _store_op(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    store_direct(key, value, k_cache, v_cache, slots)


def store_direct(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """The KV store without the custom-op layer: ``key [T, Hkv * D]`` and ``value [T, Hkv * Dv]``
    of the cache's dtype (rows contiguous, any row stride), int64 ``slots`` (-1: nowhere)."""
    check_store(key, value, k_cache, v_cache, slots, mixed=True)
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype or k_cache.device.type != "cpu":
        raise ValueError(
            f"key/value ({key.dtype}, {value.dtype}) must have the cache's dtype {k_cache.dtype}"
        )
    row = k_cache.shape[-2] * k_cache.shape[-1]
    rc = _lib.cbgen_store_kv(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        slots.numel(),
        row,
        v_cache.shape[-2] * v_cache.shape[-1],
        k_cache.element_size(),
        k_cache.shape[0] * k_cache.shape[1],
    )
    if rc:
        raise ValueError("cbgen_store_kv: a slot lies outside the cache")


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
    impl: int = IMPL_FAST,
) -> torch.Tensor:
    """Same contract as :func:`cbgen.model.kernels.reference.paged_ops.paged_decode_attention`, reading KV in place
    (``impl``: see :func:`decode_direct`), for a float32 or bfloat16 query and cache of one dtype.
    Other dtypes are refused, not sent elsewhere: the execution plan (:mod:`cbgen.model.plan`) gives
    them the torch backend."""
    if query.dtype != k_cache.dtype or not supports(k_cache.dtype):
        raise ValueError(
            f"the C decode kernel takes a float32 or bfloat16 query and cache of one dtype, got "
            f"{query.dtype} and {k_cache.dtype} (the torch backend attends other dtypes)"
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
        int(impl),
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as :func:`cbgen.model.kernels.reference.paged_ops.store_kv` (a slot of -1 writes nowhere)."""
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
    dtype = _dtype_of(x)
    check_rows("out", out, rows, n, dtype)
    if delta is not None:
        check_rows("delta", delta, rows, n, dtype)
    check_rows("weight", weight.view(1, -1), 1, n, dtype)
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
    dtype = _dtype_of(q)
    if (
        head_dim <= 0
        or head_dim % 2
        or q.dim() != 2
        or q.shape[1] % head_dim
        or k.dim() != 2
        or k.shape[1] % head_dim
    ):
        raise ValueError(
            f"rope_: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads * {head_dim}] (even)"
        )
    check_rows("q", q, tokens, q.shape[1], dtype)
    check_rows("k", k, tokens, k.shape[1], dtype)
    for name, t in (("cos", cos), ("sin", sin)):
        check_rows(name, t, tokens, head_dim, dtype)
        if not t.is_contiguous():
            raise ValueError(f"rope_: {name} must be contiguous")
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
    dtype = _dtype_of(gate)
    check_rows("up", up, rows, n, dtype)
    check_rows("out", out, rows, n, dtype)
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
    if logits.dim() != 2:
        raise ValueError(f"greedy_rows: logits must be [B, V], got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    check_rows("logits", logits, rows, vocab, _dtype_of(logits))
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


# The most rows cbgen_gemv takes (its x rows stay in L1 while a group of weight rows streams past).
GEMV_MAX_ROWS = 8


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most :data:`GEMV_MAX_ROWS` rows, reading ``weight``
    (``[N, K]``, contiguous rows) once, straight from memory; float32 or bfloat16, all one dtype."""
    rows, k = x.shape
    dtype = _dtype_of(x)
    if not 1 <= rows <= GEMV_MAX_ROWS:
        raise ValueError(f"cbgen_gemv takes 1-{GEMV_MAX_ROWS} rows, got {rows}")
    n = weight.shape[0]
    check_rows("x", x, rows, k, dtype)
    check_rows("weight", weight, n, k, dtype)
    if bias is not None:
        check_rows("bias", bias.view(1, -1), 1, n, dtype)
    out = torch.empty(rows, n, dtype=dtype)
    rc = _lib.cbgen_gemv(
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        weight.stride(0),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        rows,
        n,
        k,
        _DTYPES[dtype],
    )
    if rc:
        raise ValueError(f"cbgen_gemv rejected its sizes (rows {rows}, N {n}, K {k})")
    return out


def _dtype_of(t: torch.Tensor) -> torch.dtype:
    if t.dtype not in _DTYPES:
        raise ValueError(f"the CPU kernels take float32 or bfloat16 tensors, got {t.dtype}")
    return t.dtype
