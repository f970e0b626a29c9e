"""The support matrix: every entry of the installed transformers' causal-LM mapping, run by cbgen
against ``generate()``, and classified as exact, refused (with cbgen's reason) or wrong/crashed.

Each architecture gets a tiny random model (:mod:`shrink`), 4 prompts of mixed lengths and 16
greedy tokens each in float32, generated with a token budget smaller than the longest prompt (so it
is prefilled in chunks), then one more prompt that shares a prefix with an earlier one (a
prefix-cache hit).  Tokens are held to ``generate()`` by the oracle of ``tests/oracle.py``.

``python tests/matrix/matrix.py --dtypes float32,bfloat16 --write docs/models.md`` runs the whole
mapping in both dtypes and writes the table (``make models``); ``--only a,b`` runs some entries.
In bfloat16 the tokens are held to ``generate()`` of the same bf16 model under the oracle's bf16
near-tie rule.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the oracle

import shrink  # noqa: E402

import oracle  # noqa: E402
from cbgen import LLM, SamplingParams  # noqa: E402
from cbgen.model.support import UnsupportedModelError  # noqa: E402

TOKENS = 16
PROMPT_LENGTHS = (5, 19, 37, 60)
BUDGET = 32  # < the longest prompt: it is prefilled in two chunks
BLOCK = 8

EXACT, EXACT_FORWARD, BF16_BOTH, BF16_ROUTING, REFUSED, WRONG, CRASHED, NO_CONFIG, NO_REFERENCE = (
    "exact",
    "exact vs forward",
    "bf16 diverges, as generate()",
    "bf16 routing near-tie",
    "refused",
    "wrong",
    "crashed",
    "config not built",
    "reference failed",
)
# Results that are defects: the matrix test fails on them.
DEFECTS = (WRONG, CRASHED)


@dataclass
class Result:
    """One architecture's outcome: ``kind`` is one of the constants above, ``path`` the forward
    cbgen took (``fused`` C forward or ``module`` forward, and the attention backend), ``detail``
    the refusal reason or the error."""

    model_type: str
    class_name: str
    kind: str
    path: str = ""
    detail: str = ""
    seconds: float = 0.0


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _references(model, prompts: list[list[int]]) -> list[list[int]]:
    return [oracle.hf_greedy(model, p, TOKENS) for p in prompts]


def _holds(model, prompts: list[list[int]], got: list[list[int]], refs: list[list[int]], rule) -> bool:
    """Whether ``got`` equals ``refs`` under the oracle's ``rule``."""
    oracle.reset_near_ties()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            oracle.compare(model, prompts, got, refs, rule)
    except AssertionError:
        return False
    return True


def _router_gap(exact, prompts: list[list[int]], got: list[list[int]]) -> tuple[float, float] | None:
    """For an MoE model: the smallest gap, over the float32 forward of every prompt plus its
    generated tokens, between a router's k-th and (k+1)-th expert logit, and the bf16 resolution
    at the routers' largest logit (two ulps).  None for a model without a recognisable router."""
    config = getattr(exact.config, "get_text_config", lambda: exact.config)()
    experts = next(
        (getattr(config, n) for n in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
         if isinstance(getattr(config, n, None), int)),
        None,
    )  # fmt: skip
    k = getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_k", None)
    if not experts or not k or k >= experts:
        return None
    routers = [
        m
        for n, m in exact.named_modules()
        if n.rsplit(".", 1)[-1] in ("gate", "router", "gate_proj_router")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.shape[0] == experts
    ]
    if not routers:
        return None
    seen: list[torch.Tensor] = []

    def record(_module, _args, out):
        seen.append((out[0] if isinstance(out, tuple) else out).detach().float().reshape(-1, experts))

    handles = [r.register_forward_hook(record) for r in routers]
    try:
        with torch.no_grad():
            for prompt, tokens in zip(prompts, got, strict=True):
                exact(torch.tensor([prompt + tokens]))
    finally:
        for h in handles:
            h.remove()
    if not seen:
        return None
    top = torch.cat(seen).topk(k + 1, dim=-1).values
    gap = float((top[:, k - 1] - top[:, k]).min())
    return gap, 2 * oracle.bf16_ulp(float(top.abs().max()))


def _forward_greedy(model, prompt: list[int]) -> list[int]:
    """Greedy continuation by one full forward per token (no cache) of ``model``: in float32 the
    definition of the model's output; for bf16 weights, their float32 forward, the quantity every
    bf16 computation approximates (``oracle.exact_model``)."""
    context = list(prompt)
    for _ in range(TOKENS):
        context.append(int(oracle.next_logits(model, context).argmax()))
    return context[len(prompt) :]


def run_one(model_type: str, dtype: torch.dtype = torch.float32) -> Result:
    """Builds, runs and classifies one entry of the mapping."""
    class_name = shrink.mapping()[model_type]
    start = time.perf_counter()
    result = Result(model_type, class_name, EXACT)
    try:
        model = shrink.build_model(model_type, dtype=dtype)
    except Exception as exc:
        result.kind, result.detail = NO_CONFIG, _first_line(exc)
        return result
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if isinstance(getattr(head, "weight", None), torch.Tensor) else shrink.VOCAB
    prompts = _prompts(min(vocab, shrink.VOCAB))
    # The prefix-hit prompt: the longest prompt's first 48 tokens (6 full blocks) and a new tail.
    hit_prompt = prompts[-1][:48] + prompts[1][:7]
    try:
        llm = LLM(model, max_num_batched_tokens=BUDGET, block_size=BLOCK, dtype=dtype)
    except UnsupportedModelError as exc:
        result.kind, result.detail = REFUSED, str(exc)
        result.seconds = time.perf_counter() - start
        return result
    except Exception as exc:
        result.kind, result.detail = CRASHED, "engine start: " + _first_line(exc)
        result.seconds = time.perf_counter() - start
        return result
    plan = llm.engine.runner.plan
    result.path = f"{plan.forward} / {plan.attention}"
    expect_hit = True
    if plan.cache.state_groups:
        # A state model's hit ends at a checkpoint, on a grid of lcm(block, mixer chunk) tokens
        # (cbgen.core.checkpoints): the hit prompt shares a prompt's first grid point.
        checkpoints = llm.engine.scheduler.block_manager.checkpoints
        if checkpoints is None:
            expect_hit = False
            result.detail = "no prefix hits: its state layers cannot continue a multi-token forward"
        elif checkpoints.grid > 48:
            g = torch.Generator().manual_seed(1)
            long = torch.randint(3, min(vocab, shrink.VOCAB), (checkpoints.grid + 8,), generator=g).tolist()
            prompts.append(long)
            hit_prompt = long[: checkpoints.grid] + prompts[1][:7]
    try:
        refs = _references(model, [*prompts, hit_prompt])
    except Exception as exc:
        result.kind, result.detail = NO_REFERENCE, _first_line(exc)
        return result
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    rule = oracle.FP32 if dtype == torch.float32 else oracle.BF16
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        hits_before = llm.stats.prefix_cache_hits
        got += [o.outputs[0].token_ids for o in llm.generate([hit_prompt], greedy, use_tqdm=False)]
        if expect_hit and llm.stats.prefix_cache_hits <= hits_before:
            raise AssertionError("the last prompt did not hit the prefix cache")
    except Exception as exc:
        result.kind, result.detail = CRASHED, _first_line(exc)
        result.seconds = time.perf_counter() - start
        return result
    oracle.reset_near_ties()
    prompts_all = [*prompts, hit_prompt]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            oracle.compare(model, prompts_all, got, refs, rule)
    except AssertionError as exc:
        result.kind, result.detail = WRONG, _first_line(exc)
        # generate() runs the model's cache path, which can disagree with the model's own forward
        # (the definition both approximate).  Greedy decoding by plain forwards settles which is off.
        exact = oracle.exact_model(model)
        forward_refs = [_forward_greedy(exact, p) for p in prompts_all]
        if _holds(model, prompts_all, got, forward_refs, rule):
            result.kind = EXACT_FORWARD
            result.detail = "equals greedy decoding by the model's own forward; generate() differs from it"
            if dtype != torch.float32:
                result.detail = (
                    "equals greedy decoding by the float32 forward of the bf16 weights within the bf16 "
                    "rule; bf16 generate() differs from it"
                )
        elif dtype != torch.float32 and not _holds(model, prompts_all, refs, forward_refs, rule):
            # A discrete choice near a tie inside the model (an MoE router's top-k) flips under bf16
            # rounding and sends the sequence elsewhere: transformers' own bf16 generate() leaves the
            # float32 reference too, so the bf16 rule cannot hold for any bf16 computation here.
            result.kind = BF16_BOTH
            result.detail = (
                "in bf16 both cbgen and generate() leave the float32 reference beyond the bf16 rule "
                "(near-tied discrete choices such as MoE routing); float32 is exact"
            )
        elif dtype != torch.float32 and (gap := _router_gap(exact, prompts_all, got)) is not None:
            gap_value, resolution = gap
            if gap_value < resolution:
                result.kind = BF16_ROUTING
                result.detail = (
                    f"an MoE router's top-k choice is tied within bf16 resolution on these sequences "
                    f"(float32 gap {gap_value:.2g} < {resolution:.2g}), so bf16 computations route "
                    "differently; float32 is exact"
                )
    result.seconds = time.perf_counter() - start
    return result


def run(model_types: list[str], dtype: torch.dtype = torch.float32, verbose: bool = True) -> list[Result]:
    """Runs every entry of ``model_types``, printing one line per entry as it finishes."""
    results = []
    for model_type in model_types:
        try:
            r = run_one(model_type, dtype)
        except Exception as exc:
            r = Result(
                model_type, shrink.mapping()[model_type], CRASHED, detail="harness: " + _first_line(exc)
            )
            traceback.print_exc()
        results.append(r)
        if verbose:
            print(
                f"{r.model_type:28s} {r.kind:17s} {r.path:18s} {r.seconds:5.1f}s {r.detail[:150]}", flush=True
            )
    return results


def quiet() -> None:
    """Silences transformers' and torch's per-model warnings (the table is the output)."""
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    logging.getLogger("cbgen").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    import table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types (default: the whole mapping)")
    parser.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    parser.add_argument("--write", help="write the markdown table to this file")
    args = parser.parse_args(argv)
    quiet()
    types = args.only.split(",") if args.only else list(shrink.mapping())
    by_dtype = {}
    for name in args.dtypes.split(","):
        print(f"--- {name}", flush=True)
        by_dtype[name] = run(types, getattr(torch, name))
        print(", ".join(f"{k}: {v}" for k, v in table.counts(by_dtype[name]).items()), flush=True)
    if args.write:
        with open(args.write, "w") as f:
            f.write(table.markdown(by_dtype))
    return 1 if any(r.kind in DEFECTS for results in by_dtype.values() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
