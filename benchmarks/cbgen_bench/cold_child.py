"""One cold start of cbgen or transformers ``generate``: the child process of ``cbgen bench --cold-start``.

    python path/to/cold_child.py --spec spec.json --out result.json
    python -m cbgen_bench.cold_child --spec spec.json --out result.json   # same, for trying it by hand

It does what a user's script does, once and without any warm-up: import the library, load the model
from its folder, build the engine, generate the whole workload, and write ``time.time()`` marks
(``started``, ``imported``, ``loaded``, ``engine_ready``, ``outputs_done``) with the token ids as JSON.
The parent subtracts the moment it spawned this process, so interpreter start-up counts as import.

The benchmark runs this file by path, not with ``-m``: ``-m cbgen_bench.cold_child`` first imports
the ``cbgen_bench`` package, and whatever its ``__init__`` pulls in (torch, transformers or cbgen,
should it ever import them) would be charged to the engine measured and hidden from the ``imported``
mark.  So this file imports only the standard library at the top, and each engine imports its own
library.

``spec.json`` holds ``engine`` (``cbgen`` or ``hf-generate``), ``model`` (a folder), ``dtype``,
``device`` (or null), ``prompts`` (token-id lists), ``max_tokens`` (one per prompt), ``n``,
``temperature``, ``seed``, and for cbgen ``max_num_batched_tokens``, ``max_num_seqs``, ``block_size``,
``num_blocks``, for hf-generate ``batch_size`` (0: one batch).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

# Taken before anything heavy is imported: the interpreter is up and reading this file.
STARTED = time.time()

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
    # Run by path, Python puts this folder first on sys.path, where cli.py, report.py and the like
    # would shadow any top-level module of those names that torch or transformers imports.
    del sys.path[0]

Marks = dict[str, float | None]


def _peak_rss() -> int:
    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run_cbgen(spec: dict[str, Any], marks: Marks) -> tuple[list[list[list[int]]], dict[str, Any]]:
    """``LLM(folder, dtype=...)`` and one ``llm.generate`` over every token-id prompt."""
    from cbgen import LLM, SamplingParams

    marks["imported"] = time.time()
    # LLM() loads the model and builds the engine in one call.  To tell the two apart, the loader it
    # calls is wrapped to note when it returns; nothing else changes.  Should LLM stop going through
    # this function, "loaded" stays None and the report shows load and engine start together.
    import cbgen.model.loading.loader as loader

    original = loader.load_model

    def timed_load_model(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        marks["loaded"] = time.time()
        return out

    loader.load_model = timed_load_model
    try:
        llm = LLM(
            spec["model"],
            dtype=spec["dtype"],
            device=spec.get("device"),
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            max_num_seqs=spec["max_num_seqs"],
            block_size=spec["block_size"],
            num_blocks=spec["num_blocks"],
            enable_prefix_caching=True,
        )
    finally:
        loader.load_model = original
    marks["engine_ready"] = time.time()
    greedy = spec["temperature"] == 0.0
    # The same per-request parameters as the warm benchmark (cbgen_bench.cbgen_runner._cbgen_params).
    params = [
        SamplingParams(
            n=spec["n"],
            max_tokens=m,
            temperature=spec["temperature"],
            ignore_eos=True,
            seed=None if greedy else spec["seed"] + i,
        )
        for i, m in enumerate(spec["max_tokens"])
    ]
    outputs = llm.generate([list(p) for p in spec["prompts"]], params, use_tqdm=False)
    marks["outputs_done"] = time.time()
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, first: {errors[0]}")
    tokens = [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outputs]
    import cbgen

    settings = {
        "cbgen": cbgen.__version__,
        "api": "LLM(folder, dtype=...).generate(token ids)",
        "detokenizes": llm.tokenizer is not None,
        **{k: spec[k] for k in ("max_num_batched_tokens", "max_num_seqs", "block_size", "num_blocks")},
        "enable_prefix_caching": True,
    }
    return tokens, settings


def left_pad(prompts: list[list[int]], pad: int) -> tuple[Any, Any]:
    """``(input_ids, attention_mask)`` of a left-padded static batch (shared with ``hf_runners.py``,
    which imports it from here because this module must stay cheap to import)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


def run_hf_generate(spec: dict[str, Any], marks: Marks) -> tuple[list[list[list[int]]], dict[str, Any]]:
    """``from_pretrained`` and ``generate`` on left-padded static batches, as the warm ``hf-generate``
    runner does (:func:`cbgen_bench.hf_runners._hf_generate_once`), which this file cannot import."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    marks["imported"] = time.time()
    device = torch.device(spec.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=getattr(torch, spec["dtype"]), local_files_only=True
    )
    model = model.to(device).eval()
    marks["loaded"] = time.time()
    # generate() has no engine to build: the loaded model is ready.
    marks["engine_ready"] = time.time()

    pad = 0
    for cfg in (getattr(model, "generation_config", None), model.config):
        if isinstance(getattr(cfg, "pad_token_id", None), int):
            pad = cfg.pad_token_id
            break
    greedy = spec["temperature"] == 0.0
    # top_k defaults to 50 in transformers; cbgen and vLLM sample from the full distribution.
    sampling = (
        {"do_sample": False}
        if greedy
        else {"do_sample": True, "temperature": spec["temperature"], "top_k": 0, "top_p": 1.0}
    )
    n = spec["n"]
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    bs = spec.get("batch_size") or len(prompts)
    tokens: list[list[list[int]]] = []
    for start in range(0, len(prompts), bs):
        batch, wants = prompts[start : start + bs], max_tokens[start : start + bs]
        ids, mask = left_pad(batch, pad)
        # Static batching: every row runs as long as the longest request of its batch.
        new = max(wants)
        config = GenerationConfig(
            max_new_tokens=new,
            min_new_tokens=new,
            eos_token_id=[],
            pad_token_id=pad,
            num_return_sequences=n,
            **sampling,
        )
        if not greedy:
            torch.manual_seed(spec["seed"] + start)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config
            )
        rows = out[:, ids.shape[1] :].tolist()  # waits for the device, so the outputs are in hand
        for i, want in enumerate(wants):
            tokens.append([rows[i * n + j][:want] for j in range(n)])
    marks["outputs_done"] = time.time()
    settings = {
        "transformers": transformers.__version__,
        "batch_size": bs,
        "padding": "left",
        "attn_implementation": model.config._attn_implementation,
    }
    return tokens, settings


RUNNERS = {"cbgen": run_cbgen, "hf-generate": run_hf_generate}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs ``spec["engine"]`` cold and returns its marks, token ids, settings and peak RSS."""
    marks: Marks = {"started": STARTED, "imported": None, "loaded": None, "engine_ready": None}
    tokens, settings = RUNNERS[spec["engine"]](spec, marks)
    return {
        "engine": spec["engine"],
        "marks": marks,
        "tokens": tokens,
        "output_tokens": sum(len(t) for seqs in tokens for t in seqs),
        "settings": settings,
        "peak_rss_bytes": _peak_rss(),
    }


def main() -> None:
    """Command-line entry: ``--spec IN.json --out OUT.json``."""
    parser = argparse.ArgumentParser(description="One cold start of cbgen or hf-generate on one workload.")
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    result = run(json.loads(args.spec.read_text()))
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
