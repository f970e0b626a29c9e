"""Trainer parity (``batch_invariant=True`` + ``cbgen.parity``): every generated token's
``raw_logprobs`` equal the trainer's forward bit for bit (``torch.equal``), and its
``token_logprobs`` equal ``cbgen.processed_logprobs`` of that forward with the kept-set record,
whatever the batch,
budget, prefix-cache state, preemption, n>1 forks, aborts and scheduling; a batch-invariance check;
a negative control (the default mode differs, so the comparison can fail); gradients; and the
building blocks' invariance (tiled matmuls, whole-vector transcendentals, the blocked attention).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

import cbgen
from cbgen import LLM, SamplingParams
from cbgen.batch_invariant import direct_forward
from cbgen.batch_invariant.attention_core import BLOCK, blocked_attention
from cbgen.batch_invariant.dispatch import ParityOps
from cbgen.batch_invariant.lanes import lanewise
from cbgen.batch_invariant.native import parity_form
from cbgen.batch_invariant.paged import chunk_groups
from cbgen.model import plan as plan_module
from cbgen.model import support
from extras import require_extra
from thread_helpers import AlternatingThreads
from tiny_models import ARCHS, make_model, make_prompts, make_wide_model


@dataclass
class Sample:
    """One generated sample as the engine reported it."""

    prompt: list[int]
    tokens: list[int]
    raw: list[float]
    processed: list[float] = field(default_factory=list)
    kept_counts: list[int] = field(default_factory=list)
    params: SamplingParams | None = None


def _model(arch: str, wide: bool, dtype: torch.dtype) -> torch.nn.Module:
    return make_wide_model(arch, dtype=dtype) if wide else make_model(arch, dtype=dtype)


def trainer_logits(model: torch.nn.Module, samples: list[Sample], parity: bool = True) -> list[torch.Tensor]:
    """The trainer's logits that predict each sample's tokens (``[len(tokens), V]``): one
    left-padded batch, one forward (inside ``cbgen.parity`` unless ``parity`` is False: then the
    plain forward)."""
    rows = [s.prompt + s.tokens for s in samples]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    with torch.no_grad():
        if parity:
            with cbgen.parity(model):
                logits = model(ids, attention_mask=mask).logits
        else:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(ids, attention_mask=mask, position_ids=positions).logits
    out = []
    for i, s in enumerate(samples):
        start = width - len(s.prompt) - len(s.tokens)
        out.append(logits[i, start + len(s.prompt) - 1 : width - 1])
    return out


def trainer_logprobs(
    model: torch.nn.Module, samples: list[Sample], parity: bool = True
) -> list[torch.Tensor]:
    """The trainer's raw logprobs of each sample's tokens (see :func:`trainer_logits`)."""
    logits = trainer_logits(model, samples, parity)
    return [cbgen.token_logprobs(lg, torch.tensor(s.tokens)) for lg, s in zip(logits, samples)]


def mismatches(model: torch.nn.Module, samples: list[Sample], parity: bool = True) -> tuple[int, int]:
    """(tokens whose raw or processed logprob differs from the trainer's in any bit, tokens compared).
    The processed ones are rebuilt by ``cbgen.processed_logprobs`` from the kept-set record."""
    samples = [s for s in samples if s.tokens]
    bad = total = 0
    for s, logits in zip(samples, trainer_logits(model, samples, parity)):
        tokens = torch.tensor(s.tokens)
        raw_ref = cbgen.token_logprobs(logits, tokens)
        got = torch.tensor(s.raw, dtype=torch.float32)
        assert got.shape == raw_ref.shape
        wrong = got != raw_ref
        if s.params is not None:
            proc_ref = cbgen.processed_logprobs(logits, tokens, s.params, s.kept_counts)
            wrong |= torch.tensor(s.processed, dtype=torch.float32) != proc_ref
        bad += int(wrong.sum())
        total += len(s.tokens)
    return bad, total


def _workload_prompts(rng: random.Random, count: int, vocab: int) -> list[list[int]]:
    """Mixed lengths; some share prefixes of lengths that end mid-block (block size 8)."""
    prefixes = [[rng.randrange(3, vocab) for _ in range(n)] for n in (13, 21, 30)]
    prompts = []
    for i in range(count):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]
        prompts.append(prefixes[(i // 2) % 3] + tail if i % 2 else tail + [rng.randrange(3, vocab)] * 2)
    return prompts


def _params(rng: random.Random, i: int) -> SamplingParams:
    """Greedy, and seeded sampling under every truncation (top-k, top-p, min-p, none) and bias."""
    n = 2 if i % 5 == 0 else 1
    new = rng.randrange(3, 8)
    kind = i % 5
    if kind == 0:
        return SamplingParams(n=n, temperature=0.0, max_tokens=new)
    if kind == 1:
        return SamplingParams(n=n, temperature=1.0, top_k=50, seed=i, max_tokens=new)
    if kind == 2:
        return SamplingParams(n=n, temperature=0.7, top_p=0.9, seed=i, max_tokens=new, logit_bias={5: 2.5})
    if kind == 3:
        return SamplingParams(n=n, temperature=1.3, top_k=20, min_p=0.05, seed=i, max_tokens=new)
    # Temperature 1 with nothing cut: the processed logprob is the raw one (the sampler's shortcut).
    return SamplingParams(n=n, temperature=1.0 if i % 2 else 0.9, seed=i, max_tokens=new)


def run_workload(llm: LLM, prompts: list[list[int]], seed: int) -> list[Sample]:
    """Adds every request (n>1 on some, greedy and seeded sampling), aborts one mid-way, steps to
    the end; returns every sample with its tokens (aborted ones with what they had)."""
    rng = random.Random(seed)
    engine = llm.engine
    params: dict[str, SamplingParams] = {}
    ids: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        sp = _params(rng, i)
        rid = engine.add_request(p, sp)
        ids[rid], params[rid] = p, sp
    victim = next(iter(ids))
    samples: list[Sample] = []

    def collect(out) -> None:
        for s in out.outputs:
            samples.append(
                Sample(
                    ids[out.request_id],
                    list(s.token_ids),
                    list(s.raw_logprobs),
                    list(s.token_logprobs),
                    list(s.kept_counts),
                    params[out.request_id],
                )
            )

    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                collect(out)
        steps += 1
        if steps == 3:
            aborted = engine.abort(victim)
            if aborted is not None:
                collect(aborted)
    return samples


CASES = [(arch, False) for arch in ARCHS] + [("llama", True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("arch", "wide"), CASES, ids=[a + ("-wide" if w else "") for a, w in CASES])
def test_raw_logprobs_equal_trainer_bit_for_bit(arch: str, wide: bool, dtype: torch.dtype) -> None:
    seed = sum(map(ord, arch)) + (7 if wide else 0) + (1 if dtype == torch.bfloat16 else 0)
    rng = random.Random(seed)
    model = _model(arch, wide, dtype)
    vocab = model.config.vocab_size
    llm = LLM(
        model,
        block_size=8,
        num_blocks=12,  # 96 token slots for ~32 sequences of up to ~80 tokens: preemption
        max_num_batched_tokens=rng.choice([24, 40, 64, 128]),
        batch_invariant=True,
        async_scheduling=dtype == torch.bfloat16,
        decode_mode="static" if wide and dtype == torch.float32 else "auto",
    )
    prompts = _workload_prompts(rng, 32, vocab)
    warm = run_workload(llm, prompts[:6], seed)  # warms the prefix cache
    samples = run_workload(llm, prompts[:6] + prompts[6:], seed + 1)
    stats = llm.engine.stats
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0 and stats.requests_aborted > 0, stats
    bad, total = mismatches(model, warm + samples)
    assert total >= 32 * 3
    # The processed comparison is not vacuous: truncated sampled tokens were compared.
    truncated = [c for s in samples for c, lp in zip(s.kept_counts, s.processed) if c > 1 and lp != 0.0]
    assert len(truncated) >= 10, truncated
    assert bad == 0, f"{bad} of {total} tokens' raw logprobs differ from the trainer's"
    # Another trainer batch (size, order, padding) gives the same bits.
    assert mismatches(model, samples[::-3])[0] == 0


def test_negative_control_default_mode_differs() -> None:
    """The same comparison outside parity mode (default engine vs the plain forward) finds
    differences: the parity test above can fail."""
    found = []
    for dtype in (torch.float32, torch.bfloat16):
        model = make_wide_model("llama", dtype=dtype)
        llm = LLM(model, block_size=8, num_blocks=256, max_num_batched_tokens=40)
        prompts = make_prompts(24, (3, 60), vocab=model.config.vocab_size, seed=3)
        samples = run_workload(llm, prompts, 5)
        found.append(mismatches(model, samples, parity=False)[0])
    assert sum(found) > 0, "default mode matched the plain forward everywhere: the control cannot fail"


def test_kept_set_record_and_processed_logprobs_outside_parity() -> None:
    """The record in the default mode: top-k keeps k tokens, no truncation records 0 / -inf, greedy 1;
    the helper on the plain forward gives the trainer's processed logprob under the same truncation,
    close to (not equal to) the engine's; unsupported settings are refused."""
    model = make_wide_model("llama")
    llm = LLM(model, block_size=8, num_blocks=256)
    prompts = make_prompts(6, (5, 30), vocab=model.config.vocab_size, seed=21)
    cases = [
        SamplingParams(temperature=0.8, top_k=7, seed=1, max_tokens=6),
        SamplingParams(temperature=1.0, seed=2, max_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=6),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.02, seed=3, max_tokens=6),
    ]
    samples = []
    for params in cases:
        for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
            c = out.outputs[0]
            samples.append(
                Sample(prompt, c.token_ids, c.raw_logprobs, c.token_logprobs, c.kept_counts, params)
            )
            assert len(c.kept_counts) == len(c.kept_thresholds) == len(c.token_ids)
            if params.top_k == 7:
                assert set(c.kept_counts) == {7}
            elif params.temperature == 0.0:
                assert set(c.kept_counts) == {1}
            elif params.top_p == 1.0:
                assert set(c.kept_counts) == {0} and all(t == float("-inf") for t in c.kept_thresholds)
            else:
                assert all(0 < k < model.config.vocab_size for k in c.kept_counts)
    for s, logits in zip(samples, trainer_logits(model, samples, parity=False)):
        got = cbgen.processed_logprobs(logits, torch.tensor(s.tokens), s.params, s.kept_counts)
        assert torch.allclose(got, torch.tensor(s.processed, dtype=torch.float32), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        cbgen.processed_logprobs(
            logits, torch.tensor(s.tokens), SamplingParams(repetition_penalty=1.2), s.kept_counts
        )
    with pytest.raises(ValueError, match="kept_counts"):
        cbgen.processed_logprobs(logits, torch.tensor(s.tokens), s.params, [0])


def _target_runs(llm: LLM, target: list[int], fillers: list[list[int]], params: SamplingParams):
    """The target's (tokens, raw logprobs): alone, first of 64, last of 64, then again (cache hit)."""
    runs = []
    for batch in ([target], [target, *fillers], [*fillers, target], [target]):
        outs = llm.generate(batch, params, use_tqdm=False)
        out = outs[batch.index(target)]
        runs.append((out.outputs[0].token_ids, out.outputs[0].raw_logprobs, out.num_cached_tokens))
    return runs


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batch_invariance(kind: str, dtype: torch.dtype) -> None:
    model = make_wide_model("llama", dtype=dtype)
    vocab = model.config.vocab_size
    target = make_prompts(1, (45, 45), vocab=vocab, seed=11)[0]
    fillers = make_prompts(63, (3, 30), vocab=vocab, seed=12)
    params = (
        SamplingParams(temperature=0.0, max_tokens=12)
        if kind == "greedy"
        else SamplingParams(temperature=1.0, seed=5, max_tokens=12)
    )
    llm = LLM(model, block_size=8, num_blocks=1024, max_num_batched_tokens=64, batch_invariant=True)
    runs = _target_runs(llm, target, fillers, params)
    assert runs[-1][2] > 0, "the last run should hit the prefix cache"
    first_tokens, first_lp, _ = runs[0]
    for tokens, lp, _ in runs[1:]:
        assert tokens == first_tokens
        assert torch.equal(torch.tensor(lp), torch.tensor(first_lp))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parity_holds_while_the_thread_count_changes(dtype: torch.dtype) -> None:
    """The CPU thread governor runs steps on fewer threads while other processes hold cores: the bits
    must not depend on it.  Steps alternate between 1 and 2 threads; the trainer runs on 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = make_wide_model("llama", dtype=dtype)
        llm = LLM(model, block_size=8, max_num_batched_tokens=40, batch_invariant=True)
        engine = llm.engine
        engine.threads = AlternatingThreads()
        seen = engine.threads.seen
        rng = random.Random(3)
        samples = run_workload(llm, _workload_prompts(rng, 10, model.config.vocab_size), 3)
        assert set(seen) == {1, 2}
        bad, total = mismatches(model, samples)
        assert total >= 10 * 3 and bad == 0, f"{bad} of {total} tokens differ from the trainer's"
    finally:
        torch.set_num_threads(before)


def test_batch_invariance_default_mode_greedy() -> None:
    """The same check in the default mode, fp32 greedy: the tokens are the same in every setting (the
    fp32 oracle's guarantee), the logprobs only to rounding (different GEMMs per row class, fused
    steps and chunked attention reorder sums; that is what parity mode removes)."""
    model = make_wide_model("llama")
    vocab = model.config.vocab_size
    target = make_prompts(1, (45, 45), vocab=vocab, seed=11)[0]
    fillers = make_prompts(63, (3, 30), vocab=vocab, seed=12)
    llm = LLM(model, block_size=8, num_blocks=1024, max_num_batched_tokens=64)
    runs = _target_runs(llm, target, fillers, SamplingParams(temperature=0.0, max_tokens=12))
    assert runs[-1][2] > 0, "the last run should hit the prefix cache"
    first_tokens, first_lp, _ = runs[0]
    for tokens, lp, _ in runs[1:]:
        assert tokens == first_tokens
        assert torch.allclose(torch.tensor(lp), torch.tensor(first_lp), atol=1e-4, rtol=0)


def test_gradients_flow_and_match_default_backward() -> None:
    model = make_model("qwen2")
    model.train()
    ids = torch.tensor(make_prompts(3, (10, 20), seed=4)[0])[None].repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0

    def grads(parity: bool) -> dict[str, torch.Tensor]:
        model.zero_grad()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if parity:
            with cbgen.parity(model):
                logits = model(ids, attention_mask=mask).logits
                loss = cbgen.parity.token_logprobs(logits[:, :-1], ids[:, 1:]).mul(mask[:, 1:]).sum()
                loss.backward()
        else:
            logits = model(ids, attention_mask=mask, position_ids=positions).logits
            cbgen.token_logprobs(logits[:, :-1], ids[:, 1:]).mul(mask[:, 1:]).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    # The forward with autograd recording (a training step's) gives the bits of a no_grad one.
    with cbgen.parity(model):
        recorded = model(ids, attention_mask=mask).logits
        with torch.no_grad():
            plain = model(ids, attention_mask=mask).logits
    assert recorded.requires_grad and torch.equal(recorded.detach(), plain)
    ref, got = grads(False), grads(True)
    assert ref.keys() == got.keys() and len(got) > 10
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-3, atol=1e-4, msg=name)


def test_context_leaves_model_and_torch_untouched() -> None:
    model = make_model("gemma2")
    ids = torch.tensor(make_prompts(1, (20, 20), seed=2))
    impl = model.config._attn_implementation
    with torch.no_grad():
        before = model(ids).logits
        with cbgen.parity(model):
            inside = model(ids).logits
        after = model(ids).logits
    assert model.config._attn_implementation == impl
    assert not model._forward_pre_hooks
    assert torch.equal(before, after)
    torch.testing.assert_close(inside, before, rtol=1e-4, atol=1e-4)
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None


def test_parity_plan_is_the_engines_plan() -> None:
    llm = LLM(make_model("llama"), num_blocks=64, batch_invariant=True)
    plan = llm.engine.plan
    # Llama on the C parity kernels: the direct forward, checked against the module forward at start.
    direct = parity_form(torch.device("cpu"), torch.float32) == "c"
    assert plan.parity and plan.attention == "parity" and plan.forward == ("direct" if direct else "module")
    assert llm.engine.runner.direct_checked is (True if direct else None)
    assert plan.row_prefill_max == 0
    assert "batch-invariant" in plan.report()
    # Models outside the fused path's allow list run the modules under the dispatch mode.
    other = LLM(make_model("phi3"), num_blocks=64, batch_invariant=True).engine.plan
    assert other.forward == "module" and "not on the fused path's allow list" in other.forward_why


def _greedy_raw(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].raw_logprobs)) for o in outs]


DIRECT_CASES = [
    ("llama-bias", "llama", {"attention_bias": True, "mlp_bias": True}),
    ("qwen2", "qwen2", {}),
    ("qwen3-qk-norm", "qwen3", {}),
    ("mistral-window", "mistral", {"sliding_window": 24}),
]


@pytest.mark.native("avx2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("arch", "overrides"), [c[1:] for c in DIRECT_CASES], ids=[c[0] for c in DIRECT_CASES]
)
def test_direct_forward_equals_the_module_forward(arch, overrides, dtype, monkeypatch) -> None:
    """The parity plan's direct forward against the module forward under the dispatch mode, over
    prompts longer than the window and chunked by a small budget: the same tokens, the same bits."""
    model = make_model(arch, dtype=dtype, **overrides)
    prompts = make_prompts(12, lengths=(5, 70), vocab=model.config.vocab_size, seed=3)

    def run() -> tuple[str, list]:
        llm = LLM(model, block_size=8, num_blocks=200, max_num_batched_tokens=48, batch_invariant=True)
        return llm.engine.plan.forward, _greedy_raw(llm, prompts)

    forward, direct = run()
    assert forward == "direct"
    monkeypatch.setattr(plan_module, "_parity_forward_choice", lambda *a: ("module", "forced by the test"))
    forward, module = run()
    assert forward == "module"
    assert direct == module


@pytest.mark.native("avx2")
def test_direct_forward_falls_back_when_its_check_fails(monkeypatch, caplog) -> None:
    """A direct forward that differs from the module forward by one ulp anywhere is refused at
    start: the engine says so and runs the module forward, whose results equal the trainer's."""
    model = make_wide_model("llama")
    real = direct_forward._norm

    def off_by_one_ulp(x, sq, norm):
        out = real(x, sq, norm)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(direct_forward, "_norm", off_by_one_ulp)
    with caplog.at_level("WARNING", logger="cbgen"):
        llm = LLM(model, num_blocks=64, batch_invariant=True)
    assert llm.engine.runner.direct_checked is False and llm.engine.plan.forward == "module"
    assert "differs from the module forward" in caplog.text
    samples = run_workload(llm, make_prompts(6, lengths=(4, 30), vocab=model.config.vocab_size), 5)
    bad, total = mismatches(model, samples)
    assert total > 0 and bad == 0
    # A re-resolved plan (a hook registered, then removed) does not return to the refused path.
    handle = model.model.layers[0].register_forward_hook(lambda *a: None)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    handle.remove()
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.plan.forward == "module"


@pytest.mark.native("avx2")
def test_direct_forward_unchecked_is_not_run(monkeypatch) -> None:
    """A cache too small for the start-up check's steps: the check cannot run, so neither does the
    direct forward."""
    monkeypatch.setattr(support, "paged_probe_logits", lambda engine: None)
    llm = LLM(make_model("llama"), num_blocks=64, batch_invariant=True)
    assert llm.engine.runner.direct_checked is False and llm.engine.plan.forward == "module"
    assert "not checked" in llm.engine.plan.forward_why


@pytest.mark.native("avx2")
def test_direct_forward_replans_when_an_adapter_or_hook_arrives() -> None:
    """The direct forward runs only the math of the modules it qualified: a forward hook (which
    could change a layer's output) sends the next step to the module forward, and its removal back."""
    model = make_wide_model("llama")
    llm = LLM(model, num_blocks=64, batch_invariant=True)
    assert llm.engine.plan.forward == "direct"
    seen = []
    handle = model.model.layers[1].register_forward_hook(lambda mod, args, out: seen.append(1))
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert seen and llm.engine.plan.forward == "module"
    handle.remove()
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.plan.forward == "direct"


# ------------------------------------------------------------------------------ building blocks
def test_tiled_matmul_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(200, 333, dtype=dtype)
        x = torch.randn(70, 333, dtype=dtype)
        with ParityOps():
            full = torch.nn.functional.linear(x, w)
            rows = [torch.nn.functional.linear(x[i : i + 1], w) for i in (0, 17, 69)]
        for row, i in zip(rows, (0, 17, 69)):
            assert torch.equal(row[0], full[i])


def test_lanewise_elements_do_not_depend_on_their_place() -> None:
    torch.manual_seed(1)
    x = torch.randn(40000) * 4
    for op in (torch.exp, torch.nn.functional.silu, torch.tanh, torch.cos):
        whole = lanewise(op, x)
        for lo, hi in ((0, 1), (5, 37), (39990, 40000), (12345, 32800)):
            assert torch.equal(lanewise(op, x[lo:hi]), whole[lo:hi])


@pytest.mark.parametrize("window", [None, 9])
def test_blocked_attention_ignores_padding_and_company(window: int | None) -> None:
    torch.manual_seed(2)
    seq = 2 * BLOCK + 5
    k, v = torch.randn(1, seq, 2, 16), torch.randn(1, seq, 2, 16)
    q = torch.randn(1, seq, 4, 16)
    pos = torch.arange(seq)[None]
    with ParityOps():
        full = blocked_attention(q, k, v, pos, 0.25, window, 30.0)
        # One query, keys padded far past it, next to another sequence.
        pad_k = torch.cat([k, torch.randn(1, 3 * BLOCK, 2, 16)], 1)
        pad_v = torch.cat([v, torch.randn(1, 3 * BLOCK, 2, 16)], 1)
        other = torch.randn(1, pad_k.shape[1], 2, 16)
        qi = torch.stack([q[0, 70:71], q[0, 3:4]])
        pair = blocked_attention(
            qi,
            torch.cat([pad_k, other]),
            torch.cat([pad_v, other]),
            torch.tensor([[70], [3]]),
            0.25,
            window,
            30.0,
        )
    assert torch.equal(pair[0, 0], full[0, 70])


def test_prefill_chunk_groups_cover_every_chunk_once() -> None:
    rng = random.Random(3)
    sizes = [(n, n + rng.randrange(0, 200)) for n in (rng.randrange(1, 120) for _ in range(50))]
    groups = chunk_groups(sizes)
    assert sorted(i for g in groups for i in g) == list(range(50))
    for g in groups:
        work = sum(sizes[i][0] * sizes[i][1] for i in g)
        padded = len(g) * max(sizes[i][0] for i in g) * max(sizes[i][1] for i in g)
        assert padded <= 1.5 * work
    assert len(groups) < 50  # similar chunks do share calls


@pytest.mark.parametrize("form", ["torch", "triton"])
def test_other_kernel_forms_keep_parity(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other forms of parity mode's kernels (``CBGEN_PARITY_KERNELS``): the torch fallback (no C
    compiler, other devices) and the Triton kernels (CUDA; here under Triton's interpreter) give the
    trainer's bits too, on both sides; and they are different bits from the C kernels', which is why
    one process never mixes forms."""
    if form == "triton":
        require_extra("triton")
        from cbgen.model.kernels.triton.ops import _interpreting

        if not _interpreting():
            pytest.skip("the Triton form runs on CPU tensors only under the interpreter")
    model = make_model("qwen2")
    # Triton's interpreter runs each kernel launch in Python: a few short prompts (still chunked
    # and decoded) keep the test at ~20 s.
    prompts = make_prompts(3 if form == "triton" else 16, (3, 30), vocab=model.config.vocab_size, seed=8)
    tokens = 5 if form == "triton" else 9

    def run() -> list[Sample]:
        llm = LLM(model, block_size=8, num_blocks=64, max_num_batched_tokens=32, batch_invariant=True)
        return run_workload(llm, prompts, tokens)

    native = run()
    monkeypatch.setenv("CBGEN_PARITY_KERNELS", form)
    samples = run()
    bad, total = mismatches(model, samples)
    assert total > 0 and bad == 0, f"{bad} of {total}"
    assert [s.raw for s in samples] != [s.raw for s in native]
