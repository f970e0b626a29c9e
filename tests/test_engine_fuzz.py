"""Engine fuzz test: random configurations and operation sequences through the real engine, held to
the oracles (issue #15).

Each example builds a fresh tiny model (Llama, Qwen2, Gemma2, or a Qwen3.5 hybrid with state
layers) and an engine with random cache
geometry, budgets, ``max_num_seqs``, prefix caching and sync or overlap scheduling, then interleaves
adding requests (shared prefixes, n>1, greedy / seeded / prompt-logprob kinds), steps, aborts and
in-place weight changes.  After the last operation it drains and checks:

* liveness: every sequence ends within the documented bound counted from its first scheduling
  (docs/design.md, "Scheduling and the liveness bound"; ``tests/engine_liveness.py``), and the drain
  ends within the same bound counted from its start;
* each request ended exactly once, every block is free, the counters add up;
* greedy samples equal ``generate()`` under the weights of their ``weight_version`` (a prefix of it
  for aborted and failed samples), with the oracle's near-tie rule;
* seeded samples equal the same request run in a roomy engine without preemption;
* prompt logprobs equal a plain forward.

CI runs a fixed-seed slice (``FUZZ_EXAMPLES``, default 12 per architecture); ``make fuzz`` runs the
long soak (``FUZZ_EXAMPLES=... FUZZ_DEADLINE_S=...``).
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbgen import LLM, SamplingParams
from engine_liveness import LivenessWatch
from oracle import check_divergence, hf_greedy
from tiny_models import make_model, make_state_model

VOCAB = 128
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))
DERANDOMIZE = os.environ.get("FUZZ_RANDOM") != "1"
SECONDS = float(os.environ.get("FUZZ_SECONDS", "0"))  # soak: repeat rounds of EXAMPLES until spent
BASE_MODELS = {
    arch: make_model(arch, vocab_size=VOCAB, max_position_embeddings=256)
    for arch in ("llama", "qwen2", "gemma2")
}
# A hybrid with state layers (Gated DeltaNet and attention, Qwen3.5's): state slots, aligned
# prefill chunks, checkpoints and one-token replays after preemption under the same operations.
BASE_MODELS["qwen3_5"] = make_state_model("gdn")


@dataclass
class Spec:
    """One request of a scenario."""

    prompt: list[int]
    params: SamplingParams
    rid: str | None = None
    outputs: list = field(default_factory=list)


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    config = dict(
        block_size=block_size,
        num_blocks=draw(st.integers(4, 48)) * 16 // block_size,
        max_num_batched_tokens=draw(st.integers(1, 64)),
        max_num_seqs=draw(st.integers(1, 8)),
        enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
    )
    shared = draw(st.lists(st.integers(3, VOCAB - 1), min_size=0, max_size=24))
    ops = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["add", "add", "add", "step", "step", "abort", "weights"]))
        if kind == "add":
            prefix = shared[: draw(st.integers(0, len(shared)))]
            own = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=30))
            sort = draw(st.sampled_from(["greedy", "greedy", "seeded", "prompt_logprobs"]))
            n = draw(st.integers(1, 4))
            max_tokens = draw(st.integers(1, 12))
            if sort == "greedy":
                params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            elif sort == "seeded":
                seed = draw(st.integers(0, 10**6))
                params = SamplingParams(
                    n=n, max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True
                )
            else:
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=2
                )
            ops.append(("add", Spec(prefix + own, params)))
        elif kind == "step":
            ops.append(("step", draw(st.integers(1, 6))))
        else:
            ops.append((kind, draw(st.integers(0, 10**6))))
    return config, ops


def _perturb(model: torch.nn.Module, x: int) -> None:
    params = [p for p in model.parameters() if p.dim() >= 2]
    with torch.no_grad():
        params[x % len(params)].mul_(0.5 + (x % 7) / 7)


def _run(arch: str, config: dict, ops: list) -> None:
    model = copy.deepcopy(BASE_MODELS[arch])
    llm = LLM(model, **config)
    engine = llm.engine
    watch = LivenessWatch(engine)
    versions = {0: copy.deepcopy(model)}
    specs: list[Spec] = []
    finished: dict[str, list] = {}

    def collect(outputs) -> None:
        for out in outputs:
            if out.finished:
                finished.setdefault(out.request_id, []).append(out)

    for kind, arg in ops:
        if kind == "add":
            try:
                arg.rid = engine.add_request(arg.prompt, arg.params)
            except ValueError:
                continue  # refused up front (e.g. the prompt alone does not fit): nothing to check
            specs.append(arg)
            watch.added(arg.rid, arg.params)
        elif kind == "step":
            for _ in range(arg):
                if engine.has_unfinished():
                    collect(watch.step())
        elif kind == "abort":
            live = [s for s in specs if s.rid not in finished]
            if live:
                target = live[arg % len(live)]
                n = target.params.n
                rid = target.rid if n == 1 or arg % 2 else f"{target.rid}#{arg % n}"
                out = engine.abort(rid)
                collect([out] if out is not None else [])
                watch.settle()
        else:
            _perturb(model, arg)
            collect(engine.check_weights())
            watch.weights_changed()
            versions[engine.weights.version] = copy.deepcopy(model)

    # Liveness: every sequence the engine still holds ends within the documented bound.
    live_seqs = [
        (len(s.prompt), s.params.max_tokens)
        for s in specs
        if s.rid not in finished
        for _ in range(s.params.n)
    ]
    bound = sum(p + m + 1 for p, m in live_seqs) + 2
    drain = 0
    while engine.has_unfinished():
        assert drain <= bound, f"not drained within {bound} steps"
        collect(watch.step())
        drain += 1

    assert engine.block_manager.num_used_blocks == 0
    slots = engine.block_manager.slots
    assert slots is None or slots.num_free == slots.num_slots, "a state slot was not freed"
    assert set(finished) == {s.rid for s in specs}
    assert all(len(v) == 1 for v in finished.values()), "a request ended twice"
    s = engine.stats
    assert s.requests_finished + s.requests_aborted + s.requests_failed == sum(sp.params.n for sp in specs)
    _check_outputs(specs, finished, versions, config)


def _check_greedy(model, prompt: list[int], got: list[int], near_ties: list[int]) -> None:
    """``got`` against ``generate()`` under the oracle's near-tie rule (the exact top two, within the
    fp32 margin); after a divergence ``generate()`` continues from cbgen's tokens, so the rest is
    checked too."""
    context, rest = list(prompt), list(got)
    while rest:
        ref = hf_greedy(model, context, len(rest))
        if rest == ref:
            return
        j = next(k for k in range(len(rest)) if rest[k] != ref[k])
        check_divergence(model, context + rest[:j], rest[j], ref[j])
        near_ties.append(len(got) - len(rest) + j)
        context += rest[: j + 1]
        rest = rest[j + 1 :]


def _check_outputs(specs: list[Spec], finished: dict, versions: dict, config: dict) -> None:
    near_ties: list[int] = []
    seeded: dict[int, list[tuple[Spec, object]]] = {}
    for spec in specs:
        out = finished[spec.rid][0]
        model = versions[out.weight_version]
        for c in out.outputs:
            reason = c.finish_reason
            assert reason in ("length", "abort", "error"), reason
            if reason == "length":
                assert len(c.token_ids) == spec.params.max_tokens
            if spec.params.temperature == 0.0:
                _check_greedy(model, spec.prompt, c.token_ids, near_ties)
        if spec.params.seed is not None and all(c.finish_reason == "length" for c in out.outputs):
            seeded.setdefault(out.weight_version, []).append((spec, out))
        if (
            spec.params.prompt_logprobs is not None
            and out.prompt_logprobs is not None
            and out.outputs[0].token_ids
        ):
            _check_prompt_logprobs(model, spec.prompt, out.prompt_logprobs)
    assert len(near_ties) <= 1, f"more than one near-tie in one example: {near_ties}"
    for version, items in seeded.items():
        roomy = LLM(versions[version], block_size=16, max_num_batched_tokens=4096, async_scheduling=False)
        refs = roomy.generate([s.prompt for s, _ in items], [s.params for s, _ in items], use_tqdm=False)
        for (_, out), ref in zip(items, refs):
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]


def _check_prompt_logprobs(model, prompt: list[int], got: list) -> None:
    assert len(got) == len(prompt) and got[0] is None
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)
    for pos in range(1, len(prompt)):
        assert got[pos][prompt[pos]] == pytest.approx(float(logp[pos - 1, prompt[pos]]), abs=1e-4)


@pytest.mark.parametrize("arch", sorted(BASE_MODELS))
def test_engine_fuzz(arch):
    start = time.monotonic()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=DERANDOMIZE,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(scenarios())
    def run(scenario):
        config, ops = scenario
        _run(arch, config, ops)

    rounds = 0
    while True:
        run()
        rounds += 1
        if time.monotonic() - start >= SECONDS:
            break
    print(f"{arch}: {rounds * EXAMPLES} examples in {time.monotonic() - start:.1f}s")
