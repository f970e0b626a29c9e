"""Tiny random models for every entry of transformers' causal-LM mapping, from the config classes'
own defaults, shrunk generically.

The shrink sets every size attribute a config has (hidden size, layers, heads, KV heads,
intermediate sizes, experts, vocabulary, positions) to a small value, under the names the
transformers configs use for them (and their ``attribute_map`` aliases).  Layers are cut by index:
the kept layers are the first layer of each distinct kind, where a layer's kind is its entry in
every per-layer list (``layer_types``, ``mlp_layer_types``, per-layer floats), its membership in
every list of layer indices (``moe_layers``) and its ``per_layer_config`` override, so a hybrid
stays a hybrid and all per-layer attributes stay aligned.  Sub-configs (``text_config``,
``attn_config``, ...) are shrunk the same way and handed to the parent's constructor, so what the
parent derives from them is derived from the small values.  Where the generic shrink does not give
a valid config, :data:`OVERRIDES` adds the few settings it needs.  A config that still cannot be
built is reported with its error by the caller, never dropped.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Sequence

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 512
LAYERS = 2
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16

LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_blocks")
HEAD_COUNTS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads")
KV_HEAD_COUNTS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "kv_n_heads")
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_top_k", "moe_k")

# Size attributes under every name the configs use for them.  Only attributes the config already
# has are set, so a config never receives a field it does not know.
SIZES: dict[str, int] = {
    **dict.fromkeys(
        (
            "hidden_size",
            "n_embd",
            "d_model",
            "n_embed",
            "embed_dim",
            "dim",
            "hidden_size_global",  # blt's local encoder/decoder: the global transformer's width
            "backbone_hidden_size",  # gemma4 assistant: the target model's width
            # Multimodal towers' projections into the text model.
            "adapter_in_dim",
            "adapter_input_size",
            "adapter_out_dim",
            "out_hidden_size",
            "text_hidden_size",
            # Side embeddings (roc_bert) and audio-encoder channels (phi4_multimodal).
            "pronunciation_embed_dim",
            "shape_embed_dim",
            "ext_pw_out_channel",
            "depthwise_separable_out_channel",
            "nemo_conv_channels",
        ),
        HIDDEN,
    ),
    **dict.fromkeys(LAYER_COUNTS, LAYERS),
    **dict.fromkeys(HEAD_COUNTS, HEADS),
    **dict.fromkeys(KV_HEAD_COUNTS, KV_HEADS),
    # Separate head layouts of sliding layers (inkling2).
    **dict.fromkeys(("swa_num_attention_heads",), HEADS),
    **dict.fromkeys(("swa_num_key_value_heads",), KV_HEADS),
    # State-space heads: expand * hidden / 8 = 16 channels each.
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 8),
    **dict.fromkeys(("mamba_head_dim",), 16),
    **dict.fromkeys(("mamba_d_ssm",), 2 * HIDDEN),
    # Linear-attention (gated delta net, KDA) heads.
    **dict.fromkeys(("linear_num_heads", "linear_num_value_heads"), HEADS),
    **dict.fromkeys(("linear_num_key_heads",), KV_HEADS),
    **dict.fromkeys(("linear_head_dim", "linear_key_head_dim", "linear_value_head_dim"), HEAD_DIM),
    # Low-rank projections (qwen4_exp's hyper-connections).
    **dict.fromkeys(("hc_lowrank",), 16),
    **dict.fromkeys(
        (
            "intermediate_size",
            "n_inner",
            "ffn_dim",
            "ffn_hidden_size",
            "decoder_ffn_dim",
            "d_ff",
            "dim_ff",  # cpmant
            "dff",  # ctrl
            "intermediate_size_mlp",  # llama4's dense layers
            "dense_intermediate_size",
            "shared_intermediate_size",
            "feed_forward_size",  # reformer
            "mlp_dim",  # got_ocr2's vision tower
        ),
        128,
    ),
    **dict.fromkeys(
        ("head_dim", "kv_channels", "attention_head_dim", "attention_head_size", "swa_head_dim"), HEAD_DIM
    ),
    # Partial rotary embeddings (GPT-J, CodeGen): half the head, as in the real checkpoints.
    **dict.fromkeys(("rotary_dim",), HEAD_DIM // 2),
    **dict.fromkeys(
        (
            "vocab_size",
            "vocab_size_per_layer_input",
            "unpadded_vocab_size",  # inkling2: the LM head's width
            "encoder_hash_byte_group_vocab",  # blt: hash n-gram embedding buckets
            "pronunciation_vocab_size",  # roc_bert
            "shape_vocab_size",
        ),
        VOCAB,
    ),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_seq_len"), 256),
    **dict.fromkeys(EXPERT_COUNTS, 4),
    **dict.fromkeys(EXPERTS_PER_TOKEN, 2),
    **dict.fromkeys(
        (
            "moe_intermediate_size",
            "expert_intermediate_size",
            "shared_expert_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "expert_ffn_hidden_size",  # longcat_flash
        ),
        32,
    ),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts"), 1),
    **dict.fromkeys(("zero_expert_num",), 2),  # longcat_flash's identity experts
    **dict.fromkeys(("n_group", "topk_group"), 1),
    # Per-layer input embeddings (Gemma 3n / 4).
    **dict.fromkeys(("hidden_size_per_layer_input",), 16),
    # Latent-attention sizes (DeepSeek-style MLA).  The rotary part is a whole head: the configs
    # set ``head_dim = qk_rope_head_dim`` and the rotary embedding is built from ``head_dim``.
    **dict.fromkeys(("q_lora_rank",), 32),
    **dict.fromkeys(("kv_lora_rank", "o_lora_rank"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"), HEAD_DIM),
    # Windows shorter than the longest test sequence, so sliding layers really slide.
    **dict.fromkeys(
        (
            "sliding_window",
            "window_size",
            "sliding_window_size",
            "attention_window_size",
            "local_attention_window_len",
        ),
        24,
    ),
    # Sparse-attention indexers, with budgets below the longest test sequence so they select.
    **dict.fromkeys(("index_topk",), 32),
    **dict.fromkeys(("index_n_heads",), HEADS),
    **dict.fromkeys(("index_head_dim",), HEAD_DIM),
}
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# Strings with one character per layer (``"M*-M"``).
PATTERNS = ("hybrid_override_pattern",)
# Counts of the first / last layers that differ from the rest (dense layers before the MoE ones,
# layers reading another layer's KV cache): cut with the layers.
LEADING_LAYERS = ("first_k_dense_replace", "num_dense_layers")
TRAILING_LAYERS = ("num_kv_shared_layers",)
# Names that mark a list of ints as a list of layer indices (``moe_layers=[0, 1, ...]``).
INDEX_LIST_WORDS = ("layers", "layer_ids", "idxs", "indexes", "indices")

# Settings the generic shrink cannot infer, per model type.  Values for a sub-config (a dict under
# the sub-config's name) are merged into the shrunk sub-config.
OVERRIDES: dict[str, dict] = {
    # Hybrids whose default config has no attention layer at all (the released checkpoints have
    # some): one state-space layer and one attention layer.
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # default: None, read per layer
    "lfm2": {"full_attn_idxs": [1], "layer_types": ["conv", "full_attention"]},  # default: all attention
    # Attention every ``attn_layer_period`` layers: every second one, so two layers hold one.
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    # ``block_types`` is a cycle (recurrent, recurrent, attention): one whole cycle.
    "recurrent_gemma": {"num_hidden_layers": 3},
    # The default config gives rope parameters for no layer type, and the rotary embedding needs
    # them per type.
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    },
    # DbrxAttention reads ``attn_config.rope_theta``, which the attention config does not declare,
    # and clamps q/k/v by ``clip_qkv`` with no None case (DBRX uses 8).
    "dbrx": {"attn_config": {"rope_theta": 5e5, "clip_qkv": 8.0}},
    # The default config has no routed experts (None) although every layer is built as a MoE.
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # Its ``to_dict`` writes each layer as an (attention, mlp) pair and doubles the layer counts;
    # the layer stack is input / recurrent (looped) / output layers.
    "dory": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "num_hidden_layers": 3,
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
    },
    # A draft model that reads every layer's KV from its target: no per-layer inputs (its
    # validator requires 0; the default config has Gemma 4's nonzero ones).
    "gemma4_assistant": {
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
        }
    },
    # Its sliding layers' MLA head (a per-layer override) must satisfy head_dim = nope + rope.
    "dots3_note_text": {"per_layer_config": {2: {"head_dim": 2 * HEAD_DIM, "qk_nope_head_dim": HEAD_DIM}}},
    # Attention is built from ``attention_types`` ([[kinds], repeats]), not from a per-layer list.
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # The looped core is layers [start, end), both multiples of the attention-residual block size.
    "inkling2_loop_text": {
        "loop_layer_index_start": 1,
        "loop_layer_index_end": 2,
        "n_layers_per_attn_res_block": 1,
        "num_hidden_layers": 3,
        "layer_types": ["hybrid_sliding", "hybrid_sliding", "hybrid"],
    },
    # expand * hidden_size must equal num_heads * head_dim.
    "mamba2": {"num_heads": 8},
    # The default indexed-attention layers have no indexer sizes (all None).
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": HEAD_DIM,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
    },
    # The causal-LM head asserts a decoder.  Axial position shapes must multiply to the position
    # count and their widths sum to the hidden size; chunks shorter than the test sequences.
    "reformer": {
        "is_decoder": True,
        "axial_pos_shape": [16, 16],
        "axial_pos_embds_dim": [16, 48],
        "local_attn_chunk_length": 16,
        "lsh_attn_chunk_length": 16,
    },
    # Its q/k and v widths are rounded up to multiples of 64 (hidden_size * factor): a width
    # where the rounding is exact, as it is at the released sizes.
    "xlstm": {"hidden_size": 128, "embedding_dim": 128},
    # Zamba ties one shared transformer block across its hybrid layers: it needs two of them.
    "zamba": {
        "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"],
        "num_hidden_layers": 4,
    },
}
OVERRIDES["qwen4_exp"] = {"text_config": OVERRIDES["qwen4_exp_text"]}
# Mamba2 mixers chunk their prefill in ``chunk_size`` tokens (default 256, longer than the tiny
# models' context): 16, so the matrix's prompts span several chunks and reach state checkpoints.
for _mamba2 in ("bamba", "falcon_h1", "granitemoehybrid", "mamba2", "nemotron_h", "zamba2"):
    OVERRIDES[_mamba2] = {**OVERRIDES.get(_mamba2, {}), "chunk_size": 16, "mamba_chunk_size": 16}
OVERRIDES["dots3_note"] = {"text_config": OVERRIDES["dots3_note_text"]}
# Causal-LM classes that take one sub-config of the mapping's config, not the whole config.
CAUSAL_LM_SUB_CONFIG = {"musicgen": "decoder", "musicgen_melody": "decoder"}


def mapping() -> dict[str, str]:
    """model type -> causal-LM class name, as the installed transformers lists them."""
    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _is_index_list(name: str, value: Sequence, layers: int) -> bool:
    """Whether ``value`` lists layer indices (strictly increasing ints below ``layers``)."""
    if not name.endswith(INDEX_LIST_WORDS) or not value:
        return False
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in value):
        return False
    return all(a < b for a, b in itertools.pairwise(value))


def _per_layer_dict(value) -> dict[int, dict] | None:
    """``per_layer_config`` as {layer index: overrides}, or None if ``value`` is not one."""
    if not isinstance(value, dict) or not value:
        return None
    try:
        return {int(k): v for k, v in value.items()}
    except (TypeError, ValueError):
        return None


def _kept_layers(signatures: list[tuple]) -> list[int]:
    """Indices of the first layer of each distinct signature, plus the first others up to LAYERS."""
    first: dict[tuple, int] = {}
    for i, sig in enumerate(signatures):
        first.setdefault(sig, i)
    kept = list(first.values())
    kept += [i for i in range(len(signatures)) if i not in kept][: max(0, LAYERS - len(kept))]
    return sorted(kept)


def _shrunk_size(name: str, value, default) -> object:
    """The small value for size attribute ``name`` set to ``value`` in one layer whose config-wide
    value is ``default``: a layer larger (smaller) than the rest stays larger (smaller)."""
    name = name.removesuffix("_per_layer")  # laguna's num_attention_heads_per_layer
    if not isinstance(value, int) or isinstance(value, bool) or name not in SIZES:
        return value
    small = SIZES[name]
    if not isinstance(default, int) or value == default:
        return small
    return small * 2 if value > default else max(1, small // 2)


def _shrunk_layer_overrides(overrides, defaults: dict):
    """One layer's ``per_layer_config`` entry with its sizes shrunk (as the config-wide ones are)."""
    if not isinstance(overrides, dict):
        return overrides
    out = {k: _shrunk_size(k, v, defaults.get(k)) for k, v in overrides.items()}
    heads = next((n for n in HEAD_COUNTS if n in overrides), None)
    for name in KV_HEAD_COUNTS:
        if heads is not None and overrides.get(name) == overrides[heads]:
            out[name] = out[heads]  # multi-head layers stay multi-head
    return out


def _shrink_layers(defaults: dict, kwargs: dict) -> None:
    """Cuts every per-layer attribute of ``defaults`` to the kept layers (into ``kwargs``)."""
    name = next((n for n in LAYER_COUNTS if isinstance(defaults.get(n), int)), None)
    if name is None:
        return
    total = defaults[name]
    per_layer, index_lists = {}, {}
    for key, value in defaults.items():
        if key in TOKEN_IDS or not isinstance(value, (list, tuple)):
            continue
        if _is_index_list(key, value, total):
            index_lists[key] = set(value)
        elif len(value) == total and total > LAYERS:
            per_layer[key] = value
    layer_dict = _per_layer_dict(defaults.get("per_layer_config"))
    lead = {k: defaults[k] for k in LEADING_LAYERS if isinstance(defaults.get(k), int)}
    tail = {k: defaults[k] for k in TRAILING_LAYERS if isinstance(defaults.get(k), int)}
    signatures = [
        (
            tuple(repr(v[i]) for v in per_layer.values()),
            tuple(i in s for s in index_lists.values()),
            repr(layer_dict.get(i)) if layer_dict else None,
            tuple(i < n for n in lead.values()),
            tuple(i >= total - n for n in tail.values()),
        )
        for i in range(total)
    ]
    kept = _kept_layers(signatures)
    for key, value in per_layer.items():
        picked = [value[i] for i in kept]
        kwargs[key] = type(value)(_shrunk_size(key, v, None) for v in picked)
    for key, members in index_lists.items():
        kwargs[key] = [new for new, old in enumerate(kept) if old in members]
    if layer_dict is not None:
        kwargs["per_layer_config"] = {
            new: _shrunk_layer_overrides(layer_dict[old], defaults)
            for new, old in enumerate(kept)
            if old in layer_dict
        }
    for key, n in lead.items():
        kwargs[key] = sum(i < n for i in kept)
    for key, n in tail.items():
        kwargs[key] = sum(i >= total - n for i in kept)
    for key in PATTERNS:
        if isinstance(defaults.get(key), str) and len(defaults[key]) == total:
            kwargs[key] = "".join(defaults[key][i] for i in kept)
    for key in LAYER_COUNTS:
        if key in defaults:
            kwargs[key] = len(kept)


def _real_name(name: str, defaults: dict, aliases: dict[str, str]) -> str | None:
    """``name`` as the config stores it (through its ``attribute_map``), if the config has it."""
    for candidate in (name, aliases.get(name)):
        if candidate is not None and candidate in defaults:
            return candidate
    return None


def _needs_value(name: str, defaults: dict) -> bool:
    """Whether size ``name``, None in ``defaults``, must be set anyway.  A None size is mostly
    derived by the config (KV heads = heads), but some models read ``head_dim=None`` as it is (and
    those that derive it derive the value set here), and a MoE with routed experts needs a
    number of experts per token."""
    if name == "head_dim":
        return True
    experts = [defaults.get(n) for n in EXPERT_COUNTS]
    return name in EXPERTS_PER_TOKEN and any(isinstance(n, int) and n > 1 for n in experts)


def _keep_head_layout(defaults: dict, aliases: dict[str, str], kwargs: dict) -> None:
    """Multi-head attention stays multi-head (latent attention expands its keys to every query
    head, and some configs require the equality; KV heads left None mean as many as the query
    heads), multi-query stays multi-query, and a top-1 MoE stays top-1."""
    real_heads = [r for n in HEAD_COUNTS if (r := _real_name(n, defaults, aliases)) is not None]
    heads = defaults[real_heads[0]] if real_heads else None
    for name in KV_HEAD_COUNTS:
        real = _real_name(name, defaults, aliases)
        if real is None:
            continue
        if defaults[real] == 1:  # also where the heads are counted elsewhere (dbrx's attn_config)
            kwargs[real] = 1
        elif heads is not None and defaults[real] in (None, heads):
            kwargs[real] = HEADS
    for name in EXPERTS_PER_TOKEN:
        real = _real_name(name, defaults, aliases)
        if real is not None and defaults[real] == 1:
            kwargs[real] = 1


def shrink_kwargs(defaults: dict, aliases: dict[str, str] | None = None) -> dict:
    """The attributes to override in a config whose default values are ``defaults`` (its
    ``attribute_map`` is ``aliases``)."""
    aliases = aliases or {}
    kwargs = {}
    for name, value in SIZES.items():
        real = _real_name(name, defaults, aliases)
        if real is not None and (defaults[real] is not None or _needs_value(name, defaults)):
            kwargs.setdefault(real, value)
    _keep_head_layout(defaults, aliases, kwargs)
    kwargs.update({k: v for k, v in TOKEN_IDS.items() if k in defaults})
    _shrink_layers(defaults, kwargs)
    return kwargs


def _merge(base: dict, extra: dict) -> dict:
    """``extra`` over ``base``, merging nested dicts."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _own_settings(sub: PreTrainedConfig) -> dict:
    """What a parent config set in its default sub-config ``sub``: the values that differ from the
    sub-config class's own defaults.  Values the sub-config derives from its sizes (equal to the
    class defaults' derived ones) are left out, so they are derived again from the small sizes."""
    values = sub.to_dict()
    try:
        own = type(sub)().to_dict()
    except Exception:  # no default of its own: keep everything
        return values
    return {k: v for k, v in values.items() if k == "model_type" or k not in own or own[k] != v}


def _config_kwargs(config: PreTrainedConfig) -> dict:
    """Shrinking kwargs for a default ``config``, its sub-configs included (as dicts)."""
    defaults = config.to_dict()
    kwargs = shrink_kwargs(defaults, getattr(type(config), "attribute_map", {}))
    for name in getattr(type(config), "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, PreTrainedConfig):
            kwargs[name] = {**_own_settings(sub), **_config_kwargs(sub)}
    return kwargs


def _accepted(config_cls, kwargs: dict) -> dict:
    """``kwargs`` under the names ``config_cls``'s constructor takes: an attribute stored under
    an ``attribute_map`` target is passed under its alias where only the alias is a parameter.
    Other names go through as they are (the constructor keeps unknown keys, as ``from_dict``
    relies on, e.g. ``per_layer_config``)."""
    params = inspect.signature(config_cls.__init__).parameters
    inverse = {real: alias for alias, real in getattr(config_cls, "attribute_map", {}).items()}
    return {(inverse[k] if k not in params and inverse.get(k) in params else k): v for k, v in kwargs.items()}


def build_config(model_type: str) -> PreTrainedConfig:
    """The shrunk config of ``model_type`` (raises whatever the config class raises)."""
    config_cls = CONFIG_MAPPING[model_type]
    overrides = OVERRIDES.get(model_type, {})
    try:
        default = config_cls()
    except Exception:  # a default config its own validators reject: start from the fixes
        default = config_cls(**overrides)
    kwargs = _merge(_config_kwargs(default), overrides)
    # Encoder families' causal-LM classes (BertLMHeadModel, ...) are their decoder use, which
    # transformers expects to be configured as one (it warns otherwise).
    if getattr(default, "is_decoder", None) is False and not getattr(default, "is_encoder_decoder", False):
        kwargs["is_decoder"] = True
    return config_cls(**_accepted(config_cls, kwargs))


def build_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A randomly initialised tiny model of ``model_type`` in eval mode, with larger weights than
    the default init so greedy ties are rare."""
    config = build_config(model_type)
    torch.manual_seed(seed)
    if model_type in CAUSAL_LM_SUB_CONFIG:
        config = getattr(config, CAUSAL_LM_SUB_CONFIG[model_type])
        model = getattr(transformers, mapping()[model_type])._from_config(copy.deepcopy(config), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)
    randomize(model)
    # Models with per-language adapters (X-MOD) need a language for inputs that name none.
    if hasattr(model, "set_default_language") and getattr(config, "languages", None):
        model.set_default_language(config.languages[0])
    return model.eval()


def randomize(model: torch.nn.Module) -> None:
    """Larger random weights than the default init (greedy ties are rarer), and the test token ids
    (eos 2, pad 0, bos 1) in the generation config."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point():
                continue
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            else:
                # Vectors too (norm scales, biases, sinks, gates, state-space decay rates): a default
                # of all zeros or ones can hide a term, as a constant attention bias does.
                p.add_(torch.randn_like(p), alpha=0.1)
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = 2, 0, 1
