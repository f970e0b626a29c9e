"""The bf16 AMX projections (``csrc/cpu_gemm.c``) and the one-call bf16 decode step
(``csrc/cpu_decoder.c``), wrapped for :mod:`cbgen.model.fused_decode`.

They live in the same library as the paged-attention kernels (:mod:`cbgen.model.cpu_kernels`
builds and loads it); this module only adds their Python entry points, each of which checks its
arguments before calling into C.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from cbgen import envs
from cbgen.model.arg_checks import check_rows
from cbgen.model.cpu_kernels import available, library
from cbgen.utils import advise_huge_pages

_amx: bool | None = None
_layout: DecoderLayout | None = None


def amx_available() -> bool:
    """Whether the bf16 AMX projections of ``csrc/cpu_gemm.c`` run here: the kernels are built for a
    CPU with AMX-BF16 and the OS granted this process the tile state."""
    global _amx
    if _amx is None:
        _amx = available() and envs.get("CBGEN_AMX") != "0" and library().cbgen_amx_init() == 1
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
    if (
        packed.dim() != 6
        or packed.dtype != torch.bfloat16
        or packed.shape[1] * 32 != k
        or not packed.is_contiguous()
    ):
        raise ValueError(f"amx_linear: packed weight {tuple(packed.shape)} does not take inputs of width {k}")
    check_rows("x", x, rows, k, torch.bfloat16)
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        raise ValueError(
            f"amx_linear: bias must be a contiguous bf16 [{n}], got {tuple(bias.shape)} {bias.dtype}"
        )
    out = torch.empty((rows, n), dtype=x.dtype)
    rc = library().cbgen_amx_linear(
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
    global _layout
    if _layout is None:
        _layout = _read_layout(library())
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
    num_blocks: int,
) -> torch.Tensor:
    """Runs every decoder layer of a bf16 decode step in C (``csrc/cpu_decoder.c``) over the
    residual stream ``hidden [T, E]`` (updated in place) and returns the final norm's output
    ``[T, E]``.  ``words`` / ``floats`` describe the layers (:meth:`DecoderLayout.records`)."""
    tokens, width = hidden.shape
    qd, kd = heads * head_dim, kv_heads * head_dim
    _check_decoder_step(words, floats, first_norm[0], hidden, cos, sin, table, seq_lens, slots, head_dim)
    x = torch.empty_like(hidden)
    qkv = hidden.new_empty((tokens, qd + 2 * kd))
    attn = hidden.new_empty((tokens, qd))
    gate_up = hidden.new_empty((tokens, 2 * intermediate))
    act = hidden.new_empty((tokens, intermediate))
    delta = torch.empty_like(hidden)
    rc = library().cbgen_decoder_step(
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
        table.shape[1],
        seq_lens.data_ptr(),
        slots.data_ptr(),
        tokens,
        width,
        heads,
        kv_heads,
        head_dim,
        intermediate,
        block_size,
        num_blocks,
    )
    if rc:
        layer, stage = divmod(rc - 1, 16)
        raise RuntimeError(f"cbgen_decoder_step failed in layer {layer}, stage {stage}")
    return x


def _check_decoder_step(
    words, floats, first_norm, hidden, cos, sin, table, seq_lens, slots, head_dim
) -> None:
    """What :func:`decoder_step` reads besides the layer records (their pointers come from the
    engine's own tensors): bf16 activations of one width, rotary tables and step indices of ``T`` rows."""
    layout = decoder_layout()
    layers = words.shape[0]
    if words.shape != (layers, layout.words) or words.dtype != torch.int64 or not words.is_contiguous():
        raise ValueError(f"decoder_step: words must be a contiguous int64 [L, {layout.words}]")
    if floats.shape != (layers, layout.floats) or floats.dtype != torch.float32 or not floats.is_contiguous():
        raise ValueError(f"decoder_step: floats must be a contiguous float32 [L, {layout.floats}]")
    tokens, width = hidden.shape
    check_rows("hidden", hidden, tokens, width, torch.bfloat16)
    check_rows("first_norm", first_norm.view(1, -1), 1, width, torch.bfloat16)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (tokens, head_dim) or t.dtype != torch.bfloat16 or not t.is_contiguous():
            raise ValueError(f"decoder_step: {name} must be a contiguous bf16 [{tokens}, {head_dim}]")
    if table.dim() != 2 or table.shape[0] != tokens or table.dtype != torch.int32 or table.stride(1) != 1:
        raise ValueError(f"decoder_step: table must be an int32 [{tokens}, W] with unit inner stride")
    if seq_lens.shape != (tokens,) or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError(f"decoder_step: seq_lens must be a contiguous int32 [{tokens}]")
    if slots.shape != (tokens,) or slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"decoder_step: slots must be a contiguous int64 [{tokens}]")
