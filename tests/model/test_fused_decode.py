"""The fused CPU decode path (``cbgen.model.cpu_fast.fused_forward``): same tokens and logprobs as the
transformers module tree, used only where it applies, and left the moment a model stops qualifying."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

import native_paths
from cbgen import LLM, SamplingParams
from cbgen.model.cpu_fast import decode_loops, packed_linears
from cbgen.model.cpu_fast import fused_forward as fused_decode
from cbgen.model.cpu_fast.fused_forward import FusedDecoder
from cbgen.model.kernels.cpu import amx as cpu_amx
from cbgen.model.kernels.cpu import decoder as cpu_decoder
from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.model.kernels.cpu.panel import panel_available
from oracle import BF16, bf16_tolerance, bf16_ulp, compare, hf_greedy
from tiny_models import make_model, make_prompts

pytestmark = pytest.mark.native("c")

CASES = {
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral-window": ("mistral", {"sliding_window": 24}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=5)


def _count_fused(monkeypatch) -> list[int]:
    """Counts decode steps the fused path actually computed (returned logits for)."""
    calls = [0]
    original = FusedDecoder.forward

    def counting(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls[0] += out is not None
        return out

    monkeypatch.setattr(FusedDecoder, "forward", counting)
    return calls


def _run(model, prompts, params=GREEDY, **kwargs):
    llm = LLM(model, block_size=8, **kwargs)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _top_logprobs(out) -> list[dict[int, float]]:
    return out.top_logprobs


@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_generate_and_module_path(case, monkeypatch) -> None:
    arch, overrides = CASES[case]
    model = make_model(arch, **overrides)
    assert fused_decode.unsupported_reason(model) is None
    prompts = make_prompts(10, lengths=(3, 60))
    calls = _count_fused(monkeypatch)
    fused = _run(model, prompts)
    assert calls[0] >= 25  # every decode-only step went through the fused path
    compare(model, prompts, [o.token_ids for o in fused], [hf_greedy(model, p, 30) for p in prompts])
    calls[0] = 0
    plain = _run(model, prompts, fused_decode=False)
    assert calls[0] == 0
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        for sa, sb in zip(_top_logprobs(a), _top_logprobs(b)):
            assert sa.keys() == sb.keys()
            for t in sa:
                assert sa[t] == pytest.approx(sb[t], rel=1e-5, abs=1e-5)  # fp32, sums in another order


def test_packed_grouped_projections_match_module_path(monkeypatch) -> None:
    """A model wide enough for packed weights, with 64 sequences decoding (the row count MKL's packed
    GEMM serves): q/k/v and gate/up run as grouped packed GEMMs, tokens equal ``generate()`` and top
    logprobs the module path."""
    model = make_model(
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        attention_bias=True,
        mlp_bias=True,
    )
    if not fused_decode.PackedLinears(torch.float32).enabled:
        pytest.skip("this torch build has no MKL packed GEMM, so nothing is packed or grouped")
    monkeypatch.setenv("CBGEN_GEMM", "mkl_packed")  # the GEMM this test claims, not a timing's pick
    prompts = make_prompts(64, lengths=(3, 40))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    groups, served = [], set()
    original_pack, original_group = fused_decode.PackedLinears._pack, fused_decode.PackedLinears.group

    def counting(self, modules):
        groups.append(len(modules))
        return original_pack(self, modules)

    def grouped(self, x, modules, checked=True):
        outs = original_group(self, x, modules, checked)
        # One GEMM for the whole group: every output is a column view of the same tensor.
        if len({o.untyped_storage().data_ptr() for o in outs}) == 1:
            served.add((len(modules), x.shape[0]))
        return outs

    monkeypatch.setattr(fused_decode.PackedLinears, "_pack", counting)
    monkeypatch.setattr(fused_decode.PackedLinears, "group", grouped)
    # The Python loop, where the groups are visible (the one-call C step, where this machine's GEMM
    # has one, runs the same packed groups and is held to the loop by test_c_decoder_step_*).
    monkeypatch.setattr(FusedDecoder, "_build_c_layers", staticmethod(lambda *a: None))
    fused = _run(model, prompts, params)
    assert groups.count(3) == 2 and groups.count(2) == 2  # q/k/v and gate/up packed, per layer
    assert {(3, 64), (2, 64)} <= served  # and the 64-row decode steps ran them as one GEMM each
    compare(model, prompts, [o.token_ids for o in fused], [hf_greedy(model, p, 6) for p in prompts])
    plain = _run(model, prompts, params, fused_decode=False)
    for a, b in zip(fused, plain):
        for sa, sb in zip(_top_logprobs(a), _top_logprobs(b)):
            assert sa.keys() == sb.keys()
            for t in sa:
                assert sa[t] == pytest.approx(sb[t], rel=1e-5, abs=1e-5)  # fp32, sums in another order


WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.mark.parametrize("size", ["tiny", "wide"])
def test_bf16_fused_path_within_tolerance_of_module_path(monkeypatch, size) -> None:
    """bf16: the fused and the module path round differently (rotary embedding, the projections'
    summation order; see test_bf16_kernels_round_where_the_modules_do), so they are held to the bf16
    tolerance of ``tests/oracle.py``, not to bits: both runs' tokens against ``generate()`` under the
    bf16 near-tie rule, and every step's raw and top logprobs of one path within the tolerance of the
    other's while their tokens agree.  ``wide`` has weights large enough to be packed (the AMX kernel
    where the CPU has it, oneDNN where it has bf16 support)."""
    model = make_model("llama", dtype=torch.bfloat16, **(WIDE if size == "wide" else {}))
    prompts = make_prompts(8, lengths=(5, 40))
    new = 8
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=3)
    calls = _count_fused(monkeypatch)
    fused = _run(model, prompts, params)
    assert calls[0] >= new - 1  # every decode step
    plain = _run(model, prompts, params, fused_decode=False)
    refs = [hf_greedy(model, p, new) for p in prompts]
    for run in (fused, plain):
        compare(model, prompts, [o.token_ids for o in run], refs, rule=BF16)
    steps = worst = 0.0
    for prompt, a, b in zip(prompts, fused, plain):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + a.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        for step, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            tol = bf16_tolerance(logits[step])
            sa, sb = a.top_logprobs[step], b.top_logprobs[step]
            pairs = [(a.raw_logprobs[step], b.raw_logprobs[step])] if ta == tb else []
            pairs += [(sa[t], sb[t]) for t in sa.keys() & sb.keys()]
            assert len(pairs) >= 2
            diff = max(abs(x - y) for x, y in pairs)
            assert diff <= tol, f"step {step}: fused and module path differ by {diff:.4f} > {tol:.4f}"
            worst = max(worst, diff / bf16_ulp(float(logits[step].abs().max())))
            steps += 1
            if ta != tb:
                break  # a near-tie (checked above): the contexts differ from here on
    assert steps >= len(prompts) * (new - 1)
    print(f"\nbf16 {size}: fused vs module path, largest difference {worst:.2f} ulps of the largest logit")


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between ``a`` and ``b`` (elementwise; same sign assumed near zero)."""
    ia = a.view(torch.int16).int()
    ib = b.view(torch.int16).int()
    # Sign-magnitude to a monotone integer line, so neighbours differ by one.
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


WIDTHS = [
    pytest.param(96, id="avx512", marks=pytest.mark.native("avx512")),  # 16-lane loops
    pytest.param(40, id="avx2", marks=pytest.mark.native("avx2")),  # 8-lane loops (40 % 16 != 0)
    pytest.param(36, id="portable"),
]


def _vector_loops(n: int) -> bool:
    """Whether rows of n values take vector loops in this build (16 lanes, else 8)."""
    states = native_paths.states()
    return (n % 16 == 0 and states["avx512"].runs) or (n % 8 == 0 and states["avx2"].runs)


def _head_dim(width: int) -> int:
    """A rotary head size whose half takes the same loops as rows of ``width``."""
    return 32 if width % 8 == 0 else 20


@pytest.mark.parametrize("width", WIDTHS)
def test_bf16_kernels_round_where_the_modules_do(width: int) -> None:
    """What the README says about bf16 rounding in the fused path, pinned: residual add + RMSNorm and
    SiLU-and-multiply round every value the transformers modules round, at the same point (bitwise
    equal on the portable loops; the vector loops sum the squares in another order, so within one
    ulp there); the rotary kernel computes ``q * cos`` and ``rotate_half(q) * sin`` and their sum in
    float32 and rounds once, where the modules round all three (it equals that once-rounded result
    bitwise and differs from the modules' in about a third of the values)."""
    gen = torch.Generator().manual_seed(width)
    bf = torch.bfloat16
    x, delta = (torch.randn(16, width, generator=gen).to(bf) for _ in range(2))
    norm = LlamaRMSNorm(width, eps=1e-6).to(bf)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(width, generator=gen))
    summed, out = x.clone(), torch.empty_like(x)
    cpu_kernels.add_rmsnorm(summed, delta, norm.weight, 1e-6, out)
    assert torch.equal(summed, x + delta)
    gate, up = torch.randn(16, width, generator=gen).to(bf) * 4, torch.randn(16, width, generator=gen).to(bf)
    act = cpu_kernels.silu_mul(gate, up, torch.empty_like(gate))
    for got, want in ((out, norm(x + delta)), (act, nn.functional.silu(gate) * up)):
        apart = _ulps_apart(got, want)
        if not _vector_loops(width):
            assert torch.equal(got, want)
        else:
            assert apart.max() <= 1 and (apart > 0).float().mean() < 0.01
    d, tokens = _head_dim(width), 8
    q, k = torch.randn(tokens, 3 * d, generator=gen).to(bf), torch.randn(tokens, d, generator=gen).to(bf)
    angles = torch.rand(tokens, d // 2, generator=gen) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(bf), torch.cat([angles.sin()] * 2, -1).to(bf)
    module_q = (
        q.view(tokens, 3, d) * cos[:, None] + rotate_half(q.view(tokens, 3, d)) * sin[:, None]
    ).flatten(1)
    once_q = (
        q.float().view(tokens, 3, d) * cos.float()[:, None]
        + rotate_half(q.float().view(tokens, 3, d)) * sin.float()[:, None]
    )
    got_q, got_k = q.clone(), k.clone()
    cpu_kernels.rope_(got_q, got_k, cos, sin, d)
    assert torch.equal(got_q, once_q.to(bf).flatten(1))
    assert 0.1 < (got_q != module_q).float().mean() < 0.6


C_STEP_CASES = [
    pytest.param(torch.bfloat16, "amx", id="amx-bf16", marks=pytest.mark.native("amx")),
    pytest.param(torch.float32, "panel", id="panel-fp32", marks=pytest.mark.native("avx2")),
    pytest.param(torch.bfloat16, "panel", id="panel-bf16", marks=pytest.mark.native("avx2")),
    pytest.param(torch.bfloat16, "panel_bf16", id="panel_bf16-bf16", marks=pytest.mark.native("avx2")),
    pytest.param(
        torch.bfloat16, "dpbf16", id="dpbf16-bf16", marks=pytest.mark.native("avx512", "avx512bf16")
    ),
]


@pytest.mark.parametrize(("dtype", "gemm"), C_STEP_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_c_decoder_step_equals_python_loop(monkeypatch, dtype, gemm, bias) -> None:
    """The one-call C decode step (csrc/cpu_decoder.c), on each GEMM it calls, computes exactly what
    the Python loop over the same kernels does: identical tokens and logprobs, over 40 sequences
    (rows off the 16-row tiles), then fewer as they finish apart, down to one, and enough steps to
    cross KV blocks; it is used for every decode step."""
    _c_step_vs_python_loop(monkeypatch, dtype, gemm, bias)


@pytest.mark.parametrize(
    "loops",
    [
        pytest.param("avx512", marks=pytest.mark.native("avx512")),
        pytest.param("avx2", marks=pytest.mark.native("avx2")),
        "portable",
    ],
)
def test_c_decoder_step_runs_the_planned_attention_loops(monkeypatch, loops) -> None:
    """The C step attends with the decode loops the plan chose (decode_loops.py), as the Python loop
    does: the same tokens and logprobs on each set of loops."""
    monkeypatch.setenv("CBGEN_DECODE_LOOPS", loops)
    impls = []
    original = cpu_decoder.decoder_step
    monkeypatch.setattr(
        cpu_decoder, "decoder_step", lambda *a, **k: impls.append(k["attn_impl"]) or original(*a, **k)
    )
    gemm = "panel" if panel_available() else None
    if gemm is None:
        pytest.skip("the C step needs the panel GEMM (AVX2 + FMA)")
    _c_step_vs_python_loop(monkeypatch, torch.float32, gemm, False)
    assert impls and set(impls) == {decode_loops.IMPLS[loops]}


@pytest.mark.native("avx2")
def test_c_decoder_step_stage_times_change_nothing(monkeypatch) -> None:
    """With a stage_seconds buffer (benchmarks/step_budget.py) the C step computes the same tokens and
    logprobs, and every stage's time is added to its own entry."""
    monkeypatch.setenv("CBGEN_GEMM", "panel")
    model = make_model("llama", dtype=torch.float32, **WIDE)
    prompts = make_prompts(6, lengths=(3, 20))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = _run(model, prompts, [params] * len(prompts))
    stages = torch.zeros(len(cpu_decoder.STAGES), dtype=torch.float64)
    calls = []
    original = cpu_decoder.decoder_step

    def timed(*args, **kwargs):
        before = stages.clone()
        out = original(*args, **kwargs, stage_seconds=stages)
        calls.append(stages - before)
        return out

    monkeypatch.setattr(cpu_decoder, "decoder_step", timed)
    with_times = _run(model, prompts, [params] * len(prompts))
    assert len(calls) >= 4
    for a, b in zip(plain, with_times):
        assert a.token_ids == b.token_ids
        assert _top_logprobs(a) == _top_logprobs(b)
    for added in calls:  # each stage ran in each step and only ever adds time
        assert (added > 0).all(), dict(zip(cpu_decoder.STAGES, added.tolist()))


def _c_step_vs_python_loop(monkeypatch, dtype, gemm, bias) -> None:
    if gemm != "amx":
        monkeypatch.setenv("CBGEN_GEMM", gemm)  # every row class on that GEMM
    model = make_model("llama", dtype=dtype, attention_bias=bias, mlp_bias=bias, **WIDE)
    prompts = make_prompts(40, lengths=(3, 30))
    params = [
        SamplingParams(max_tokens=12 if i else 16, temperature=0.0, ignore_eos=True, logprobs=3)
        for i in range(len(prompts))
    ]
    c_steps = [0]
    original = cpu_decoder.decoder_step

    def counting(*args, **kwargs):
        assert args[0] == gemm
        c_steps[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(cpu_decoder, "decoder_step", counting)
    with_c = _run(model, prompts, params)
    used = c_steps[0]
    assert used >= 15  # every decode step (the first token comes from prefill steps)
    monkeypatch.setattr(FusedDecoder, "_build_c_layers", staticmethod(lambda *a: None))
    python_loop = _run(model, prompts, params)
    assert c_steps[0] == used  # the second run took the Python loop
    for a, b in zip(with_c, python_loop):
        assert a.token_ids == b.token_ids
        assert _top_logprobs(a) == _top_logprobs(b)


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "olmo2", "qwen3_moe"])
def test_other_architectures_are_not_fused(arch) -> None:
    assert fused_decode.unsupported_reason(make_model(arch)) is not None


def test_wrapped_projection_is_not_fused() -> None:
    """A projection that is not a plain nn.Linear (what PEFT injects) keeps the module path."""

    class Adapter(nn.Linear):
        pass

    model = make_model("llama")
    old = model.model.layers[1].self_attn.v_proj
    model.model.layers[1].self_attn.v_proj = Adapter(old.in_features, old.out_features, bias=False)
    assert "not nn.Linear" in fused_decode.unsupported_reason(model)


def test_hook_or_adapter_added_later_falls_back(monkeypatch) -> None:
    """A hook registered, or a module swapped, after the engine started moves the next steps back to
    the transformers path, and the output stays exact."""
    model = make_model("llama")
    prompts = make_prompts(4, lengths=(5, 30))
    llm = LLM(model, block_size=8)
    calls = _count_fused(monkeypatch)
    seen = []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1]))
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        handle.remove()
    assert calls[0] == 0
    assert seen.count(len(prompts)) >= 25  # the hook saw every decode step
    compare(model, prompts, got, [hf_greedy(model, p, 30) for p in prompts])
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert calls[0] >= 25  # hook removed: fused again
    calls[0] = 0
    attn = model.model.layers[0].self_attn
    wrapped = type("Wrapped", (nn.Linear,), {})(attn.q_proj.in_features, attn.q_proj.out_features, bias=False)
    wrapped.weight = attn.q_proj.weight
    attn.q_proj = wrapped
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert calls[0] == 0
    compare(model, prompts, got, [hf_greedy(model, p, 30) for p in prompts])


def _rotate_half_ref(t, cos, sin, heads):
    tokens, d = cos.shape
    t = t.view(tokens, heads, d)
    half = torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1)
    return (t * cos[:, None] + half * sin[:, None]).reshape(tokens, heads * d)


@pytest.mark.parametrize("width", WIDTHS)
def test_fused_kernels_match_torch(width: int) -> None:
    """Widths that are multiples of 16 take the AVX-512 loops where the CPU has them, multiples of 8
    the AVX2 loops, others the portable ones."""
    gen = torch.Generator().manual_seed(width)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, width, generator=gen).to(dtype)
        delta = torch.randn(7, width, generator=gen).to(dtype)
        w = torch.randn(width, generator=gen).to(dtype)
        summed = x + delta
        h = summed.float()
        ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        out = torch.empty(7, 200, dtype=dtype)[:, :width]  # strided output rows
        xx = x.clone()
        cpu_kernels.add_rmsnorm(xx, delta, w, 1e-6, out)
        assert torch.equal(xx, summed)
        torch.testing.assert_close(out, ref, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-5)
        # rotate-half rotary embedding over q [T, 3*D] and k [T, 1*D]
        d = _head_dim(width)
        q = torch.randn(5, 3 * d, generator=gen).to(dtype)
        k = torch.randn(5, d, generator=gen).to(dtype)
        ang = torch.randn(5, d // 2, generator=gen)
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)

        rq, rk = _rotate_half_ref(q, cos, sin, 3), _rotate_half_ref(k, cos, sin, 1)
        cpu_kernels.rope_(q, k, cos, sin, d)
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(q, rq, atol=tol, rtol=tol)
        torch.testing.assert_close(k, rk, atol=tol, rtol=tol)
        g = torch.randn(4, width, generator=gen).to(dtype) * 8
        u = torch.randn(4, width, generator=gen).to(dtype)
        got = cpu_kernels.silu_mul(g, u, torch.empty_like(g))
        torch.testing.assert_close(got, nn.functional.silu(g) * u, atol=tol, rtol=tol)


def _assert_linear(out: torch.Tensor, x: torch.Tensor, layer: nn.Linear) -> None:
    """``out`` is ``layer(x)``: bit for bit, except where bf16 weights run through the AMX kernel,
    whose fp32 sums may be added in another order than torch's (then: the float32 result rounded
    to bf16, within one bf16 ulp)."""
    want = nn.functional.linear(x, layer.weight, layer.bias)
    if x.dtype == torch.bfloat16 and cpu_amx.amx_available():
        exact = nn.functional.linear(
            x.float(), layer.weight.float(), layer.bias.float() if layer.bias is not None else None
        )
        torch.testing.assert_close(out.float(), exact, rtol=2**-7, atol=1e-4)
        assert (out != want).float().mean() < 0.01  # the order only matters near rounding ties
    else:
        assert torch.equal(out, want)


@pytest.mark.parametrize("width", [32, 256])  # below / above the packing threshold
@pytest.mark.parametrize("rows", [5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_group_equals_separate_linears(dtype, rows, width) -> None:
    """A group's outputs equal each projection's ``F.linear`` (biases on some members only), packed
    or (small weights) concatenated, and a bias updated in place is picked up."""
    gen = torch.Generator().manual_seed(0)
    layers = (
        nn.Linear(width, width, bias=True).to(dtype),
        nn.Linear(width, width // 2, bias=False).to(dtype),
        nn.Linear(width, width // 2, bias=True).to(dtype),
    )
    x = torch.randn(rows, width, generator=gen).to(dtype)
    packed = fused_decode.PackedLinears(dtype)
    if not packed.enabled:
        pytest.skip(
            f"no packed {dtype} GEMM here (fp32: MKL; bf16: oneDNN's bf16 GEMM, which needs CPU support)"
        )

    def check() -> None:
        outs = packed.group(x, layers)
        assert len(outs) == 3
        for out, layer in zip(outs, layers):
            _assert_linear(out, x, layer)

    check()
    with torch.no_grad():
        layers[2].bias.add_(1)
    check()


def test_rows_past_the_amx_limit_run_plain_linears(monkeypatch) -> None:
    """A bf16 input with more rows than the AMX kernel takes gets torch's own linears, bit for bit."""
    monkeypatch.setattr(packed_linears, "AMX_MAX_ROWS", 4)
    gen = torch.Generator().manual_seed(1)
    layers = (nn.Linear(256, 256).to(torch.bfloat16), nn.Linear(256, 128).to(torch.bfloat16))
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    packed = fused_decode.PackedLinears(torch.bfloat16)
    if not packed.enabled:
        pytest.skip("no packed bf16 GEMM here (oneDNN's bf16 GEMM needs CPU support)")
    for out, layer in zip(packed.group(x, layers), layers):
        assert torch.equal(out, nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_follow_weight_changes(dtype) -> None:
    """Packed projections give F.linear's result, and a changed weight is repacked: in place (version
    counter), by ``.data =`` (new storage), or through ``.data`` once ``clear()`` is called."""
    gen = torch.Generator().manual_seed(0)
    layer = nn.Linear(256, 384, bias=True).to(dtype)  # above the packing threshold
    x = torch.randn(64, 256, generator=gen).to(dtype)  # the row count MKL's packed GEMM serves
    packed = fused_decode.PackedLinears(dtype)
    if not packed.enabled:
        pytest.skip(
            f"no packed {dtype} GEMM here (fp32: MKL; bf16: oneDNN's bf16 GEMM, which needs CPU support)"
        )
    _assert_linear(packed(x, layer), x, layer)
    with torch.no_grad():
        layer.weight.mul_(2)
    _assert_linear(packed(x, layer), x, layer)
    layer.weight.data = torch.randn(384, 256, generator=gen).to(dtype)
    _assert_linear(packed(x, layer), x, layer)
    layer.weight.data.copy_(torch.randn(384, 256, generator=gen).to(dtype))  # no version bump
    packed.clear()
    _assert_linear(packed(x, layer), x, layer)
    # A stale copy is off by far more than rounding, so the checks above can fail.
    stale = packed(x, layer)
    layer.weight.data.copy_(torch.randn(384, 256, generator=gen).to(dtype))
    with pytest.raises(AssertionError):
        _assert_linear(stale, x, layer)


def test_rotary_table_matches_the_module() -> None:
    """cos/sin rows come from a table the rotary module filled (grown on demand), and equal what the
    module computes for the same positions (to an ulp: vector and scalar tails of cos/sin)."""
    model = make_model("llama")
    decoder = FusedDecoder(model)
    rotary = model.model.rotary_emb
    hidden = torch.zeros(5, model.config.hidden_size)
    for positions in ([0, 3, 7, 100, 255], [300, 1000, 2, 5, 9]):  # the second outgrows the table
        pos = torch.tensor(positions)
        cos, sin = decoder._rotary(rotary, hidden, pos)
        want_cos, want_sin = rotary(hidden[None], pos[None])
        torch.testing.assert_close(cos, want_cos[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(sin, want_sin[0], atol=1e-6, rtol=0)
    assert decoder._rope[1].shape[0] >= 1001
