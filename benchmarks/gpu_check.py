"""One-shot device check of the CUDA fast path; prints a markdown table last.

Sized for one H200 in under 8 minutes.  Models are bf16 with random weights built from configs
shaped like Qwen3-0.6B and Qwen3-4B (nothing can be downloaded on the device).

0. The CUDA-marked tests of ``tests/model/test_triton_cuda.py`` (bf16/fp16 ``tl.dot`` on tensor cores,
   the automatic split-K count of this device), compiled: each must pass (the dry run only checks
   that they are collected and skip by name).
1. Exactness: greedy tokens from decode CUDA graphs + Triton kernels vs eager with the torch
   backend, 64 prompts x 128 tokens.  In bf16, different kernels round differently, so a divergence
   is only accepted where the eager run's top-2 logit gap is a near-tie (< 2e-2 relative); the count
   is reported.  The Triton kernels are compared with the torch reference by relative norm
   (benchmarks/kernel_check.py, a reduced grid; it includes the flash_attn kernel when flash-attn is
   installed).  With flash-attn installed, the same greedy comparison runs for
   ``attention_backend="flash_attn"`` (``block_size=256``, which flash-attn 2's paged cache needs);
   without it that run is reported as skipped.
2. Throughput side by side, nano-vllm's workload: 256 requests, prompt and output lengths uniform in
   100..1024, ignore_eos.  cbgen vs transformers ``generate_batch`` and static ``generate``.
3. Decode roofline at batch 256: (weight bytes + KV bytes read) per decode step / step time, as a
   fraction of the copy bandwidth measured here.

``--dry-run`` runs every stage on tiny shapes on the CPU (graphs off, torch backend) to check the
script's logic without a GPU; the flash_attn run is skipped there.

Usage: ``python benchmarks/gpu_check.py [--dry-run] [--skip-4b] [--out results.json]``
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent

QWEN3_06B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
)
QWEN3_4B = dict(
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def build_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A random Qwen3 of the given shape, initialised on the device directly."""
    config = transformers.Qwen3Config(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm-style random prompts and output lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outputs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outputs


# ---------------------------------------------------------------------------- 1. exactness
FLASH_BLOCK_SIZE = 256  # flash-attn 2 pages KV only in multiples of 256 tokens


def _divergences(model, device, prompts, got, ref) -> tuple[int, int, int]:
    """(identical, near-tie divergences, real divergences) of ``got`` against ``ref``."""
    identical = sum(a == b for a, b in zip(got, ref))
    near_ties, real = 0, 0
    for p, a, b in zip(prompts, got, ref):
        if a == b:
            continue
        j = next(k for k in range(len(a)) if a[k] != b[k])
        with torch.no_grad():
            logits = model(torch.tensor([p + b[:j]], device=device)).logits[0, -1].float()
        top = logits.topk(2).values
        gap = float((top[0] - top[1]).abs() / top[0].abs().clamp_min(1e-6))
        if gap < 2e-2:
            near_ties += 1
        else:
            real += 1
    return identical, near_ties, real


def flash_skip_reason(model, device, dry: bool) -> str | None:
    """None when the flash_attn backend can run this model here, else why not."""
    if dry:
        return "dry run (flash-attn needs a CUDA GPU)"
    from cbgen.model.kernels.flash import ops as flash_ops

    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    head_dim = getattr(model.config, "head_dim", None)
    return flash_ops.unavailable_reason(device, dtype, FLASH_BLOCK_SIZE, head_dim)


def exactness(model, device, num_prompts: int, new_tokens: int, dry: bool) -> dict:
    from cbgen import LLM, SamplingParams

    prompts, _ = workload(num_prompts, 16, 256 if not dry else 40, model.config.vocab_size, seed=1)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    fast = LLM(
        model, max_num_seqs=num_prompts, decode_mode="auto" if not dry else "static", attention_backend="auto"
    )
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    backend = fast.engine.runner.backend
    graphs = len(fast.engine.runner.static.graphs) if fast.engine.runner.static else 0
    del fast
    flash_got, flash_graphs, flash_skip = None, 0, flash_skip_reason(model, device, dry)
    if flash_skip is None:
        flash = LLM(
            model, max_num_seqs=num_prompts, block_size=FLASH_BLOCK_SIZE, attention_backend="flash_attn"
        )
        assert flash.engine.runner.backend == "flash_attn"
        flash_got = [o.outputs[0].token_ids for o in flash.generate(prompts, params, use_tqdm=False)]
        flash_graphs = len(flash.engine.runner.static.graphs) if flash.engine.runner.static else 0
        del flash
    ref_llm = LLM(model, max_num_seqs=num_prompts, decode_mode="eager", attention_backend="torch")
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params, use_tqdm=False)]
    del ref_llm
    identical, near_ties, real = _divergences(model, device, prompts, got, ref)
    result = {
        "prompts": num_prompts,
        "new_tokens": new_tokens,
        "identical": identical,
        "near_tie_divergences": near_ties,
        "real_divergences": real,
        "backend": backend,
        "graphs": graphs,
    }
    if flash_got is None:
        print(f" flash_attn exactness skipped: {flash_skip}", flush=True)
        result["flash_attn"] = {"skipped": flash_skip}
    else:
        f_identical, f_near, f_real = _divergences(model, device, prompts, flash_got, ref)
        result["flash_attn"] = {
            "identical": f_identical,
            "near_tie_divergences": f_near,
            "real_divergences": f_real,
            "graphs": flash_graphs,
            "block_size": FLASH_BLOCK_SIZE,
        }
    gc.collect()
    return result


def kernel_check(dry: bool) -> int:
    sys.path.insert(0, str(HERE))
    import kernel_check as kc

    argv = (
        ["--dry-run"] if dry else ["--batches", "1", "64", "256", "--lens", "512", "4096", "--repeats", "10"]
    )
    return kc.main(argv)


CUDA_TESTS = HERE.parent / "tests" / "model" / "test_triton_cuda.py"


def cuda_tests(dry: bool) -> dict:
    """The CUDA-marked kernel tests (tensor-core branch, automatic split-K), in a child pytest with
    ``CBGEN_TEST_CUDA=1`` so the Triton kernels compile instead of running in the interpreter.  On a
    device every one of them must pass; the dry run only checks that they are collected and skip."""
    env = {**os.environ, "CBGEN_TEST_CUDA": "1"}
    env.pop("TRITON_INTERPRET", None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-m",
        "cuda",
        "-p",
        "no:cacheprovider",
        str(CUDA_TESTS),
    ]
    proc = subprocess.run(cmd, env=env, cwd=HERE.parent, capture_output=True, text=True, check=False)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    # On a device a skipped test is a branch left unchecked; in the dry run every one must skip.
    wanted, unwanted = ("skipped", "passed") if dry else ("passed", "skipped")
    ok = proc.returncode == 0 and counts.get(wanted, 0) > 0 and not counts.get(unwanted)
    return {"exit": proc.returncode, "counts": counts, "summary": tail, "ok": ok}


def tensor_parallel(dry: bool) -> dict:
    """benchmarks/tp_check.py on two ranks: NCCL over two GPUs when the machine has them (skipped
    with one), gloo on CPU in the dry run."""
    gpus = 0 if dry else torch.cuda.device_count()
    if not dry and gpus < 2:
        return {"skipped": f"{gpus} GPU(s): tensor parallelism needs 2", "ok": True}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(HERE / "tp_check.py"), "--device", "cpu" if dry else "cuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        return {"ok": False, "error": (proc.stdout + proc.stderr)[-600:]}
    return json.loads(line)


def step_syncs(model, device, dry: bool) -> dict:
    """Host syncs per decode step with overlap scheduling and a mixed sampled batch.

    ``torch.cuda.set_sync_debug_mode("warn")`` reports every synchronizing CUDA call; the target is
    at most one per step (the packed device-to-host copy of the sampled tokens).  On the CPU (dry
    run) there is nothing to count; the steps still run, to check this code.
    """
    import warnings

    from cbgen import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=32, decode_mode="auto" if not dry else "static")
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.05, logprobs=3),
        SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.3, seed=5),
    ]
    prompts, _ = workload(32, 16, 64, model.config.vocab_size, seed=3)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        p = kinds[i % len(kinds)]
        params = dataclasses.replace(p, max_tokens=48, ignore_eos=True)
        engine.add_request(prompt, params)
    for _ in range(4):  # prefill and the first decode steps, outside the count
        engine.step()
    counts = []
    on_cuda = device.type == "cuda"
    while engine.has_unfinished():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if on_cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                if on_cuda:
                    torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    del llm
    if not on_cuda:
        return {"steps": len(counts), "syncs_per_step_max": None, "syncs_per_step_median": None}
    return {
        "steps": len(counts),
        "syncs_per_step_max": max(counts, default=0),
        "syncs_per_step_median": statistics.median(counts) if counts else 0,
    }


# ---------------------------------------------------------------------------- 2. throughput
def run_cbgen(model, prompts, outs) -> float:
    from cbgen import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=256, max_num_batched_tokens=8192)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up (graphs are captured at start)
    sync(model.device)
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    sync(model.device)
    elapsed = time.perf_counter() - t
    assert [len(r.outputs[0].token_ids) for r in res] == outs
    del llm
    gc.collect()
    return sum(outs) / elapsed


def run_hf_cb(model, prompts, outs) -> float:
    from transformers import GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=max(outs), do_sample=False, eos_token_id=[], pad_token_id=0, max_batch_tokens=8192
    )
    model.generate_batch(inputs=prompts[:4], generation_config=gen)  # warm-up
    sync(model.device)
    t = time.perf_counter()
    # generate_batch has one max_new_tokens for all requests: time the full budget, count useful tokens.
    res = model.generate_batch(inputs=prompts, generation_config=gen)
    sync(model.device)
    elapsed = time.perf_counter() - t
    produced = sum(min(len(r.generated_tokens), o) for r, o in zip(res.values(), outs))
    return produced / elapsed


def run_hf_generate(model, prompts, outs) -> float:
    device = model.device
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    sync(device)
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max(outs),
            do_sample=False,
            eos_token_id=[],
            pad_token_id=0,
        )
    sync(device)
    # Static batching computes max(outs) tokens for every row; only the requested ones count.
    return sum(outs) / (time.perf_counter() - t)


# ---------------------------------------------------------------------------- 3. roofline
def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * a.numel() * a.element_size() / statistics.median(times)


def decode_roofline(model, device, batch: int, ctx: int) -> dict:
    from cbgen import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=batch, max_num_batched_tokens=max(8192, batch))
    engine = llm.engine
    vocab = model.config.vocab_size
    rng = random.Random(3)
    for _ in range(batch):
        engine.add_request(
            [rng.randrange(3, vocab) for _ in range(ctx)],
            SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
        )
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(3):
        engine.step()
    sync(device)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    g = engine.kv_cache.geometry
    kv_bytes = (
        sum(r.num_computed_tokens for r in engine.scheduler.running) * g.bytes_per_block() // g.block_size
    )
    bw = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 24)
    del llm
    gc.collect()
    return {
        "batch": batch,
        "ctx": ctx,
        "step_ms": step * 1e3,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "achieved_GBps": (weight_bytes + kv_bytes) / step / 1e9,
        "copy_GBps": bw / 1e9,
        "fraction": (weight_bytes + kv_bytes) / step / bw,
    }


# ---------------------------------------------------------------------------- main
def print_summary(results: dict, shapes: dict) -> None:
    """The closing markdown: one table row per model, then flash_attn, host syncs, the CUDA-marked
    tests and the kernel check."""
    print(
        "\n| model | exact / near-tie / real divergences | graphs | cbgen tok/s | generate_batch tok/s | generate tok/s "
        "| cbgen / generate_batch | decode BW fraction |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in shapes:
        r = results[name]
        e = r["exactness"]
        cb, hcb, hg = r.get("cbgen_tok_s"), r.get("hf_cb_tok_s"), r.get("hf_generate_tok_s")
        fmt = lambda x: f"{x:.0f}" if isinstance(x, float) else "-"  # noqa: E731
        ratio = f"{cb / hcb:.2f}x" if cb and hcb else "-"
        frac = f"{r['roofline']['fraction']:.0%}" if "roofline" in r else "-"
        print(
            f"| {name} | {e['identical']}/{e['near_tie_divergences']}/{e['real_divergences']} of {e['prompts']} "
            f"| {e['graphs']} ({e['backend']}) | {fmt(cb)} | {fmt(hcb)} | {fmt(hg)} | {ratio} | {frac} |"
        )
    for name in shapes:
        f = results[name]["exactness"]["flash_attn"]
        if "skipped" in f:
            print(f"\nflash_attn ({name}): skipped, {f['skipped']}")
        else:
            print(
                f"\nflash_attn ({name}, block {f['block_size']}): {f['identical']}/{f['near_tie_divergences']}/"
                f"{f['real_divergences']} exact / near-tie / real divergences of "
                f"{results[name]['exactness']['prompts']}, {f['graphs']} graphs"
            )
    for name in shapes:
        sy = results[name]["syncs"]
        print(
            f"\nhost syncs per decode step ({name}, overlap scheduling, mixed sampled batch, "
            f"{sy['steps']} steps): max {sy['syncs_per_step_max']}, median {sy['syncs_per_step_median']}"
        )
    ct = results["cuda_tests"]
    print(
        f"\nCUDA-marked tests ({CUDA_TESTS.name}: tensor-core branch, automatic split-K): {ct['summary']}"
        f"{'' if ct['ok'] else ' -- FAILED'}"
    )
    print(f"\ntensor parallel (2 ranks, benchmarks/tp_check.py): {results['tensor_parallel']}")
    print(f"\nkernel check exit code {results['kernels_exit']}; total {results['seconds']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--skip-4b", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    dry = args.dry_run
    if dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cpu" if dry else "cuda")
    if not dry and not torch.cuda.is_available():
        print("no CUDA device; use --dry-run")
        return 2
    dtype = torch.float32 if dry else torch.bfloat16
    t_start = time.perf_counter()
    results: dict = {"device": torch.cuda.get_device_name() if not dry else "cpu (dry run)"}

    shapes = (
        {"tiny": TINY}
        if dry
        else {"qwen3-0.6b": QWEN3_06B, **({} if args.skip_4b else {"qwen3-4b": QWEN3_4B})}
    )
    n_req, lo, hi = (8, 4, 24) if dry else (256, 100, 1024)

    results["kernels_exit"] = kernel_check(dry)
    results["cuda_tests"] = cuda_tests(dry)
    print(" cuda-marked tests:", results["cuda_tests"]["summary"], flush=True)
    results["tensor_parallel"] = tensor_parallel(dry)
    print(" tensor parallel:", results["tensor_parallel"], flush=True)
    for name, shape in shapes.items():
        print(f"== {name}", flush=True)
        model = build_model(shape, device, dtype)
        r: dict = {}
        r["exactness"] = exactness(model, device, 8 if dry else 64, 8 if dry else 128, dry)
        print(" exactness", r["exactness"], flush=True)
        r["syncs"] = step_syncs(model, device, dry)
        print(" syncs", r["syncs"], flush=True)
        if name != "qwen3-4b":  # the throughput and roofline targets are for the 0.6B shape
            prompts, outs = workload(n_req, lo, hi, shape["vocab_size"])
            r["cbgen_tok_s"] = run_cbgen(model, prompts, outs)
            print(f" cbgen {r['cbgen_tok_s']:.0f} tok/s", flush=True)
            try:
                r["hf_cb_tok_s"] = run_hf_cb(model, prompts, outs)
            except Exception as exc:  # report, never hide the rest of the check
                r["hf_cb_error"] = repr(exc)[:300]
            try:
                r["hf_generate_tok_s"] = run_hf_generate(model, prompts, outs)
            except Exception as exc:
                r["hf_generate_error"] = repr(exc)[:300]
            r["roofline"] = decode_roofline(model, device, 16 if dry else 256, 32 if dry else 512)
            print(" roofline", r["roofline"], flush=True)
        results[name] = r
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["seconds"] = time.perf_counter() - t_start

    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print_summary(results, shapes)
    ct = results["cuda_tests"]
    failed = (
        results["kernels_exit"] != 0
        or not ct["ok"]
        or not results["tensor_parallel"]["ok"]
        or any(
            results[n]["exactness"]["real_divergences"]
            or results[n]["exactness"]["flash_attn"].get("real_divergences")
            for n in shapes
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
