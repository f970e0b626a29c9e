"""The Triton kernels compiled on a CUDA device: the branches the interpreter cannot reach on CPU
(bf16 ``tl.dot`` on tensor cores, the automatic split-K choice of a real device).

Run by ``benchmarks/gpu_check.py`` as ``CBGEN_TEST_CUDA=1 pytest -m cuda tests/model/test_triton_cuda.py``
(``CBGEN_TEST_CUDA=1`` keeps ``tests/conftest.py`` from setting ``TRITON_INTERPRET``); elsewhere they
skip by name.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import LENS, make_case, rel_err

from cbgen.model.kernels.reference import paged_ops
from cbgen.model.kernels.triton import ops as triton_ops
from extras import require_extra

require_extra("triton")  # cbgen's Triton modules import without it; the kernels need it

if triton_ops._interpreting():
    _skip = "Triton runs in its interpreter here (CBGEN_TEST_CUDA=1 compiles it)"
elif not torch.cuda.is_available():
    _skip = "no CUDA device"
else:
    _skip = None
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(_skip is not None, reason=_skip or "")]


def _on_cuda(case: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.cuda() for t in case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_tensor_core_branch(dtype: torch.dtype, head_dim: int, monkeypatch, decode_launches) -> None:
    """bf16/fp16 decode on tensor cores (``NATIVE_DOT``), window and soft-cap included, against the
    float32 reference."""
    seen = decode_launches
    for window, softcap in ((None, None), (20, 5.0)):
        query, k, v, table, clean, lens = _on_cuda(make_case(3, LENS, 8, 2, head_dim, 16, dtype))
        out = triton_ops.triton_paged_decode_attention(
            query, k, v, table, lens, head_dim**-0.5, window, softcap
        )
        want = paged_ops.paged_decode_attention(
            query.float(), k.float(), v.float(), clean, lens, head_dim**-0.5, window, softcap
        )
        live = lens > 0
        assert rel_err(out[live], want[live]) < 1e-2
        assert torch.equal(out[~live], torch.zeros_like(out[~live]))
    assert all(native for _, native in seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_automatic_split_k(dtype: torch.dtype, monkeypatch, decode_launches) -> None:
    """One row over a long context on a device with many SMs: the automatic split count is above 1
    (flash-decoding plus the merge kernel), and the result equals the reference."""
    seen = decode_launches
    lens = [4000, 1]
    query, k, v, table, clean, seq_lens = _on_cuda(make_case(5, lens, 8, 2, 128, 16, dtype))
    out = triton_ops.triton_paged_decode_attention(query, k, v, table, seq_lens, 128**-0.5)
    want = paged_ops.paged_decode_attention(query.float(), k.float(), v.float(), clean, seq_lens, 128**-0.5)
    ((splits, _),) = seen
    assert splits > 1
    assert rel_err(out, want) < (1e-4 if dtype == torch.float32 else 1e-2)
