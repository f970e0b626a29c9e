"""The built-in benchmark workloads and the models they run on; everything here is deterministic.

A workload is a list of token-id prompts plus per-request output lengths and sampling settings.
Every workload uses ``ignore_eos`` so that each engine does exactly the same amount of work, and the
greedy ones can be compared token for token.

Models: ``smollm2`` is the bundled SmolLM2-135M-Instruct (converted once by
:func:`cbgen.model.loading.loader.ensure_default_model`); ``tiny`` is a random 2-layer Llama built from a
config, so the per-step model cost is close to nothing and engine overhead dominates.  Any other
model key is taken as a local Hugging Face folder.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# ``long`` (one sequence at a time at long contexts) is run by :mod:`cbgen_bench.long_context`, not
# built here.
WORKLOAD_NAMES: tuple[str, ...] = ("chat", "overhead", "grpo", "mixed", "long")
DEFAULT_SUITE: tuple[str, ...] = ("chat", "overhead")
FULL_SUITE: tuple[str, ...] = WORKLOAD_NAMES

# Which model each workload runs on unless ``--model`` overrides it.  ``mixed`` runs on the tiny
# model: with prompts up to 1,024 and outputs up to 512 tokens, static batching would need a
# 200 x 1,536-token fp32 cache (about 9 GiB for SmolLM2), and the point of the workload is scheduling
# under heavy-tailed lengths, not model speed.
DEFAULT_MODELS: dict[str, str] = {
    "chat": "smollm2",
    "overhead": "tiny",
    "grpo": "smollm2",
    "mixed": "tiny",
    "long": "smollm2",
}

TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    # Long enough for the largest ``mixed`` request (1,024 prompt + 512 output tokens).
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
# Ids 0-2 are the tiny model's pad/bos/eos; synthetic prompts avoid them.
FIRST_ORDINARY_ID = 3

# Combinations of ``cbgen.prompts.SYSTEM_PROMPTS`` (indices, joined by a space) used as the chat
# workload's system prompts, cycled over the 64 prompts.  Chosen so that, with SmolLM2's tokenizer,
# every prompt is 45-208 tokens, the total is 6,810 tokens (the vLLM reference run used 6,814), and no
# instruction meets the same system prompt twice (which would make whole prompts identical).
CHAT_SYSTEM_VARIANTS: tuple[tuple[int, ...], ...] = (
    (0, 1),
    (0, 2),
    (0, 1),
    (0, 3),
    (2,),
    (2, 3),
    (2,),
    (3,),
)


@dataclass
class Workload:
    """One benchmark workload: prompts, output lengths and sampling settings.

    ``max_tokens[i]`` is request ``i``'s exact output length (EOS is ignored everywhere).  With ``n > 1``
    each request has ``n`` samples that share its prompt.
    """

    name: str
    model: str
    prompts: list[list[int]]
    max_tokens: list[int]
    n: int = 1
    temperature: float = 0.0
    seed: int = 0
    description: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        """True when outputs are deterministic and can be compared across engines."""
        return self.temperature == 0.0

    @property
    def num_requests(self) -> int:
        """User requests (each with ``n`` samples)."""
        return len(self.prompts)

    @property
    def num_sequences(self) -> int:
        """Generated sequences: requests times ``n``."""
        return len(self.prompts) * self.n

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens, each request's prompt counted once even when ``n > 1``."""
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        """Tokens every engine must generate."""
        return sum(self.max_tokens) * self.n

    @property
    def total_tokens(self) -> int:
        """Prompt plus output tokens; the numerator of "total tokens/s" for every engine alike."""
        return self.prompt_tokens + self.output_tokens

    def expanded(self) -> Workload:
        """The same work as ``n``-times more independent single-sample requests (no prompt sharing)."""
        if self.n == 1:
            return self
        prompts = [p for p in self.prompts for _ in range(self.n)]
        max_tokens = [m for m in self.max_tokens for _ in range(self.n)]
        return dataclasses.replace(self, prompts=prompts, max_tokens=max_tokens, n=1)

    def summary(self) -> dict[str, Any]:
        """JSON-ready description (prompts themselves left out)."""
        lengths = [len(p) for p in self.prompts]
        return {
            "name": self.name,
            "model": self.model,
            "description": self.description,
            "num_requests": self.num_requests,
            "n": self.n,
            "num_sequences": self.num_sequences,
            "greedy": self.greedy,
            "temperature": self.temperature,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prompt_len_min": min(lengths),
            "prompt_len_max": max(lengths),
            "max_tokens_min": min(self.max_tokens),
            "max_tokens_max": max(self.max_tokens),
            **self.info,
        }


# --------------------------------------------------------------------------- builders


def _fold(ids: list[int], vocab_size: int) -> list[int]:
    """Maps token ids into a smaller vocabulary, keeping them clear of the tiny model's special ids."""
    if all(t < vocab_size for t in ids):
        return ids
    span = vocab_size - FIRST_ORDINARY_ID
    return [FIRST_ORDINARY_ID + t % span for t in ids]


def chat_prompts(count: int, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """``count`` chat-template prompts: each built-in instruction paired with a system prompt of varied length.

    ``tokenizer`` must have a chat template.  Ids are folded into ``vocab_size`` when the benchmarked
    model's vocabulary is smaller than the tokenizer's (the tiny model in tests).
    """
    from cbgen.prompts import CHAT_INSTRUCTIONS, SYSTEM_PROMPTS

    k = len(CHAT_INSTRUCTIONS)
    out = []
    for i in range(count):
        # The ``i // k`` shift pairs each instruction with a different system prompt on its second pass.
        variant = CHAT_SYSTEM_VARIANTS[(i + i // k) % len(CHAT_SYSTEM_VARIANTS)]
        system = " ".join(SYSTEM_PROMPTS[j] for j in variant)
        conv = [{"role": "system", "content": system}, {"role": "user", "content": CHAT_INSTRUCTIONS[i % k]}]
        ids = tokenizer.apply_chat_template(
            conv, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        out.append(_fold([int(t) for t in ids], vocab_size))
    return out


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts of the given lengths with uniform random ordinary token ids."""
    rng = np.random.default_rng(seed)
    return [rng.integers(FIRST_ORDINARY_ID, vocab_size, size=n).tolist() for n in lengths]


def heavy_tailed_lengths(
    count: int, lo: int, hi: int, median: float, sigma: float, rng: np.random.Generator
) -> list[int]:
    """Log-normal lengths clipped to ``[lo, hi]``: most are short, a few are very long."""
    raw = rng.lognormal(mean=math.log(median), sigma=sigma, size=count)
    return np.clip(np.rint(raw), lo, hi).astype(int).tolist()


def build_workload(
    name: str, *, tiny: bool, model: str, vocab_size: int, tokenizer: Any = None, scale: float = 1.0
) -> Workload:
    """Builds workload ``name`` for a model with ``vocab_size`` ids.

    ``tiny`` shrinks it to a few prompts and tokens (for tests); ``scale`` keeps that share of the
    chat and grpo prompts (the first ones), for models too slow for the full sets.  ``tokenizer`` (with a chat template)
    is needed by ``chat`` and ``grpo``; without one, SmolLM2's tokenizer is loaded and ids are folded.
    """
    if name not in WORKLOAD_NAMES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    if name == "long":
        raise ValueError("the long workload is run by cbgen_bench.long_context, one request at a time")
    if name in ("chat", "grpo") and (tokenizer is None or not getattr(tokenizer, "chat_template", None)):
        tokenizer = smollm2_tokenizer()

    if name == "chat":
        count, new = (2, 4) if tiny else (max(1, round(64 * scale)), 128)
        prompts = chat_prompts(count, tokenizer, vocab_size)
        return Workload(
            name,
            model,
            prompts,
            [new] * count,
            description=f"{count} chat-template prompts, {new} new tokens each, greedy, ignore_eos",
        )
    if name == "overhead":
        count, lo, hi, new = (8, 8, 16, 8) if tiny else (256, 8, 64, 64)
        lengths = [lo + (hi - lo) * i // max(count - 1, 1) for i in range(count)]
        # Interleave short and long prompts so every prefill chunk mixes sizes.
        lengths = lengths[0::2] + lengths[1::2][::-1]
        return Workload(
            name,
            model,
            random_prompts(lengths, vocab_size, seed=1),
            [new] * count,
            description=f"{count} random prompts of {lo}-{hi} tokens, {new} new tokens, greedy, ignore_eos",
        )
    if name == "grpo":
        count, n, new = (2, 4, 8) if tiny else (max(1, round(16 * scale)), 8, 128)
        prompts = chat_prompts(count, tokenizer, vocab_size)
        return Workload(
            name,
            model,
            prompts,
            [new] * count,
            n=n,
            temperature=1.0,
            seed=1234,
            description=f"{count} chat prompts x n={n} samples, temperature 1.0, {new} new tokens, ignore_eos",
        )
    # mixed
    count, p_hi, o_hi = (12, 64, 24) if tiny else (200, 1024, 512)
    rng = np.random.default_rng(7)
    p_lens = heavy_tailed_lengths(count, 4, p_hi, median=p_hi / 16, sigma=1.1, rng=rng)
    o_lens = heavy_tailed_lengths(count, 4, o_hi, median=o_hi / 12, sigma=1.1, rng=rng)
    # Pin the extremes so the tails always reach the stated range.
    p_lens[0], o_lens[1] = p_hi, o_hi
    return Workload(
        name,
        model,
        random_prompts(p_lens, vocab_size, seed=8),
        o_lens,
        description=(
            f"{count} requests, log-normal prompt 4-{p_hi} and output 4-{o_hi} tokens, all submitted at once, "
            "greedy, ignore_eos"
        ),
    )


# --------------------------------------------------------------------------- models


def smollm2_path() -> str:
    """Folder of the converted SmolLM2-135M-Instruct (converted on first use)."""
    from cbgen.model.loading.loader import ensure_default_model

    return str(ensure_default_model())


def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer (for chat prompts on models without one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path(), local_files_only=True)


def make_tiny_model(dtype: Any = None, device: Any = None, seed: int = 0) -> Any:
    """The random tiny Llama of the ``overhead`` workload (see :data:`TINY_CONFIG`)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**TINY_CONFIG)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    # The default 0.02 init gives nearly flat logits; greedy near-ties would make cross-engine token
    # comparisons flaky for reasons that have nothing to do with the engines.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = TINY_CONFIG["eos_token_id"]
    model.generation_config.pad_token_id = TINY_CONFIG["pad_token_id"]
    model = model.to(dtype=dtype or torch.float32)
    if device is not None:
        model = model.to(device)
    return model.eval()


def model_path(key: str) -> str | None:
    """The safetensors folder behind a model key (None for the in-memory tiny model)."""
    if key == "tiny":
        return None
    if key == "smollm2":
        return smollm2_path()
    return key


def load_bench_model(key: str, dtype: str, device: str | None) -> tuple[Any, Any]:
    """Loads ``(model, tokenizer)`` for a model key; the tiny model has no tokenizer."""
    from cbgen.utils import resolve_device, resolve_dtype

    dev = resolve_device(device)
    if key == "tiny":
        return make_tiny_model(resolve_dtype(dtype, None, dev), dev), None
    from cbgen.model.loading.loader import load_model

    model, tokenizer = load_model(model_path(key), dtype=dtype, device=dev)
    return model.eval(), tokenizer


def vocab_size_of(model: Any) -> int:
    """The model's (text) vocabulary size."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(cfg.vocab_size)


# --------------------------------------------------------------------------- FLOPs


@dataclass
class ModelDims:
    """What the FLOP count needs to know about a model."""

    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    vocab_size: int
    layer_linears: list[tuple[int, int]]  # (in, out) of one decoder layer's matmuls
    matmul_params: int  # weights of every decoder-layer matmul (LM head and embeddings excluded)

    @property
    def lm_head_params(self) -> int:
        """Weights of the output projection."""
        return self.hidden_size * self.vocab_size


def model_dims(model: Any) -> ModelDims:
    """Reads layer count, head geometry and the decoder's ``nn.Linear`` shapes from ``model``."""
    import re

    import torch

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = int(cfg.num_attention_heads)
    head_dim = _attention_head_dim(model, cfg, heads)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    by_layer: dict[int, list[tuple[int, int]]] = {}
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        total += module.in_features * module.out_features
        match = re.search(r"layers\.(\d+)\.", name)
        if match:
            by_layer.setdefault(int(match.group(1)), []).append((module.in_features, module.out_features))
    first = by_layer[min(by_layer)] if by_layer else []
    return ModelDims(
        int(cfg.num_hidden_layers), int(cfg.hidden_size), heads, head_dim, int(cfg.vocab_size), first, total
    )


def _attention_head_dim(model: Any, cfg: Any, heads: int) -> int:
    """The head size the attention FLOPs are counted at: latent attention's mean of its key and value
    sizes (``config.head_dim`` is the rope dimension there); for per-layer sizes (Gemma 4, whose
    config refuses a global ``head_dim``) the most common size among the attention modules."""
    if getattr(cfg, "qk_nope_head_dim", None) and getattr(cfg, "v_head_dim", None):
        return (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) // 2
    try:
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    except Exception:  # a per-layer attribute: read the modules
        sizes = [m.head_dim for m in model.modules() if isinstance(getattr(m, "head_dim", None), int)]
        return max(set(sizes), key=sizes.count) if sizes else cfg.hidden_size // heads


def _distinct_prefix_ends(prompts: list[list[int]]) -> list[int]:
    """The context length at the last token of every distinct prompt prefix (a trie walk: tokens of
    a prefix several prompts share are listed once)."""
    root: dict = {}
    ends = []
    for prompt in prompts:
        node = root
        for position, token in enumerate(prompt):
            child = node.get(token)
            if child is None:
                child = node[token] = {}
                ends.append(position + 1)
            node = child
    return ends


def workload_flops(workload: Workload, dims: ModelDims) -> dict[str, float]:
    """FLOPs of the minimal computation for ``workload``: each distinct prompt prefix once (a prefix
    that prompts share, such as a chat template's system prompt, is computed once with prefix
    caching, and an ``n``-sample request shares its prompt), each generated token once, the LM head
    only for rows that sample.

    Per token: ``2 * matmul_params`` plus attention ``4 * layers * heads * head_dim * context`` (QK^T and
    AV).  Returns prefill and decode parts and their sum.
    """
    attn = 4 * dims.num_layers * dims.num_heads * dims.head_dim
    prefill = sum(
        2 * dims.matmul_params + attn * context for context in _distinct_prefix_ends(workload.prompts)
    )
    decode = 0.0
    for prompt, new in zip(workload.prompts, workload.max_tokens):
        length = len(prompt)
        # Tokens 1..new-1 are fed back (the last sampled one never is); context grows from length + 1.
        fed = new - 1
        per_seq = 2 * dims.matmul_params * fed + attn * (fed * (length + 1) + fed * (fed - 1) / 2)
        decode += workload.n * (per_seq + 2 * dims.lm_head_params * new)
    return {"prefill": prefill, "decode": decode, "total": prefill + decode}
