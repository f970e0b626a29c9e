"""The trainer side of parity mode where trainers run it: gradient checkpointing (both of torch's
modes, backward inside or after the context, with and without PEFT), masks passed by position,
position_ids that disagree with the mask, masks the parity attention cannot reproduce, an engine
step inside the context, and prompt logprobs equal to the trainer's bit for bit."""

from __future__ import annotations

import pytest
import torch

import cbgen
from cbgen import LLM, SamplingParams
from extras import require_extra
from tiny_models import make_model, make_prompts, make_wide_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(vocab: int, seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 28 tokens, two of them left-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 28), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :11] = 0
    return ids, mask


def _loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(ids, attention_mask=mask).logits
    return cbgen.token_logprobs(logits[:, :-1], ids[:, 1:]).mul(mask[:, 1:]).sum()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _peft(model: torch.nn.Module) -> torch.nn.Module:
    require_extra("peft")
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    wrapped = get_peft_model(model, lora)
    with torch.no_grad():  # LoRA's B starts at zero; make the adapters change the forward
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return wrapped


@pytest.mark.parametrize("peft", [False, True], ids=["plain", "peft"])
def test_gradient_checkpointing_gives_the_parity_forwards_gradients(peft: bool) -> None:
    """With checkpointing (reentrant or not) and the backward inside or after the context, the
    gradients are the non-checkpointed parity backward's, bit for bit: the recomputation replays
    the parity forward.  (Before: the non-reentrant mode raised torch's CheckpointError, the
    reentrant one gave layer 0's q_proj gradient 65% off.)"""
    model = make_wide_model("llama")
    if peft:
        model = _peft(model)
    model.train()
    ids, mask = _batch(model.config.vocab_size)
    with cbgen.parity(model):
        _loss(model, ids, mask).backward()
    want = _grads(model)
    assert len(want) > 4
    for reentrant in (False, True):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        if reentrant:
            model.enable_input_require_grads()  # reentrant checkpointing needs a grad-carrying input
        for inside in (True, False):
            with cbgen.parity(model):
                loss = _loss(model, ids, mask)
                if inside:
                    loss.backward()
            if not inside:
                loss.backward()
            got = _grads(model)
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), (reentrant, inside, name)
        model.activation_checkpointing_disable()
    # The checkpoint functions the context wrapped are the model's own again.
    assert not any(
        "Switch" in type(m.__dict__.get("_gradient_checkpointing_func")).__name__ for m in model.modules()
    )


def test_checkpointing_outside_parity_is_untouched() -> None:
    """After a parity context closed, a checkpointed forward and backward run the model's own path:
    the gradients of the plain forward (up to rounding)."""
    model = make_model("llama")
    model.train()
    ids, mask = _batch(model.config.vocab_size)
    with cbgen.parity(model):
        pass
    _loss(model, ids, mask).backward()
    want = _grads(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    _loss(model, ids, mask).backward()
    got = _grads(model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_a_positional_mask_is_read() -> None:
    """``model(ids, mask)`` inside the context gives ``model(ids, attention_mask=mask)``'s logits.
    (Before: the pre-hook read the keyword only, and left-padded rows' logits were off by up to 3.45.)"""
    model = make_wide_model("qwen2")
    ids, mask = _batch(model.config.vocab_size)
    with torch.no_grad(), cbgen.parity(model):
        by_name = model(ids, attention_mask=mask).logits
        by_position = model(ids, mask).logits
    assert torch.equal(by_position, by_name)
    # And a left-padded row is its unpadded self.
    row = mask[2].bool()
    with torch.no_grad(), cbgen.parity(model):
        alone = model(ids[2:3, row]).logits[0]
    assert torch.equal(by_name[2, row], alone)


def test_position_ids_that_disagree_with_the_mask_raise() -> None:
    model = make_model("llama")
    ids, mask = _batch(model.config.vocab_size)
    shifted = torch.arange(ids.shape[1]).expand_as(ids)  # positions counted from the padding
    with torch.no_grad(), cbgen.parity(model), pytest.raises(ValueError, match="position_ids"):
        model(ids, attention_mask=mask, position_ids=shifted)


def test_a_mask_parity_cannot_reproduce_is_refused() -> None:
    """Packed sequences (position_ids restarting inside a row, no mask) make a block-diagonal mask:
    refused, not computed as one causal sequence.  (With a KV cache transformers builds a causal
    mask instead, and the position check refuses the same call.)"""
    model = make_model("llama")
    ids = torch.randint(3, 500, (1, 20))
    packed = torch.cat([torch.arange(12), torch.arange(8)])[None]
    with torch.no_grad(), cbgen.parity(model):
        with pytest.raises(NotImplementedError, match="packed sequences"):
            model(ids, position_ids=packed, use_cache=False)
        with pytest.raises(ValueError, match="position_ids"):
            model(ids, position_ids=packed)


def test_padding_inside_a_row_is_refused() -> None:
    model = make_model("llama")
    ids, mask = _batch(model.config.vocab_size)
    mask[0, 10:12] = 0  # a hole between real tokens
    with torch.no_grad(), cbgen.parity(model), pytest.raises(NotImplementedError, match="between"):
        model(ids, attention_mask=mask)


def test_the_forward_is_refused_with_a_kv_cache() -> None:
    model = make_model("llama")
    ids = torch.randint(3, 500, (1, 8))
    with torch.no_grad(), cbgen.parity(model), pytest.raises(NotImplementedError, match="KV cache"):
        model.generate(ids, max_new_tokens=2, do_sample=False)
    assert model.config._attn_implementation == "sdpa"


def test_an_engine_step_inside_the_context_is_refused() -> None:
    model = make_model("llama")
    llm = LLM(model, seed=0)
    with cbgen.parity(model), pytest.raises(RuntimeError, match=r"inside `with cbgen\.parity"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    # The engine serves the next request (the failed one ended with its error).
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prompt_logprobs_equal_the_trainers_bit_for_bit(dtype: torch.dtype) -> None:
    """Parity mode's prompt logprobs (the prompt token's and the top candidates') are the trainer's
    ``token_logprobs`` of its parity forward, bit for bit.  (Before: 83 of 217 differed, up to 4.8e-7.)"""
    model = make_wide_model("llama", dtype=dtype)
    llm = LLM(model, seed=0, batch_invariant=True, max_num_batched_tokens=48)
    prompts = make_prompts(6, (5, 60), vocab=model.config.vocab_size, seed=9)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)
    compared = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor(prompt)[None]
        with torch.no_grad(), cbgen.parity(model):
            logits = model(ids).logits[0, :-1]
        entries = out.prompt_logprobs[1:]
        assert len(entries) == len(prompt) - 1
        for t, entry in enumerate(entries):
            for token, value in entry.items():
                want = cbgen.token_logprobs(logits[t], torch.tensor(token))
                assert torch.equal(torch.tensor(value, dtype=torch.float32), want), (t, token)
                compared += 1
    assert compared > 3 * sum(len(p) - 1 for p in prompts)
