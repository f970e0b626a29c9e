"""One rank of a distributed test, started by ``torchrun`` from tests/distributed/test_*.py.

``python -m torch.distributed.run --standalone --nproc-per-node 2 worker.py SCENARIO[:ARCH][,...] OUT_DIR``
writes ``OUT_DIR/<scenario>-<arch>-rank<r>.json``; the tests read and compare the ranks' files.
Everything runs on CPU with gloo.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

from transformers import AutoModelForCausalLM  # noqa: E402

from cbgen import LLM, SamplingParams  # noqa: E402
from cbgen.core.update import SampledTokens  # noqa: E402
from cbgen.distributed import generate_dp  # noqa: E402
from cbgen.lockstep import Ingress, Lockstep  # noqa: E402
from cbgen.topology import Topology  # noqa: E402
from oracle import compare, hf_greedy  # noqa: E402
from tiny_models import make_model  # noqa: E402

PROMPTS = [[5, 6, 7, 8], list(range(20, 50)), [9, 10], list(range(60, 75))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
CONFIGS = [
    {"attention_backend": "torch", "decode_mode": "eager"},
    {"attention_backend": "cpu", "decode_mode": "eager", "fused_decode": True},
    {"attention_backend": "cpu", "decode_mode": "eager", "fused_decode": False},
    {"attention_backend": "cpu", "decode_mode": "static"},
    {"attention_backend": "torch", "decode_mode": "static"},
]


def _save_tiny(arch: str, out: Path, **overrides) -> Path:
    path = out / f"model-{arch}"
    if dist.get_rank() == 0:
        make_model(arch, vocab_size=300, **overrides).save_pretrained(path)
    dist.barrier()
    return path


def _tokens(outs) -> list:
    return [[c.token_ids for c in o.outputs] for o in outs]


def scenario_tp(out: Path, arch: str) -> dict:
    path = _save_tiny(arch, out)
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = [hf_greedy(full, p, GREEDY.max_tokens) for p in PROMPTS]
    result = {"configs": {}, "sampled": {}}
    for i, config in enumerate(CONFIGS):
        # The first config loads through the folder path, the others reuse one sharded module.
        if i == 0:
            llm = LLM(str(path), tensor_parallel_size=2, block_size=8, tokenizer=False, **config)
            sharded = llm.model
        else:
            llm = LLM(sharded, block_size=8, **config)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        near_ties = compare(full, PROMPTS, got, refs)
        result["configs"][str(i)] = {
            "tokens": got,
            "near_ties": near_ties,
            "kv_heads": llm.engine.kv_cache.geometry.num_kv_heads,
            "fused": llm.engine.runner.fused is not None,
            "blocks_free": llm.engine.block_manager.num_used_blocks == 0,
        }
        result["sampled"][str(i)] = _tokens(llm.generate([PROMPTS[0]], SAMPLED, use_tqdm=False))
    return result


def scenario_update(out: Path, arch: str) -> dict:
    path = _save_tiny(arch, out)
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")
    llm = LLM(sharded, block_size=8)
    first = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    batch = torch.tensor([list(range(30, 46))])
    for model in (full, sharded):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model.train()
        model(batch, labels=batch).loss.backward()
        opt.step()
        model.eval()
    second = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    refs = [o.outputs[0].token_ids for o in LLM(full, block_size=8).generate(PROMPTS, GREEDY, use_tqdm=False)]
    near_ties = compare(full, PROMPTS, second, refs)
    return {"first": first, "second": second, "near_ties": near_ties, "version": llm.weight_version}


def scenario_bad_heads(out: Path, arch: str) -> dict:
    path = _save_tiny(arch, out, num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
    sharded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")
    try:
        LLM(sharded, block_size=8)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def _record_local_work(llm) -> dict:
    """Spies on this rank's engine: the prompts its ``add_request`` took and the outputs its own
    ``generate`` returned, so the test sees each rank's share before the all-gather merges them."""
    seen: dict = {"added": [], "local": []}
    add_request, generate = llm.engine.add_request, llm.generate

    def recording_add(prompt_ids, *args, **kwargs):
        seen["added"].append(list(prompt_ids))
        return add_request(prompt_ids, *args, **kwargs)

    def recording_generate(prompts, *args, **kwargs):
        outs = generate(prompts, *args, **kwargs)
        seen["local"].extend(zip((list(p) for p in prompts), _tokens(outs)))
        return outs

    llm.engine.add_request, llm.generate = recording_add, recording_generate
    return seen


def scenario_dp(out: Path, arch: str) -> dict:
    path = _save_tiny(arch, out)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(model, block_size=8)
    prompts = [*PROMPTS, [11, 12, 13], [14, 15], list(range(80, 90))]
    assert len({tuple(p) for p in prompts}) == len(prompts)  # a prompt names its index below
    seen = _record_local_work(llm)
    tokens_before = llm.engine.stats.generated_tokens
    dp = _tokens(generate_dp(llm, prompts, GREEDY, use_tqdm=False))
    share = {
        "added": [prompts.index(p) for p in seen["added"]],
        "local": {prompts.index(p): toks for p, toks in seen["local"]},
        "generated_tokens": llm.engine.stats.generated_tokens - tokens_before,
    }
    alone = _tokens(LLM(model, block_size=8).generate(prompts, GREEDY, use_tqdm=False))
    unseeded = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    sampled = _tokens(llm.generate([PROMPTS[1]], unseeded, use_tqdm=False))
    seeded = _tokens(llm.generate([PROMPTS[1]], dataclasses.replace(unseeded, seed=5), use_tqdm=False))
    return {"dp": dp, "alone": alone, "share": share, "unseeded": sampled, "seeded": seeded}


# A rank stuck this long in one generate_dp call dumps its stack and exits: the error tests fail in
# seconds where a rank left behind in a collective would wait out the group's 30-minute timeout.
CALL_LIMIT_S = 30


def _attempt(call) -> dict:
    """One generate_dp call under the watchdog: its tokens, or the exception it raised."""
    faulthandler.dump_traceback_later(CALL_LIMIT_S, exit=True)
    try:
        return {"tokens": _tokens(call())}
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "notes": getattr(exc, "__notes__", [])}
    finally:
        faulthandler.cancel_dump_traceback_later()


def _fail_second_forward(llm) -> None:
    """This rank's next generation fails in its second forward (requests are in flight by then)."""
    execute, calls = llm.engine.runner.execute, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            llm.engine.runner.execute = execute
            raise RuntimeError("boom: the forward failed")
        return execute(*args, **kwargs)

    llm.engine.runner.execute = failing


def scenario_dp_errors(out: Path, arch: str) -> dict:
    """generate_dp calls that fail on one rank or on every rank, each caught and followed by a call
    that must work: every rank must raise the same error, and the next call must find the ranks in
    step (the watchdog ends a rank left waiting in a collective)."""
    path = _save_tiny(arch, out)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(model, block_size=8)
    rank = dist.get_rank()
    prompts = [*PROMPTS, [11, 12, 13]]

    def dp(batch, params=GREEDY):
        return generate_dp(llm, batch, params, use_tqdm=False)

    oov = [list(p) for p in prompts]
    if rank == 1:
        oov[1] = [9, 999, 10]  # in rank 1's own share; the tiny vocabulary has 300 ids
    result = {"oov": _attempt(lambda: dp(oov))}
    result["after_oov"] = _attempt(lambda: dp(prompts))
    result["params_len"] = _attempt(lambda: dp(prompts[:3], [GREEDY] * 2))  # wrong on every rank
    short = [GREEDY] * (len(prompts) - 1 if rank == 0 else len(prompts))
    result["params_len_rank0"] = _attempt(lambda: dp(prompts, short))  # wrong on rank 0 only
    if rank == 1:
        _fail_second_forward(llm)
    result["generation"] = _attempt(lambda: dp(prompts))
    result["after_generation"] = _attempt(lambda: dp(prompts))
    result["alone"] = _tokens(LLM(model, block_size=8).generate(prompts, GREEDY, use_tqdm=False))
    return result


def scenario_driver(out: Path, arch: str) -> dict:
    """Only the root takes requests (as ``cbgen serve`` does); the other rank follows its steps."""
    path = _save_tiny(arch, out)
    sharded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")
    llm = LLM(sharded, block_size=8)
    engine = llm.engine
    if dist.get_rank() != 0:
        engine.follow()
        return {"groups_left": len(engine.groups), "steps": engine.stats.steps}
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    victim = engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=50, ignore_eos=True))
    finished: dict = {}
    while engine.has_unfinished():
        if engine.stats.steps == 3:
            finished[victim] = engine.abort(victim)  # the final output comes back at once
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    for _ in range(3):
        engine.step()  # idle steps keep the follower in step (a server's heartbeat)
    engine.stop_followers()
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    got = [finished[i].outputs[0].token_ids for i in ids]
    near_ties = compare(full, PROMPTS, got, [hf_greedy(full, p, GREEDY.max_tokens) for p in PROMPTS])
    return {
        "near_ties": near_ties,
        "aborted": finished[victim].outputs[0].finish_reason,
        "groups_left": len(engine.groups),
        "steps": engine.stats.steps,
    }


def scenario_lockstep_cost(out: Path, arch: str) -> dict:
    """What the protocol adds to a step: an ingress, a schedule digest and 64 rows of sampled tokens."""
    lock = Lockstep(Topology(dist.get_rank(), 2, (0, 1)))
    rows = 64
    sampled = SampledTokens([1] * rows, [0.0] * rows, [-1.5] * rows, [0.0] * rows)
    for _ in range(5):
        lock.share(Ingress())
    start, steps = time.perf_counter(), 200
    for _ in range(steps):
        lock.share(Ingress())
        lock.share(12345)
        lock.share(sampled)
    return {"ms_per_step": (time.perf_counter() - start) / steps * 1e3}


def main() -> None:
    """``worker.py SCENARIO[:ARCH][,SCENARIO[:ARCH]...] OUT``: the scenarios one after another in one
    process group (one torchrun start for all of them); a scenario that raises writes its traceback,
    so only its own test fails."""
    specs, out = sys.argv[1].split(","), Path(sys.argv[2])
    dist.init_process_group("gloo")
    for spec in specs:
        scenario, _, arch = spec.partition(":")
        arch = arch or "llama"
        torch.manual_seed(0)
        try:
            result = globals()[f"scenario_{scenario}"](out, arch)
        except Exception:
            result = {"exception": traceback.format_exc()}
        result["rank"] = dist.get_rank()
        (out / f"{scenario}-{arch}-rank{dist.get_rank()}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
