"""The one-call C decode step (``csrc/cpu_decoder.c``), wrapped for :mod:`cbgen.model.cpu_fast.fused_forward`.

Every decoder layer of a decode step (projections, rotary embedding, KV store, paged attention,
residual adds and norms) runs in one call, on the projection GEMM the step would use anyway: AMX
(bf16, CPUs with AMX), the panel GEMM (float32 or bf16, CPUs with AVX2; ``csrc/cpu_panel.c``) or
the AVX-512 panel GEMMs (``csrc/cpu_panel512.c``: float32, and bf16 through vdpbf16ps).
The layer-record layout is written once, in C, and read from the library (:class:`DecoderLayout`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from cbgen.model.kernels.arg_checks import check_rows
from cbgen.model.kernels.cpu.ops import library

# The projection kernels the C step calls, by GEMM candidate name (its ``gemm`` argument).
GEMMS = {"amx": 0, "panel": 1, "panel_bf16": 2, "dpbf16": 3, "panel512": 4}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The stages of a step as csrc/cpu_decoder.c numbers them (stage_seconds entries).
STAGES = (
    "first norm",
    "q/k/v projection",
    "rotary",
    "KV store",
    "attention",
    "output projection",
    "residual + norm",
    "gate/up projection",
    "SiLU x up",
    "down projection",
    "residual + norm (MLP)",
)
_layout: DecoderLayout | None = None


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
    gemm: str,
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
    attn_impl: int = 0,
    stage_seconds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Runs every decoder layer of a decode step in C (``csrc/cpu_decoder.c``) over the residual
    stream ``hidden [T, E]`` (float32 or bf16, updated in place) and returns the final norm's output
    ``[T, E]``.  ``words`` / ``floats`` describe the layers (:meth:`DecoderLayout.records`), whose
    weight pointers are packed for ``gemm`` (a key of :data:`GEMMS`).  ``attn_impl``: the decode
    attention loops (:func:`cbgen.model.kernels.cpu.ops.decode_direct`'s ``impl``).
    ``stage_seconds``: a float64 tensor of :data:`STAGES` entries that each stage's wall seconds are
    added to (a diagnostic; ``benchmarks/step_budget.py``), or None."""
    if gemm not in GEMMS:
        raise ValueError(f"decoder_step: gemm {gemm!r} is not one of {sorted(GEMMS)}")
    _check_stage_seconds(stage_seconds)
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
        _DTYPES[hidden.dtype],
        GEMMS[gemm],
        int(attn_impl),
        None if stage_seconds is None else stage_seconds.data_ptr(),
    )
    if rc:
        layer, stage = divmod(rc - 1, 16)
        raise RuntimeError(f"cbgen_decoder_step failed in layer {layer}, stage {stage}")
    return x


def _check_stage_seconds(stage_seconds: torch.Tensor | None) -> None:
    """The diagnostic buffer, when given: one float64 per stage the library times, on the CPU."""
    if stage_seconds is not None and (
        stage_seconds.dtype != torch.float64
        or stage_seconds.device.type != "cpu"
        or not stage_seconds.is_contiguous()
        or stage_seconds.numel() != len(STAGES)
        or library().cbgen_decoder_stages() != len(STAGES)
    ):
        raise ValueError(
            f"decoder_step: stage_seconds must be a contiguous CPU float64 tensor of {len(STAGES)}"
        )


def _check_decoder_step(
    words, floats, first_norm, hidden, cos, sin, table, seq_lens, slots, head_dim
) -> None:
    """What :func:`decoder_step` reads besides the layer records (their pointers come from the
    engine's own tensors): float32 or bf16 activations of one width and dtype, rotary tables and
    step indices of ``T`` rows."""
    layout = decoder_layout()
    layers = words.shape[0]
    if words.shape != (layers, layout.words) or words.dtype != torch.int64 or not words.is_contiguous():
        raise ValueError(f"decoder_step: words must be a contiguous int64 [L, {layout.words}]")
    if floats.shape != (layers, layout.floats) or floats.dtype != torch.float32 or not floats.is_contiguous():
        raise ValueError(f"decoder_step: floats must be a contiguous float32 [L, {layout.floats}]")
    tokens, width = hidden.shape
    dtype = hidden.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"decoder_step: hidden must be float32 or bfloat16, got {dtype}")
    check_rows("hidden", hidden, tokens, width, dtype)
    check_rows("first_norm", first_norm.view(1, -1), 1, width, dtype)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (tokens, head_dim) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"decoder_step: {name} must be a contiguous {dtype} [{tokens}, {head_dim}]")
    if table.dim() != 2 or table.shape[0] != tokens or table.dtype != torch.int32 or table.stride(1) != 1:
        raise ValueError(f"decoder_step: table must be an int32 [{tokens}, W] with unit inner stride")
    if seq_lens.shape != (tokens,) or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError(f"decoder_step: seq_lens must be a contiguous int32 [{tokens}]")
    if slots.shape != (tokens,) or slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"decoder_step: slots must be a contiguous int64 [{tokens}]")
