"""Parity mode's exact elementwise kernels (``csrc/cpu_parity_rows.c``): each equals, bit for bit,
the chain of torch ops it replaces in the direct forward (RMSNorm's elementwise part, the rotary
products, the residual add, SwiGLU's product), over random and extreme values, strided rows, one
row and sizes above the kernels' threading threshold; and refuses bad arguments before C runs.
Also run under AddressSanitizer (``make test-asan``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.batch_invariant import direct_forward
from cbgen.batch_invariant.direct_forward import _c_silu, _silu_mul
from cbgen.batch_invariant.kernels import cpu_parity_rows as rows
from cbgen.batch_invariant.lanes import LANE_MULTIPLE, lanewise, lanewise_

pytestmark = pytest.mark.native("c")

DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]
# 3,000 x 576 is above the kernels' one-thread threshold (2^16 elements): the threaded loops too.
SHAPES = [(1, 576), (7, 64), (64, 576), (3000, 576)]


def _values(shape, dtype, seed, scale=3.0):
    """Random values with a sprinkling of extremes: zeros, signed zeros, huge, tiny and subnormal."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    flat = x.view(-1)
    picks = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
    specials = torch.tensor([0.0, -0.0, 3e38, -3e38, 1e-30, -1e-39, 1e-44, 65504.0])
    flat[picks] = specials[torch.arange(picks.numel()) % specials.numel()]
    return x.to(dtype)


def _torch_norm(x, eps, weight):
    # LlamaRMSNorm's forward, as transformers writes it.
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def _torch_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None]) + (rot * sin[:, None])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bitwise, NaN payloads aside (torch's own vector and scalar paths disagree on those).
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{n}" for r, n in SHAPES])
def test_add_square_and_norm_equal_torchs_chain(dtype, shape) -> None:
    """The residual add, the squares and the normalised rows are torch's bits, from strided rows."""
    h = _values(shape, dtype, 1)
    o = _values((shape[0], shape[1] + 5), dtype, 2)[:, 3 : 3 + shape[1]]  # strided rows
    weight = _values((shape[1],), dtype, 3, scale=1.0)
    y, sq = rows.add_square(h, o)
    assert _same(y, h + o) and _same(sq, (h + o).float().pow(2))
    same, sq0 = rows.add_square(h)
    assert same is h and _same(sq0, h.float().pow(2))
    for eps in (1e-5, 1e-6, 0.0):
        got = rows.norm_apply(y, sq.sum(-1), eps, weight)
        assert _same(got, _torch_norm(y, eps, weight)), eps


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("t", "h", "d"), [(1, 15, 64), (64, 12, 64), (500, 5, 128), (3, 2, 2)])
def test_rope_equals_apply_rotary_pos_emb(dtype, t, h, d) -> None:
    """q and k read in place from a fused projection's rows, against transformers' formula."""
    qkv = _values((t, h * d + 40), dtype, 4)
    x = qkv[:, 8 : 8 + h * d].view(t, h, d)
    angles = torch.randn(t, d, generator=torch.Generator().manual_seed(5)) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert _same(rows.rope(x, cos, sin), _torch_rope(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("t", [1, 3, 64, 300])
def test_silu_mul_equals_the_modes_swiglu(dtype, t) -> None:
    """SwiGLU's product: in-place SiLU over whole vectors, then the exact product, against the
    mode's lanewise SiLU times up; a width whose size is no multiple of the lanes takes lanewise."""
    for inter in (1536, 37):
        gate_up = _values((t, 2 * inter), dtype, 6)
        ref = lanewise(torch.ops.aten.silu.default, gate_up[:, :inter]) * gate_up[:, inter:]
        assert _same(_silu_mul(gate_up, inter), ref), inter


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_mul_through_torchs_exp_is_chosen_where_torch_vectorises(dtype) -> None:
    """On x86 torch runs its AVX2 or AVX-512 kernels, and the C SiLU through the exp they call
    passes its start-up check (every bfloat16 value; float32 over 45 scales): the tests above then
    reach the C kernel, not the fallback."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("torch dispatches to another capability here")
    assert rows.torch_vector_exp() is not None
    assert _c_silu(dtype) == rows.torch_vector_exp()


def test_silu_mul_passes_its_check_under_torchs_avx2_kernels_too() -> None:
    """CPUs without AVX-512 run torch's AVX2 kernels (8 lanes, another exp): forced here through
    ATEN_CPU_CAPABILITY in a child process, the 8-lane C path is found and passes the same check."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("torch dispatches to another capability here")
    code = (
        "import torch\n"
        "from cbgen.batch_invariant.direct_forward import _c_silu\n"
        "assert torch.backends.cpu.get_cpu_capability() == 'AVX2'\n"
        "print([_c_silu(d) is not None and _c_silu(d)[1] for d in (torch.float32, torch.bfloat16)])\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[8, 8]"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_mul_fallback_and_c_kernel_agree(dtype, monkeypatch) -> None:
    """The torch path (where the check fails) and the C kernel give the mode's bits, on strided
    rows and on rows that end on a partial vector."""
    exp = rows.torch_vector_exp()
    for inter in (1536, 37, 8):
        wide = _values((9, 2 * inter + 5), dtype, inter)
        gate_up = wide[:, : 2 * inter]
        ref = lanewise(torch.ops.aten.silu.default, gate_up[:, :inter]) * gate_up[:, inter:]
        if exp is not None:
            assert _same(rows.silu_mul(gate_up, inter, exp), ref), inter
        monkeypatch.setattr(direct_forward, "_c_silu", lambda _dtype: None)
        assert _same(_silu_mul(gate_up, inter), ref), inter
        monkeypatch.undo()


@settings(max_examples=40, deadline=None)
@given(
    n=st.one_of(st.integers(1, 2048).map(lambda k: k * LANE_MULTIPLE), st.integers(1, 4 * 32768)),
    dtype=st.sampled_from(DTYPES),
)
def test_lanewise_in_place_equals_lanewise(n, dtype) -> None:
    """Whatever the size, an element's in-place SiLU equals lanewise's (whole vectors both ways);
    sizes that are no multiple of the lanes are left untouched and refused."""
    x = _values((n,), dtype, n)
    ref = lanewise(torch.ops.aten.silu.default, x)
    y = x.clone()
    if n % LANE_MULTIPLE:
        assert not lanewise_(torch.ops.aten.silu_.default, y) and torch.equal(y, x)
    else:
        assert lanewise_(torch.ops.aten.silu_.default, y) and _same(y, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_empty_batches(dtype) -> None:
    """A step whose rows are all unsampled hands the final norm no rows: empty in, empty out."""
    x = torch.empty(0, 64, dtype=dtype)
    y, sq = rows.add_square(x, x)
    assert y.shape == sq.shape == (0, 64)
    assert rows.norm_apply(x, sq.sum(-1), 1e-5, torch.ones(64, dtype=dtype)).shape == (0, 64)
    assert rows.rope(torch.empty(0, 3, 64, dtype=dtype), x, x).shape == (0, 3, 64)
    assert rows.mul(x, x).shape == (0, 64)
    exp = rows.torch_vector_exp()
    if exp is not None:
        assert rows.silu_mul(torch.empty(0, 128, dtype=dtype), 64, exp).shape == (0, 64)


def test_bad_arguments_are_refused_before_c() -> None:
    """Shapes, dtypes and layouts the kernels cannot take raise ValueError naming the argument."""
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="other"):
        rows.add_square(x, torch.randn(3, 8))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        rows.add_square(x.double())
    with pytest.raises(ValueError, match="sums"):
        rows.norm_apply(x, torch.randn(3), 1e-5, torch.randn(8))
    with pytest.raises(ValueError, match="weight"):
        rows.norm_apply(x, torch.randn(4), 1e-5, torch.randn(7))
    with pytest.raises(ValueError, match="x"):
        rows.norm_apply(x.t(), torch.randn(8), 1e-5, torch.randn(4))
    with pytest.raises(ValueError, match="head_dim"):
        rows.rope(torch.randn(2, 3, 5), torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(ValueError, match="contiguous"):
        rows.rope(torch.randn(2, 4, 3).transpose(1, 2), torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="cos"):
        rows.rope(torch.randn(2, 3, 4), torch.randn(3, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="b"):
        rows.mul(x, torch.randn(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out"):
        rows.mul(x, x, out=torch.empty(4, 7))
    with pytest.raises(ValueError, match="columns"):
        rows.silu_mul(x, 3, (1, 16))
    with pytest.raises(ValueError, match="rejected"):
        rows.silu_mul(x, 4, (1, 4))  # a vector width C does not know, refused before the call
