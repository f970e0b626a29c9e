"""The paths users run, held to the oracle: tiny-but-wide models (``tests/tiny_models.py``
``WIDE_ARCHS``: hidden 256, intermediate 1024), every projection group at or above the packing
threshold, so the packed and panel GEMMs, the fused forward and the one-call C decode step run.

* float32: greedy tokens equal ``generate()`` (``tests/oracle.py``'s float32 rule) on all 8
  architectures, and for the Llama family (the fused forward) once per GEMM candidate this machine
  has, forced through ``CBGEN_GEMM``: not only the one a timing picked.
* bfloat16: logprobs and greedy tokens against the float32 reference of the same weights, under the
  bound ``tests/bf16_reference.py`` derives from bf16 rounding.
* The models' biases and norm weights are not transformers' constant init (all zeros, all ones) but
  perturbed (``tests/tiny_models.py``), which is checked; and a fast path sabotaged to drop a bias
  or ignore a norm weight is shown to be caught, so these comparisons can fail on such a bug.

Each run: four prompts of mixed length under a 320-token budget (the longest is chunked; the first
step has more than ``SPLIT_ROWS`` rows, the second exactly ``DECODE_ROWS``, the row count MKL's
packed GEMM serves), then a prompt that hits the prefix cache and decodes alone (one-row steps).
The execution plan says what should run; spies on the GEMM candidates and the C step check that it
did, and what ran is reported in the run's summary (``tests/conftest.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

import bf16_reference
from cbgen import LLM, SamplingParams
from cbgen.model.cpu_fast import gemm_choice
from cbgen.model.cpu_fast.fused_forward import FusedDecoder
from cbgen.model.kernels.cpu import decoder as cpu_decoder
from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.model.support import UnsupportedModelError
from oracle import compare, hf_greedy
from tiny_models import BIAS_SPREAD, SCALE_SPREAD, WIDE_ARCHS, WIDE_COMMON, make_model, make_wide_model

pytestmark = [pytest.mark.native("c"), pytest.mark.usefixtures("one_torch_thread")]

# The architectures the plan runs through the fused forward; the others run the module tree.
FUSED = ("llama", "mistral", "qwen2", "qwen3")
NEW_TOKENS = 8
BLOCK = 16
BUDGET = 320  # > SPLIT_ROWS (256): the first step is of the prefill row class
# 381 prompt tokens: step 1 computes 7 + 30 + 55 and 228 of the last; step 2 its other 61 and
# three decode rows, 64 in all (DECODE_ROWS).  Mistral's window (32) is shorter than all but one.
PROMPT_LENGTHS = (7, 30, 55, 289)
PREFIX = 160  # the prefix-hit prompt: the longest prompt's first 10 blocks, then 5 new tokens
LOGPROBS = 20


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(31)
    vocab = WIDE_COMMON["vocab_size"]
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    return [*prompts, prompts[-1][:PREFIX] + torch.randint(3, vocab, (5,), generator=gen).tolist()]


def _cases(dtype: torch.dtype) -> list:
    names = list(gemm_choice.candidates(dtype))
    return [
        pytest.param(arch, gemm, id=f"{arch}-{gemm or 'module'}")
        for arch in WIDE_ARCHS
        for gemm in (names if arch in FUSED else [None])
    ]


@dataclass
class Ledger:
    """What ran: the row counts each GEMM candidate served (a candidate that returns None for a row
    count leaves it to plain ``F.linear``), the row counts of the one-call C steps per GEMM, and the
    fused forward's steps."""

    served: dict[str, set[int]] = field(default_factory=dict)
    c_step: dict[str, set[int]] = field(default_factory=dict)
    fused_steps: int = 0

    def classes(self, rows_by_name: dict[str, set[int]], name: str) -> set[str]:
        """The row classes of the row counts ``name`` ran."""
        return {gemm_choice.row_class(r) for r in rows_by_name.get(name, ())}

    def listed(self, rows_by_name: dict[str, set[int]], name: str) -> str:
        """:meth:`classes`, in ``ROW_CLASSES`` order, for the summary."""
        classes = self.classes(rows_by_name, name)
        return ", ".join(c for c in gemm_choice.ROW_CLASSES if c in classes)


@pytest.fixture
def ledger(monkeypatch) -> Ledger:
    """Spies on every GEMM candidate the plan can pick, the C decode step and the fused forward."""
    seen = Ledger()
    candidates, c_step, forward = gemm_choice.candidates, cpu_decoder.decoder_step, FusedDecoder.forward

    def recording(cand: gemm_choice.Candidate) -> gemm_choice.Candidate:
        def apply(x, packed, weight, bias):
            out = cand.apply(x, packed, weight, bias)
            if out is not None:
                seen.served.setdefault(cand.name, set()).add(x.shape[0])
            return out

        return dataclasses.replace(cand, apply=apply)

    def spying_candidates(dtype):
        return {name: recording(cand) for name, cand in candidates(dtype).items()}

    def spying_c_step(gemm, words, floats, first_norm, hidden, *args, **kwargs):
        seen.c_step.setdefault(gemm, set()).add(hidden.shape[0])
        return c_step(gemm, words, floats, first_norm, hidden, *args, **kwargs)

    def spying_forward(self, *args, **kwargs):
        seen.fused_steps += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(gemm_choice, "candidates", spying_candidates)
    monkeypatch.setattr(cpu_decoder, "decoder_step", spying_c_step)
    monkeypatch.setattr(FusedDecoder, "forward", spying_forward)
    return seen


def _forced(gemm: str) -> dict[str, str]:
    """The plan's GEMM per row class under ``CBGEN_GEMM=gemm`` (one name for all; gemv, a one-row
    kernel, leaves the bigger classes plain)."""
    if gemm == "gemv":
        return {"single": "gemv", "decode": "plain", "prefill": "plain"}
    return dict.fromkeys(gemm_choice.ROW_CLASSES, gemm)


def _check_plan(plan, arch: str, gemm: str | None) -> None:
    """The plan runs what the test claims: the fused forward on the forced GEMMs for the Llama
    family (the C step for the row classes whose GEMM has a C form, except with Qwen3's q/k norms)."""
    if gemm is None:
        assert plan.forward == "module", plan.describe()
        return
    assert plan.forward == "fused", plan.describe()
    assert plan.gemms.source == "CBGEN_GEMM" and plan.gemms.names() == _forced(gemm)
    with_c_form = {c for c, name in _forced(gemm).items() if name in cpu_decoder.GEMMS}
    assert plan.c_step == (frozenset() if arch == "qwen3" else with_c_form), plan.c_step_why
    if arch == "qwen3" and with_c_form:
        assert "q/k norms" in plan.c_step_why


def _check_ran(seen: Ledger, plan, gemm: str | None) -> list[str]:
    """Asserts that the forced GEMMs served the row classes the plan gave them, and the C step its
    classes; returns what ran, for the run's summary."""
    if gemm is None:
        assert seen.fused_steps == 0 and not seen.served and not seen.c_step
        return ["module forward"]
    assert seen.fused_steps > 0
    names = plan.gemms.names()
    packing = {name for name in names.values() if name != "plain"}
    assert set(seen.served) == packing, f"served {sorted(seen.served)}, the plan packs for {sorted(packing)}"
    ran = []
    for name in sorted(packing):
        if name == "mkl_packed":  # it serves the one row count it was packed for
            assert gemm_choice.DECODE_ROWS in seen.served[name]
        else:
            assert seen.classes(seen.served, name) == {c for c, n in names.items() if n == name}
        ran.append(f"{name}: {seen.listed(seen.served, name)}")
    # Decode-only steps of the C step's classes ran in C (no step here decodes > SPLIT_ROWS rows).
    c_classes = {c for c in plan.c_step if c != "prefill"}
    assert {c for g in seen.c_step for c in seen.classes(seen.c_step, g)} == c_classes
    assert all(names[gemm_choice.row_class(r)] == g for g, rows in seen.c_step.items() for r in rows)
    ran += [f"C step {g}: {seen.listed(seen.c_step, g)}" for g in sorted(seen.c_step)]
    return ran or ["plain"]


def _run(model, gemm: str | None, monkeypatch, logprobs: int | None = None):
    """The engine's outputs for the four prompts, then the prefix-hit prompt; and its plan."""
    if gemm is None:
        monkeypatch.delenv("CBGEN_GEMM", raising=False)
    else:
        monkeypatch.setenv("CBGEN_GEMM", gemm)
    prompts = _prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    llm = LLM(model, block_size=BLOCK, max_num_batched_tokens=BUDGET)
    outs = llm.generate(prompts[:-1], params, use_tqdm=False)
    hit = llm.generate(prompts[-1:], params, use_tqdm=False)
    assert hit[0].num_cached_tokens == PREFIX
    return prompts, [o.outputs[0] for o in outs + hit], llm.engine.plan


@pytest.fixture(scope="module")
def references() -> dict:
    """``generate()``'s float32 tokens per architecture, computed once for all GEMMs."""
    return {}


@pytest.mark.parametrize(("arch", "gemm"), _cases(torch.float32))
def test_fp32_equals_generate(arch, gemm, references, ledger, monkeypatch, record_property) -> None:
    model = make_wide_model(arch)
    prompts, outs, plan = _run(model, gemm, monkeypatch)
    _check_plan(plan, arch, gemm)
    if arch not in references:
        references[arch] = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    compare(model, prompts, [o.token_ids for o in outs], references[arch])
    record_property("gemm_ran", ("float32", gemm or "-", _check_ran(ledger, plan, gemm)))


def _bf16_model(arch: str):
    # Top-k expert routing is not continuous (tests/bf16_reference.py): every expert for every token.
    dense = {"num_experts_per_tok": WIDE_ARCHS[arch]["num_experts"]} if arch == "qwen3_moe" else {}
    return make_wide_model(arch, dtype=torch.bfloat16, **dense)


@pytest.mark.parametrize(("arch", "gemm"), _cases(torch.bfloat16))
def test_bf16_within_derived_bound_of_fp32(arch, gemm, ledger, monkeypatch, record_property) -> None:
    model = _bf16_model(arch)
    prompts, outs, plan = _run(model, gemm, monkeypatch, logprobs=LOGPROBS)
    _check_plan(plan, arch, gemm)
    report = bf16_reference.check_against_fp32(model, prompts, outs)
    print(f"\n{arch} bf16 {gemm or 'module'}: {report}")
    record_property("gemm_ran", ("bfloat16", gemm or "-", _check_ran(ledger, plan, gemm)))


# The vector parameters (biases, norm weights) of each architecture's layers and final norm, by
# their last two name parts: what a kernel could drop or ignore.
_LAYER_NORMS = {"input_layernorm.weight", "post_attention_layernorm.weight", "norm.weight"}
VECTORS = {
    "llama": _LAYER_NORMS,
    "qwen2": _LAYER_NORMS | {"q_proj.bias", "k_proj.bias", "v_proj.bias"},
    "qwen3": _LAYER_NORMS | {"q_norm.weight", "k_norm.weight"},
    "qwen3_moe": _LAYER_NORMS | {"q_norm.weight", "k_norm.weight"},
    "mistral": _LAYER_NORMS,
    "gemma2": _LAYER_NORMS | {"pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"},
    "phi3": _LAYER_NORMS,
    "olmo2": {
        "post_attention_layernorm.weight",
        "post_feedforward_layernorm.weight",
        "q_norm.weight",
        "k_norm.weight",
        "norm.weight",
    },
}


def _check_vectors(arch: str, model: torch.nn.Module) -> None:
    """Every vector parameter of ``model`` varies from channel to channel with about the spread
    ``tests/tiny_models.py`` draws: no bias is all zeros and no norm weight all ones (or, for Gemma's
    ``1 + weight``, all zeros), so a kernel that drops the one or ignores the other computes
    something else than the model."""
    vectors = {name: p.detach().float() for name, p in model.named_parameters() if p.dim() < 2}
    assert {".".join(name.split(".")[-2:]) for name in vectors} == VECTORS[arch], arch
    for name, values in vectors.items():
        spread = BIAS_SPREAD if name.endswith("bias") else SCALE_SPREAD
        assert not torch.all(values == values[0]), (arch, name, "constant")
        assert 0.5 * spread < float(values.std()) < 1.5 * spread, (arch, name, float(values.std()))


def test_the_wide_models_have_what_the_tests_claim() -> None:
    """Every projection group of the fused architectures reaches the packing threshold (so the
    candidates and the C step see them), Qwen2 has q/k/v biases, Qwen3 q/k norms, and Mistral's window
    is shorter than the longest sequence (so it slides); and no vector parameter of any wide or tiny
    model, in float32 or bfloat16, is constant (:func:`_check_vectors`)."""
    from cbgen.model.cpu_fast.packed_linears import packable

    for arch in FUSED:
        layer = make_wide_model(arch).model.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        groups = ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj))
        for group in (*groups, (mlp.down_proj,)):
            assert packable(sum(m.weight.numel() for m in group)), (arch, [m.weight.shape for m in group])
        assert (attn.q_proj.bias is not None) == (arch == "qwen2")
        assert hasattr(attn, "q_norm") == (arch == "qwen3")
    window = make_wide_model("mistral").config.sliding_window
    assert window == WIDE_ARCHS["mistral"]["sliding_window"] < max(PROMPT_LENGTHS) + NEW_TOKENS
    for arch in WIDE_ARCHS:
        for model in (make_wide_model(arch), make_wide_model(arch, dtype=torch.bfloat16), make_model(arch)):
            _check_vectors(arch, model)


# ------------------------------------------------------------------ the oracle can fail
# Each sabotage makes one fast path drop a bias or ignore a norm weight, as a kernel bug would, and
# returns a counter of the sabotaged calls.  The models' vectors are perturbed (tests/tiny_models.py),
# so such a bug is caught: in the fused forward's Python loop by the engine's start-up probe
# (cbgen/model/support.py, whose steps have prefill rows), in the C decode step, which runs only
# decode-only steps the probe does not make, by the fp32 comparison with generate() above.


def _c_step_records(monkeypatch, change) -> list[int]:
    """The C step's layer records passed through ``change(words, fields, modules)`` (returning tensors
    to keep alive); counts the C steps run on them."""
    build, step = FusedDecoder._build_c_layers, cpu_decoder.decoder_step
    held, calls = [], [0]

    def sabotaged_build(mods, linear, meta, gemm):
        records = build(mods, linear, meta, gemm)
        if records is None:
            return None
        words, floats, dims = records
        words = words.clone()
        held.extend(change(words, cpu_decoder.decoder_layout().word_fields, mods))
        return words, floats, dims

    def counting_step(*args, **kwargs):
        calls[0] += 1
        return step(*args, **kwargs)

    monkeypatch.setattr(FusedDecoder, "_build_c_layers", staticmethod(sabotaged_build))
    monkeypatch.setattr(cpu_decoder, "decoder_step", counting_step)
    return calls


def _c_step_without_qkv_bias(monkeypatch, model) -> list[int]:
    def change(words, fields, mods):
        words[:, fields.index("B_QKV")] = 0  # a null bias: the C step adds none
        return []

    return _c_step_records(monkeypatch, change)


def _c_step_with_ones_post_norm(monkeypatch, model) -> list[int]:
    def change(words, fields, mods):
        ones = [torch.ones_like(layer.post_norm[0]) for layer in mods.layers]
        words[:, fields.index("POST_NORM")] = torch.tensor([w.data_ptr() for w in ones])
        return ones

    return _c_step_records(monkeypatch, change)


def _fused_without_biases(monkeypatch, model) -> list[int]:
    """Every packed GEMM of the fused forward's Python loop called without its bias."""
    candidates, calls = gemm_choice.candidates, [0]

    def without_bias(cand: gemm_choice.Candidate) -> gemm_choice.Candidate:
        def apply(x, packed, weight, bias):
            calls[0] += bias is not None
            return cand.apply(x, packed, weight, None)

        return dataclasses.replace(cand, apply=apply)

    monkeypatch.setattr(
        gemm_choice, "candidates", lambda dtype: {n: without_bias(c) for n, c in candidates(dtype).items()}
    )
    return calls


def _fused_with_ones_norms(monkeypatch, model, width: int | None = None) -> list[int]:
    """The fused forward's RMSNorms (of ``width`` channels only, when given) with a ones weight."""
    real, calls = cpu_kernels.add_rmsnorm, [0]

    def add_rmsnorm(x, delta, weight, eps, out):
        if width is None or weight.numel() == width:
            calls[0] += 1
            weight = torch.ones_like(weight)
        return real(x, delta, weight, eps, out)

    monkeypatch.setattr(cpu_kernels, "add_rmsnorm", add_rmsnorm)
    return calls


def _fused_with_ones_qk_norms(monkeypatch, model) -> list[int]:
    return _fused_with_ones_norms(monkeypatch, model, width=model.config.head_dim)


SABOTAGES = {
    "c-step-no-qkv-bias": ("qwen2", _c_step_without_qkv_bias, "oracle"),
    "c-step-ones-post-norm": ("llama", _c_step_with_ones_post_norm, "oracle"),
    "fused-no-bias": ("qwen2", _fused_without_biases, "probe"),
    "fused-ones-norms": ("llama", _fused_with_ones_norms, "probe"),
    "fused-ones-qk-norms": ("qwen3", _fused_with_ones_qk_norms, "probe"),
}


@pytest.mark.native("avx2")
@pytest.mark.parametrize("sabotage", list(SABOTAGES))
def test_a_path_that_drops_a_bias_or_a_norm_weight_is_caught(sabotage, references, monkeypatch) -> None:
    """On the panel GEMM (the C step for decode rows, the Python loop for the others), a sabotaged
    path runs and is caught: the engine refuses the model at start, naming the logits that differ
    from the model's own forward, or its tokens are not ``generate()``'s, nor near-ties of them."""
    arch, inject, caught_by = SABOTAGES[sabotage]
    model = make_wide_model(arch)
    calls = inject(monkeypatch, model)
    if caught_by == "probe":
        with pytest.raises(
            UnsupportedModelError, match="different logits under cbgen's packed, paged forward"
        ):
            _run(model, "panel", monkeypatch)
        assert calls[0] > 0
        return
    prompts, outs, plan = _run(model, "panel", monkeypatch)
    assert plan.forward == "fused" and calls[0] > 0
    if arch not in references:
        references[arch] = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    with pytest.raises(AssertionError, match="near-tie"):
        compare(model, prompts, [o.token_ids for o in outs], references[arch])
