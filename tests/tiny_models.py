"""Tiny random models of each supported architecture, built from configs (nothing is downloaded)."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    # Window 24 < the longest sequences in the tests, so the sliding layers really slide.
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": 24,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 16,
        },
    ),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
}


# Spread of the draws :func:`perturb_vectors` adds to biases and to every other vector parameter.
BIAS_SPREAD = 0.1
SCALE_SPREAD = 0.2


def perturb_vectors(model: torch.nn.Module, seed: int) -> None:
    """Adds seeded normal draws to every parameter of fewer than two dimensions (biases, norm weights,
    any per-channel scale), in place.

    Why: transformers initialises biases to zero and norm weights to one (or to zero where the norm
    scales by ``1 + weight``, as Gemma's do), and a kernel that dropped such a bias or ignored such a
    weight would compute the same numbers as the model on those values.  Adding the draws keeps each
    vector's centre (1 stays the neutral scale of a ``weight * x`` norm, 0 of a ``(1 + weight) * x``
    one), so every scale lies near its neutral value with a spread of :data:`SCALE_SPREAD`, five
    spreads from zero (the smallest drawn is about 0.26: no channel is switched off or flipped, and
    the logits stay as peaked as before), and every bias has a spread of :data:`BIAS_SPREAD`, next to
    projections of unit-scale inputs whose outputs have a spread of about 0.6 (hidden 64) to 1.3
    (hidden 256).

    The draws come from a generator of their own, after the matrices were drawn, so the matrices keep
    the values they had before the vectors were perturbed; in float32 for every dtype, so a bfloat16
    model holds the rounded values of the float32 one of the same seed.
    """
    gen = torch.Generator().manual_seed(0x5EED + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or not p.is_floating_point():
                continue
            spread = BIAS_SPREAD if name.endswith("bias") else SCALE_SPREAD
            draw = torch.randn(p.shape, generator=gen) * spread
            p.copy_((p.float() + draw).to(p.dtype))


def make_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """A randomly initialised causal LM of ``arch`` in eval mode."""
    config_name, extra = ARCHS[arch]
    config_cls = getattr(transformers, config_name)
    kwargs = {**COMMON, **extra, **overrides}
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=dtype, attn_implementation="sdpa" if arch != "gemma2" else "eager"
    )
    return _initialised(model, seed)


def _initialised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with the tests' weights, in eval mode: matrices drawn larger than the default 0.02
    (logits less flat, so greedy ties are rare), vectors perturbed (:func:`perturb_vectors`)."""
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    perturb_vectors(model, seed)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.eval()


def make_prompts(
    n: int, lengths: tuple[int, int] = (3, 90), vocab: int = 512, seed: int = 0
) -> list[list[int]]:
    """``n`` random prompts with lengths spread over ``lengths`` (token 0-2 avoided)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = lengths
    out = []
    for i in range(n):
        length = lo + (hi - lo) * i // max(n - 1, 1)
        out.append(torch.randint(3, vocab, (length,), generator=g).tolist())
    return out


# Wide enough that every projection group reaches the packing threshold (``packed_linears.py``
# ``_PACK_MIN_ELEMS``, 65,536 weights: o_proj is 256 x 256), so the packed and panel GEMMs, the fused
# forward and the one-call C decode step run as they do on a real model.  Still ~2.5M parameters.
WIDE_COMMON = dict(
    COMMON,
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=1024,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
# Per-architecture settings of the wide models (replacing ARCHS' narrow head_dim 16).  Windows are
# shorter than the tests' longest sequences, so the sliding layers really slide.
WIDE_ARCHS: dict[str, dict] = {
    "llama": {},
    "qwen2": {},  # q/k/v biases (Qwen2's default)
    "qwen3": {},  # q/k norms
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256},
    "mistral": {"sliding_window": 32},
    "gemma2": {"sliding_window": 32, "query_pre_attn_scalar": 64},
    "phi3": {},
    "olmo2": {},
}


def make_wide_model(
    arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> torch.nn.Module:
    """A randomly initialised wide causal LM of ``arch`` (:data:`WIDE_ARCHS`) in eval mode."""
    extra = {k: v for k, v in ARCHS[arch][1].items() if k != "head_dim"}
    return make_model(
        arch, seed=seed, dtype=dtype, **{**WIDE_COMMON, **extra, **WIDE_ARCHS[arch], **overrides}
    )


# Models with state layers, one per mixer kind, from the support matrix's shrunk configs
# (tests/matrix/shrink.py): kind -> transformers model type.
STATE_KINDS: dict[str, str] = {
    "gdn": "qwen3_5_text",  # Gated DeltaNet 3:1 with gated full attention (Qwen3.5), chunk 64
    "mamba2": "nemotron_h",  # Mamba2 and attention layers (Nemotron-H), chunk 16 in the tiny config
    "mamba1": "mamba",  # pure Mamba1, a sequential scan: prompts cut anywhere
    "conv": "lfm2",  # short convolution and attention (LFM2), no recurrent state
    "hybrid_layer": "falcon_h1",  # attention and Mamba2 in the same layer (Falcon-H1)
}


def _shrink():
    """tests/matrix/shrink.py under a name of its own (tests/matrix is not a package, and the name
    ``matrix`` is its harness module's)."""
    import importlib.util
    import pathlib
    import sys

    name = "cbgen_tests_shrink"
    if name not in sys.modules:
        path = pathlib.Path(__file__).parent / "matrix" / "shrink.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def make_state_model(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny random model with state layers of ``kind`` (a key of :data:`STATE_KINDS`), eval mode."""
    return _shrink().build_model(STATE_KINDS[kind], seed=seed, dtype=dtype)


def make_wide_state_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A Qwen3.5 hybrid (Gated DeltaNet, then gated full attention) wide enough that its projections
    run the packed GEMMs (every weight over the packing threshold, as in :data:`WIDE_COMMON`)."""
    config = transformers.Qwen3_5TextConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return _initialised(transformers.Qwen3_5ForCausalLM(config).to(dtype), seed)


# Models whose layers cache keys and values of their own shapes (kind -> model type and the config
# fields changed from the support matrix's shrunk config).
KV_SHAPE_KINDS: dict[str, tuple[str, dict]] = {
    # Latent attention (DeepSeek V3's, also GLM-4.7-Flash's and Kimi K2's): keys of 24 + 16 = 40,
    # values of 16 per head, interleaved rope, a q LoRA.
    "mla": ("deepseek_v3", {"qk_nope_head_dim": 24, "v_head_dim": 16, "num_hidden_layers": 3}),
    # Gemma 4: 16-wide sliding layers (window 8, shorter than the prompts), 32-wide full layers with
    # keys and values from one projection, and the last two layers reading earlier layers' KV.
    "gemma4": (
        "gemma4_text",
        {
            "num_hidden_layers": 5,
            "layer_types": ["sliding_attention", "full_attention"]
            + ["sliding_attention"] * 2
            + ["full_attention"],
            "attention_k_eq_v": True,
            "num_kv_shared_layers": 2,
            "sliding_window": 8,
            "global_head_dim": 32,
        },
    ),
    # MiMo-V2-Flash: keys of 24 and values of 16, sinks, a sliding layer with its own KV heads.
    "mimo": ("mimo_v2_flash", {"head_dim": 24, "v_head_dim": 16, "sliding_window": 8}),
    # JetMoE: keys and values tiled top_k times before the attention call.
    "jetmoe": ("jetmoe", {}),
}


def make_kv_shape_model(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny random model of ``kind`` (a key of :data:`KV_SHAPE_KINDS`), eval mode, weights drawn as
    the support matrix draws them."""
    shrink = _shrink()
    model_type, overrides = KV_SHAPE_KINDS[kind]
    base = shrink.build_config(model_type)
    fields = base.to_dict()
    if "layer_types" in overrides:
        fields.pop("per_layer_config", None)  # derived again from the new layer types
    for key in ("model_type", "transformers_version"):
        fields.pop(key, None)
    config = type(base)(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    shrink.randomize(model)
    return model.eval()
