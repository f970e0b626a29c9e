"""Which models cbgen runs (cbgen.model.support): the config-based refusals, the start-up probe that
compares the packed, paged forward with the model's own, and the step metadata's context variable."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers

from cbgen import LLM, SamplingParams
from cbgen.model import attention
from cbgen.model.support import UnsupportedModelError
from oracle import compare, hf_greedy
from tiny_models import make_model, make_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class _TokenShift(torch.nn.Module):
    """Mixes each token with the previous one in the row: per-row state outside attention, the
    kind of layer that packing several sequences into one row breaks."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shifted = torch.nn.functional.pad(hidden, (0, 0, 1, 0))[:, :-1]
        return hidden + 0.5 * shifted


def _with_token_shift(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    mlp = model.model.layers[layer].mlp
    shift = _TokenShift()
    model.model.layers[layer].mlp = torch.nn.Sequential(shift, mlp)
    return model


def test_a_layer_that_mixes_tokens_outside_attention_is_refused_naming_it():
    model = _with_token_shift(make_model("llama"), layer=1)
    with pytest.raises(UnsupportedModelError, match=r"first layer whose output differs is model\.layers\.1 "):
        LLM(model, block_size=8)


def test_verify_model_false_skips_the_probe_only():
    model = _with_token_shift(make_model("llama"), layer=0)
    LLM(model, block_size=8, verify_model=False)  # the user's call: no refusal
    # A recurrent model whose attention bypasses the interface is refused statically, not by the probe.
    recurrent = transformers.RecurrentGemmaForCausalLM(
        transformers.RecurrentGemmaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            lru_width=32,
            attention_window_size=16,
        )
    )
    with pytest.raises(UnsupportedModelError, match="attention interface"):
        LLM(recurrent, verify_model=False)


def test_encoder_decoder_is_refused():
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        LLM(transformers.T5ForConditionalGeneration(config))


def test_attention_without_the_interface_is_refused():
    model = transformers.BloomForCausalLM(
        transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    )
    with pytest.raises(UnsupportedModelError, match="BloomAttention"):
        LLM(model)


def test_a_decoder_layer_that_drops_its_kwargs_still_gets_the_metadata(monkeypatch):
    """StableLM-style layers call their attention without forwarding ``**kwargs``: the paged function
    then finds the step's metadata in the context variable, and the output stays exact."""
    model = make_model("llama")
    layer_cls = type(model.model.layers[0])
    original = layer_cls.forward

    def forward_dropping_kwargs(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
        # Only the layer's named arguments go on, as in StableLM: the extra ones (cbgen's) are lost.
        kept = {k: v for k, v in kwargs.items() if k != "cbgen_meta"}
        return original(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids, **kept)

    monkeypatch.setattr(layer_cls, "forward", forward_dropping_kwargs)
    real = attention.CURRENT_META
    reads = []

    class CountingVar:
        """The real context variable, counting the paged function's reads."""

        def get(self):
            reads.append(1)
            return real.get()

        def set(self, value):
            return real.set(value)

        def reset(self, token):
            real.reset(token)

    monkeypatch.setattr(attention, "CURRENT_META", CountingVar())
    prompts = make_prompts(4, lengths=(5, 40))
    llm = LLM(model, block_size=8, max_num_batched_tokens=16, fused_decode=False)  # the module forward
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    compare(
        model, prompts, [o.outputs[0].token_ids for o in outs], [hf_greedy(model, p, 12) for p in prompts]
    )
    assert reads, "the metadata did not come through the context variable"


def test_paged_attention_outside_a_step_names_the_module_and_the_cause():
    model = make_model("llama")
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 16)
    k = torch.zeros(1, 2, 3, 16)
    errors = []

    def other_thread():
        try:
            attention.paged_attention_forward(attn, q, k, k, None)
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert errors and "LlamaAttention" in errors[0] and "outside a cbgen step" in errors[0]


def test_chunked_attention_caps_the_context_at_one_chunk():
    config = transformers.Llama4TextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        attention_chunk_size=64,
        max_position_embeddings=512,
    )
    model = transformers.Llama4ForCausalLM(config).eval()
    assert LLM(model, block_size=8).engine.max_model_len == 64
    with pytest.raises(UnsupportedModelError, match="attention chunk"):
        LLM(model, block_size=8, max_model_len=128)


def _tiny_gpt_oss() -> torch.nn.Module:
    config = transformers.GptOssConfig(
        vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    return model


def test_attention_sinks_run_exactly_and_parity_mode_refuses_them():
    model = _tiny_gpt_oss()
    prompts = make_prompts(3, lengths=(5, 30), vocab=128)
    llm = LLM(model, block_size=8, max_num_batched_tokens=16)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    compare(
        model, prompts, [o.outputs[0].token_ids for o in outs], [hf_greedy(model, p, 12) for p in prompts]
    )
    with pytest.raises(UnsupportedModelError, match="attention sinks"):
        LLM(model, block_size=8, batch_invariant=True)
